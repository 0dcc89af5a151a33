"""Any Keras model trains exactly as plain Keras trains it on one device.

Each model is built twice from the same seed: one is compiled and trained with
``train_on_batch`` on the whole batch (the reference), the other is handed to ``Pipeline``
(the template; never rebuilt from its config). Both train the same batches; losses, every
weight (``get_weights``, a tied variable once) and the evaluation loss must agree.

Models:
  skip       functional MLP whose skip connection jumps over two stages (S=4)
  two_inputs a dict of an integer input (token ids, embedded) and a float input (S=2, R=2)
  tied_lm    a language model whose output head reads the embedding matrix (S=2 and S=4, R=2)
  two_outputs  a dict of two outputs with their own losses (one reduced by "sum") and
             loss_weights, trained with sample weights (S=2, R=2)
  masked_tokens  Embedding(mask_zero=True): the mask crosses the cut with the activations
             and the per-token loss is the mean over unmasked tokens (S=2, R=2)
  masked_pool    the mask crosses the cut and a later stage's pooling consumes it
  shared     one Dense layer called on two different stages
  no_config  a custom layer without get_config (its constructor takes an argument)

Each runs GPipe with M=1, 1F1B with M=4 and interleaved (2 virtual stages) with M=4.
"""

import functools
import sys

import keras
import numpy as np
import pytest

import hybrid
from hybrid.engine.programs import row_sums

import reference as ref
import runner

BATCH = 16
STEPS = 2
VOCAB, LENGTH, WIDTH = 12, 5, 8


