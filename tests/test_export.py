"""A trained pipeline back as Keras and as SavedModels for serving.

``to_keras`` writes the trained weights into the user's own model object, which
``model.save`` / ``keras.saving.load_model`` round-trip; a checkpoint becomes a Keras model
without a mesh; ``export`` writes a SavedModel whose ``serving_default`` (called through
``saved_model_cli run``, as TF Serving calls it) equals ``pipe.predict``; ``per_stage=True``
writes one SavedModel per stage whose chain, and ``hybrid.run.serving``'s pipelined run of it,
equal ``pipe.predict``.
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import hybrid
from hybrid.run import checkpoint, serving

import reference as ref
import runner


def skip_model(seed=0):
    """A functional model with a skip over the cut and two outputs."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((ref.IN_FEATURES,), name="features")
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    deeper = keras.layers.Dense(16, activation="tanh")(hidden)
    merged = keras.layers.Add()([hidden, deeper])
    logits = keras.layers.Dense(ref.CLASSES, name="logits")(merged)
    value = keras.layers.Dense(1, name="value")(merged)
    return keras.Model(inputs, [logits, value])


def trained(model, stages=2, replicas=1, balance=None):
    pipe = hybrid.Pipeline(
        model, hybrid.DeviceMesh.create(stages, replicas), micro_batches=2, balance=balance
    )
    pipe.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=[keras.losses.SparseCategoricalCrossentropy(from_logits=True), "mse"],
        jit_compile=False,
    )
    for step in range(2):
        x, y = ref.batch(16, seed=step)
        pipe.train_step(x, [y, x[:, :1]])
    return pipe