class TiedHead(keras.layers.Layer):
    """Logits from the embedding matrix of ``embedding`` (weight tying)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))


class Scale(keras.layers.Layer):
    """x · w + shift, with a constructor argument and no get_config."""

    def __init__(self, shift):
        super().__init__()
        self.shift = shift

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="random_normal")

    def call(self, x):
        return x * self.w + self.shift


def dense(units=16, activation="tanh"):
    return keras.layers.Dense(units, activation=activation)


def skip_model():
    x = keras.Input((ref.IN_FEATURES,))
    a = dense()(x)
    b = dense()(a)
    c = dense()(b)
    h = keras.layers.Add()([a, c])  # a jumps over the stages of b and c
    h = dense()(h)
    h = dense()(h)
    h = dense()(h)
    return keras.Model(x, keras.layers.Dense(ref.CLASSES)(h))


def two_inputs_model():
    ids = keras.Input((LENGTH,), dtype="int32", name="ids")
    features = keras.Input((ref.IN_FEATURES,), name="features")
    e = keras.layers.Flatten()(keras.layers.Embedding(VOCAB, 4)(ids))
    f = dense()(features)
    h = keras.layers.Concatenate()([e, f])
    h = dense()(h)
    return keras.Model({"ids": ids, "features": features}, keras.layers.Dense(ref.CLASSES)(h))


def tied_lm_model():
    ids = keras.Input((LENGTH,), dtype="int32")
    embedding = keras.layers.Embedding(VOCAB, WIDTH)
    h = embedding(ids)
    for _ in range(6):
        h = dense(WIDTH)(h)
    return keras.Model(ids, TiedHead(embedding)(h))


def shared_model():
    x = keras.Input((ref.IN_FEATURES,))
    shared = dense()
    h = shared(dense(ref.IN_FEATURES)(x))
    h = dense()(h)
    h = dense()(h)
    h = shared(dense(ref.IN_FEATURES)(h))  # the same kernel, on a later stage
    h = dense()(h)
    return keras.Model(x, keras.layers.Dense(ref.CLASSES)(h))


def no_config_model():
    x = keras.Input((ref.IN_FEATURES,))
    h = dense()(x)
    h = Scale(0.5)(h)
    h = dense()(h)
    h = Scale(-0.25)(h)
    return keras.Model(x, keras.layers.Dense(ref.CLASSES)(h))


def two_outputs_model():
    x = keras.Input((ref.IN_FEATURES,))
    h = dense()(x)
    h = dense()(h)
    value = keras.layers.Dense(3, name="value")(dense()(h))
    label = keras.layers.Dense(ref.CLASSES, name="label")(dense()(h))
    return keras.Model(x, {"label": label, "value": value})


def two_outputs_batch(step):
    rng = np.random.default_rng(step + 1)
    x = rng.normal(size=(BATCH, ref.IN_FEATURES)).astype("float32")
    y = {
        "label": rng.integers(0, ref.CLASSES, size=(BATCH,)).astype("int32"),
        "value": rng.normal(size=(BATCH, 3)).astype("float32"),
    }
    return x, y


def masked_tokens_model():
    ids = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(ids)
    h = dense(WIDTH)(h)
    h = dense(WIDTH)(h)
    return keras.Model(ids, keras.layers.Dense(VOCAB)(h))


def masked_pool_model():
    ids = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(ids)
    h = dense(WIDTH)(h)
    h = keras.layers.GlobalAveragePooling1D()(h)  # averages the unmasked positions
    return keras.Model(ids, keras.layers.Dense(ref.CLASSES)(h))


def padded_ids(rng):
    """Token ids with a padded (0) tail of random length per example."""
    ids = rng.integers(1, VOCAB, size=(BATCH, LENGTH)).astype("int32")
    lengths = rng.integers(1, LENGTH + 1, size=(BATCH,))
    ids[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    return ids


def masked_tokens_batch(step):
    rng = np.random.default_rng(step + 1)
    return padded_ids(rng), rng.integers(0, VOCAB, size=(BATCH, LENGTH)).astype("int32")


def masked_pool_batch(step):
    rng = np.random.default_rng(step + 1)
    return padded_ids(rng), rng.integers(0, ref.CLASSES, size=(BATCH,)).astype("int32")


def classes_batch(step):
    return ref.batch(BATCH, seed=step + 1)


def dict_batch(step):
    rng = np.random.default_rng(step + 1)
    x = {
        "ids": rng.integers(0, VOCAB, size=(BATCH, LENGTH)).astype("int32"),
        "features": rng.normal(size=(BATCH, ref.IN_FEATURES)).astype("float32"),
    }
    return x, rng.integers(0, ref.CLASSES, size=(BATCH,)).astype("int32")


def tokens_batch(step):
    rng = np.random.default_rng(step + 1)
    ids = rng.integers(0, VOCAB, size=(BATCH, LENGTH + 1)).astype("int32")
    return ids[:, :-1], ids[:, 1:]


MODELS = {
    # name: (builder, batch, mesh (S, R), explicit balance for S model stages or None)
    "skip": (skip_model, classes_batch, (4, 1), [1, 1, 1, 5]),
    "two_inputs": (two_inputs_model, dict_batch, (2, 2), None),
    "two_outputs": (two_outputs_model, two_outputs_batch, (2, 2), None),
    "tied_lm": (tied_lm_model, tokens_batch, (2, 2), None),
    "tied_lm_s4": (tied_lm_model, tokens_batch, (4, 2), None),
    "masked_tokens": (masked_tokens_model, masked_tokens_batch, (2, 2), [1, 3]),
    "masked_pool": (masked_pool_model, masked_pool_batch, (2, 1), [3, 2]),
    "shared": (shared_model, classes_batch, (2, 1), [3, 5]),
    "no_config": (no_config_model, classes_batch, (2, 1), None),
}
# 1F1B keeps activations and defers its weight gradients (one pass per stage and step).
RUNS = [("gpipe", 1), ("1f1b", 4), ("interleaved", 4)]
GRID = [
    pytest.param(name, schedule, m, id=f"{name}-{schedule}-M{m}")
    for name in MODELS
    for schedule, m in RUNS
    if name != "tied_lm_s4" or schedule == "interleaved"  # S=4 R=2: the slowest to build
]


DEFERRED = {"remat": "never", "defer_weight_gradients": True}


def build(builder, seed):
    keras.utils.set_random_seed(seed)
    return builder()


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def objective(name):
    """The compile arguments of model ``name``: its loss(es) and loss weights."""
    if name != "two_outputs":
        return {"loss": loss()}
    return {
        "loss": {"label": loss(), "value": keras.losses.MeanSquaredError(reduction="sum")},
        "loss_weights": {"label": 1.0, "value": 0.25},
    }


def sample_weights(name, step):
    if name != "two_outputs":
        return None
    w = np.random.default_rng(50 + step).uniform(0, 2, size=(BATCH,)).astype("float32")
    w[:2] = 0.0
    return w


@functools.cache
def keras_run(name):
    """Plain Keras's run of model ``name``, the same for every schedule (each test process
    trains it once): the model after :data:`STEPS` ``train_on_batch`` steps, its initial
    weights, each step's loss, and its evaluation (a dict) and predictions of batch 9."""
    builder, batch, _, _ = MODELS[name]
    keras_model = build(builder, seed=0)
    keras_model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), **objective(name))
    initial = keras_model.get_weights()
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        want = keras_model.train_on_batch(x, y, sample_weight=sample_weights(name, step))
        losses.append(want[0] if isinstance(want, list) else want)  # [total, per output]
    x, y = batch(9)
    evaluation = keras_model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return keras_model, initial, losses, evaluation, keras_model.predict(x, verbose=0)


@pytest.mark.parametrize("name,schedule,micro_batches", GRID)
def test_model_trains_as_keras_trains_it(name, schedule, micro_batches):
    builder, batch, (stages, replicas), balance = MODELS[name]
    keras_model, initial, losses, evaluation, predictions = keras_run(name)
    template = build(builder, seed=1)
    template.set_weights(initial)
    pipe = hybrid.Pipeline(
        template,
        mesh=hybrid.DeviceMesh.create(stages, replicas),
        micro_batches=micro_batches,
        schedule=schedule,
        virtual_stages=2 if schedule == "interleaved" else 1,
        balance=balance if schedule != "interleaved" else None,
        **DEFERRED if schedule == "1f1b" else {},
    )
    pipe.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9), jit_compile=False, **objective(name)
    )
    for step in range(STEPS):
        x, y = batch(step)
        got = pipe.train_step(x, y, sample_weight=sample_weights(name, step))["loss"]
        np.testing.assert_allclose(got, losses[step], rtol=1e-5, err_msg=f"loss of step {step}")
    if schedule == "1f1b":  # every stage computed its weight gradients once per step
        plans = [copy.deferral for row in pipe.stages for copy in row]
        assert all(isinstance(p, row_sums.Plan) for p in plans), plans
    assert len(pipe.get_weights()) == len(keras_model.get_weights())
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())
    for r in range(replicas):
        ref.assert_weights_close(pipe.replica_weights(r), keras_model.get_weights())
    x, y = batch(9)
    got = pipe.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert got.keys() == evaluation.keys()  # with several outputs: each output's loss too
    for key in evaluation:
        np.testing.assert_allclose(got[key], evaluation[key], rtol=1e-5, err_msg=key)
    got, want = pipe.predict(x, verbose=0), predictions
    if isinstance(want, dict):
        assert sorted(got) == sorted(want)
        got, want = [got[k] for k in sorted(got)], [want[k] for k in sorted(want)]
    ref.assert_weights_close(
        list(got) if isinstance(got, list) else [got],
        list(want) if isinstance(want, list) else [want],
        rtol=0,
        atol=1e-5,
    )


def sgd_pipeline(template):
    """``template`` on a 2×1 mesh with plain SGD, without XLA."""
    pipe = hybrid.Pipeline(template, mesh=hybrid.DeviceMesh.create(2, 1))
    pipe.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss(), jit_compile=False)
    return pipe