def test_to_keras_is_the_users_model_with_the_trained_weights(tmp_path):
    model = skip_model()
    pipe = trained(model)
    assert pipe.to_keras() is model
    ref.assert_weights_close(model.get_weights(), pipe.get_weights(), rtol=0, atol=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    x, _ = ref.batch(8, seed=7)
    for got, want in zip(loaded.predict(x, verbose=0), pipe.predict(x, verbose=0), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_weights_files_round_trip_through_keras(tmp_path):
    """save_weights/load_weights (what ModelCheckpoint(save_weights_only=True) and
    EarlyStopping(restore_best_weights) use) go through the user's model, onto every device."""
    pipe = trained(skip_model(), replicas=2)
    pipe.save_weights(str(tmp_path / "m.weights.h5"))
    other = trained(skip_model(seed=3), replicas=2)
    other.load_weights(str(tmp_path / "m.weights.h5"))
    for r in range(2):
        ref.assert_weights_close(other.replica_weights(r), pipe.get_weights(), rtol=0, atol=0)


def test_a_checkpoint_becomes_a_keras_model_without_a_mesh(tmp_path):
    pipe = trained(skip_model(), stages=2, replicas=2)
    hybrid.Checkpointer(pipe, str(tmp_path / "ckpt")).save(step=2)
    fresh = skip_model(seed=5)  # other initial weights
    restored = checkpoint.to_keras(str(tmp_path / "ckpt"), fresh)
    assert restored is fresh
    ref.assert_weights_close(fresh.get_weights(), pipe.get_weights(), rtol=0, atol=0)
    out = tmp_path / "from_ckpt.keras"
    checkpoint.to_keras(str(tmp_path / "ckpt"), skip_model(seed=6), save_to=str(out))
    ref.assert_weights_close(keras.saving.load_model(out).get_weights(), pipe.get_weights())


def signature_input(path):
    loaded = tf.saved_model.load(path)
    _, inputs = loaded.signatures["serving_default"].structured_input_signature
    return loaded, list(inputs)


def test_export_serves_what_predict_returns(tmp_path):
    pipe = trained(skip_model())
    x, _ = ref.batch(5, seed=3)  # any batch size
    want = pipe.predict(x, verbose=0)
    path = str(tmp_path / "whole")
    pipe.export(path)
    loaded, names = signature_input(path)
    served = loaded.serve(tf.constant(x))
    for got, expected in zip(served, want, strict=True):
        np.testing.assert_allclose(got.numpy(), expected, atol=1e-5)
    # what TF Serving calls: the serving_default signature, here through saved_model_cli
    np.save(tmp_path / "x.npy", x)
    cli = [sys.executable, "-m", "tensorflow.python.tools.saved_model_cli"]  # saved_model_cli
    run = subprocess.run(
        cli
        + ["run", "--dir", path, "--tag_set", "serve", "--signature_def", "serving_default"]
        + ["--inputs", f"{names[0]}={tmp_path / 'x.npy'}", "--outdir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    outputs = sorted(os.listdir(tmp_path / "out"))
    assert len(outputs) == 2, outputs
    served = [np.load(tmp_path / "out" / name) for name in outputs]
    for expected in want:  # output names are Keras's; match each by shape
        (got,) = [s for s in served if s.shape == expected.shape]
        np.testing.assert_allclose(got, expected, atol=1e-5)


def test_per_stage_export_chains_to_predict_and_serves_pipelined(tmp_path):
    pipe = trained(skip_model(), stages=2, balance=[2, 3])  # the cut before the Add
    x, _ = ref.batch(8, seed=4)
    want = pipe.predict(x, verbose=0)
    path = str(tmp_path / "stages")
    pipe.export(path, per_stage=True)
    manifest = json.load(open(os.path.join(path, "pipeline.json")))
    assert [s["path"] for s in manifest["stages"]] == ["stage_0", "stage_1"]
    assert [i["name"] for i in manifest["stages"][0]["inputs"]] == ["input_0"]
    # the skip: stage 1 takes two tensors across the cut
    assert [i["name"] for i in manifest["stages"][1]["inputs"]] == ["cut1_0", "cut1_1"]
    values = {"input_0": tf.constant(x)}
    for stage in manifest["stages"]:
        signature = tf.saved_model.load(os.path.join(path, stage["path"])).signatures[
            "serving_default"
        ]
        out = signature(**{i["name"]: values[i["name"]] for i in stage["inputs"]})
        values = {name: out[name] for name in stage["outputs"]}
    chained = [values["output_0"].numpy(), values["output_1"].numpy()]
    for got, expected in zip(chained, want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    server = serving.load(path, devices=devices)
    for got, expected in zip(server.predict(x, micro_batches=4), want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-5)
    # The launcher's --export_dir layout: the whole model at the top, the stages under stages/.
    assert serving.manifest_directory(str(tmp_path)) == path
    with pytest.raises(FileNotFoundError, match="is not a per-stage export.*per_stage=True"):
        serving.load(str(tmp_path / "nothing"))


def test_outputs_load_in_a_fresh_process_as_the_launcher_says(tmp_path):
    """The reference Transformer's .keras file loads in a new process, outside the
    repository, with the import the launcher's last lines name; its SavedModel export loads
    with TensorFlow alone, its per-stage export with hybrid.run.serving."""
    from hybrid.launch import train as launcher

    model = hybrid.models.transformer(
        vocab_size=32, seq_len=8, d_model=16, num_blocks=2, graph=True
    )
    pipe = hybrid.Pipeline(model, hybrid.DeviceMesh.create(2, 1))
    pipe.compile(
        keras.optimizers.Adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    tokens = np.arange(32, dtype="int32").reshape(4, 8) % 32
    pipe.build((4, 8), "int32")
    want = pipe.predict(tokens, verbose=0)
    pipe.save(str(tmp_path / "lm.keras"))
    pipe.export(str(tmp_path / "lm"))
    pipe.export(str(tmp_path / "stages"), per_stage=True)
    np.save(tmp_path / "tokens.npy", tokens)
    loads = launcher._loads_with("transformer")
    assert loads == "import hybrid.models.transformer; keras.saving.load_model"
    script = (
        "import numpy as np, keras, tensorflow as tf; import hybrid.models.transformer\n"
        "x = np.load('tokens.npy')\n"
        "np.save('keras.npy', keras.saving.load_model('lm.keras').predict(x, verbose=0))\n"
        "served = tf.saved_model.load('lm').signatures['serving_default']\n"
        "np.save('served.npy', list(served(tf.constant(x)).values())[0].numpy())\n"
        "from hybrid.run import serving\n"
        "out = serving.load('stages').predict(x, micro_batches=2)\n"
        "np.save('stages.npy', np.asarray(out[0] if isinstance(out, (list, tuple)) else out))\n"
    )
    env = {**os.environ, "PYTHONPATH": ""}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("keras", "served", "stages"):
        np.testing.assert_allclose(np.load(tmp_path / f"{name}.npy"), want, atol=1e-5)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