def test_tied_variable_is_one_variable_held_by_two_stages():
    template = build(tied_lm_model, seed=0)
    pipe = sgd_pipeline(template)
    x, y = tokens_batch(0)
    pipe.train_step(x, y)
    embedding = template.layers[1].embeddings
    first, last = pipe.stages[0][0], pipe.stages[-1][0]
    assert any(v is embedding for v in first.templates)
    assert any(v is embedding for v in last.templates)
    copies = [
        copy.variables[[id(v) for v in copy.templates].index(id(embedding))].numpy()
        for copy in (first, last)
    ]
    np.testing.assert_array_equal(copies[0], copies[1])
    assert not np.array_equal(copies[0], embedding.numpy())  # trained, the template untouched


def test_untied_copies_would_fail():
    """Without the tie the head's copy drifts from the embedding: the check can fail."""
    keras_model = build(tied_lm_model, seed=0)
    keras_model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
    template = build(tied_lm_model, seed=1)
    template.set_weights(keras_model.get_weights())
    pipe = sgd_pipeline(template)
    pipe.build((None, LENGTH), "int32")
    pipe._ties = []  # what a pipeline that forgot the tie would do
    x, y = tokens_batch(0)
    keras_model.train_on_batch(x, y)
    pipe.train_step(x, y)
    with pytest.raises(AssertionError):
        ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())


def test_to_keras_writes_the_training_into_the_users_model(tmp_path):
    template = build(skip_model, seed=0)
    before = template.get_weights()
    pipe = sgd_pipeline(template)
    x, y = classes_batch(0)
    pipe.train_step(x, y)
    ref.assert_weights_close(template.get_weights(), before, rtol=0, atol=0)  # not yet
    model = pipe.to_keras()
    assert model is template
    ref.assert_weights_close(model.get_weights(), pipe.get_weights(), rtol=0, atol=0)
    np.testing.assert_allclose(model.predict(x, verbose=0), pipe.predict(x, verbose=0), atol=1e-5)
    model.save(tmp_path / "trained.keras")
    loaded = keras.saving.load_model(tmp_path / "trained.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), pipe.predict(x, verbose=0), atol=1e-5)
    layers = ref.mlp_layers()  # a list of layers comes back as a Sequential of them
    listed = hybrid.Pipeline(layers, mesh=hybrid.DeviceMesh.create(2, 1))
    listed.compile(optimizer="sgd", loss=loss())
    listed.train_step(x, y)
    sequential = listed.to_keras()
    assert isinstance(sequential, keras.Sequential) and sequential.layers == layers
    np.testing.assert_allclose(
        sequential.predict(x, verbose=0), listed.predict(x, verbose=0), atol=1e-5
    )


def test_layers_of_a_model_with_merges_are_refused():
    with pytest.raises(ValueError, match="pass the Keras model itself"):
        hybrid.Pipeline(skip_model().layers, mesh=hybrid.DeviceMesh.create(2, 1)).compile(
            optimizer=keras.optimizers.SGD(0.1), loss=loss()
        )


def test_a_subclassed_model_is_refused_with_the_way_out():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.a, self.b = dense(), dense()

        def call(self, x):
            return self.b(self.a(x))

    with pytest.raises(TypeError, match="Express it as a functional model"):
        hybrid.Pipeline(Net(), mesh=hybrid.DeviceMesh.create(2, 1)).compile(
            optimizer=keras.optimizers.SGD(0.1), loss=loss()
        )


def test_a_dict_model_names_the_inputs_it_expects():
    pipe = hybrid.Pipeline(two_inputs_model(), mesh=hybrid.DeviceMesh.create(2, 1))
    pipe.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
    x, y = dict_batch(0)
    expected = r"inputs named \['features', 'ids'\], got a dict of \['ids'\]"
    with pytest.raises(ValueError, match=expected):
        pipe.train_step({"ids": x["ids"]}, y)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
