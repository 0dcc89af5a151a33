"""The launcher as a user runs it: a real process, real flags, clear errors."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybrid.launch.train", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})},
    )


def first_and_last_loss(run: subprocess.CompletedProcess) -> tuple[float, float, str]:
    """The losses of the first and last step from the launcher's ``done:`` line, and it."""
    (done,) = [line for line in run.stdout.splitlines() if line.startswith("done:")]
    first, last = (float(v) for v in done.split("loss ")[1].split(" over")[0].split(" -> "))
    return first, last, done


SMALL_TRANSFORMER = (
    "--mesh=stage:2;replica:2",
    "--micro_batches=2",
    "--global_batch_size=16",
    "--train_steps=30",
    "--width=32",
    "--depth=1",
    "--seq_len=32",
)


@pytest.mark.long
def test_trains_the_transformer_on_text_and_loss_falls(tmp_path):
    run = launch(
        *SMALL_TRANSFORMER,
        "--tie_embeddings",  # the head reads the embedding: one variable on stages 0 and 1
        "--learning_rate=0.01",
        "--log_every=10",
        f"--model_dir={tmp_path}",
        "--profile_steps=3,4",
        "--timeline_every=10",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # steps 10, 20 and 30 ran timed: a line each, and their Gantt charts
    assert run.stdout.count("timeline step ") == 3, run.stdout[-3000:]
    assert "device 1 compute" in run.stdout and "all-reduce" in run.stdout
    written = sorted(os.listdir(tmp_path / "timeline"))
    assert written == sorted(f"step_{n}.{e}" for n in (10, 20, 30) for e in ("png", "trace.json"))
    assert "mesh stage:2;replica:2" in run.stdout
    assert "examples/s" in run.stdout and "eta 0:00:00" in run.stdout
    first, last, done = first_and_last_loss(run)
    assert first > 5.0  # ~ln(256): bytes are uniform to a fresh model
    assert last < 0.7 * first, done
    assert os.path.exists(os.path.join(tmp_path, "ckpt-30.index"))
    events = os.listdir(os.path.join(tmp_path, "train"))
    assert any(name.startswith("events.out.tfevents") for name in events)
    traces = [f for _, _, files in os.walk(tmp_path / "profile") for f in files]
    assert any(f.endswith(".xplane.pb") for f in traces), traces
    # a finished run: converts its last checkpoint to a .keras file and SavedModels
    again = launch(
        *SMALL_TRANSFORMER,
        "--mesh=stage:2,replica:2",  # the same mesh in the comma form: no change to report
        "--tie_embeddings",
        f"--model_dir={tmp_path}",
        f"--export_dir={tmp_path}/export",
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already trained to step 30" in again.stdout
    assert "--mesh:" not in again.stdout + again.stderr, again.stdout[-2000:]
    check = subprocess.run(
        [sys.executable, "-c", EXPORTS_AGREE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr[-3000:]


# The SavedModel's serving_default and the per-stage exports served pipelined give the same
# logits for the same tokens.
EXPORTS_AGREE = """
import sys, numpy as np, tensorflow as tf
import hybrid
hybrid.simulate_cpu_devices(2)
from hybrid.run import serving
path = sys.argv[1]
tokens = np.random.default_rng(0).integers(0, 256, size=(4, 32)).astype("int32")
signature = tf.saved_model.load(path + "/export").signatures["serving_default"]
(name,) = signature.structured_input_signature[1]
want = next(iter(signature(**{name: tf.constant(tokens)}).values())).numpy()
assert want.shape == (4, 32, 256)
pipelined = serving.load(path + "/export").predict(tokens, micro_batches=2)  # finds stages/
np.testing.assert_allclose(pipelined, want, atol=1e-4)
"""


def test_mesh_auto_trains_on_the_planned_mesh(tmp_path):
    run = launch(
        "--mesh=auto", "--simulated_devices=2", "--model=mlp", "--data=synthetic", "--width=16",
        "--depth=1", "--global_batch_size=8", "--train_steps=4", "--schedule=1f1b",
        "--progress_bar", f"--keras_file={tmp_path}/mlp.keras", "--memory_per_device=1GiB",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "4/4" in run.stdout and "loss:" in run.stdout  # Keras's progress bar
    trained = keras.saving.load_model(tmp_path / "mlp.keras")
    assert trained.predict(np.zeros((2, 64), "float32"), verbose=0).shape == (2, 10)
    planned = [line for line in run.stdout.splitlines() if line.startswith("planned: ")]
    assert planned and "--schedule=1f1b" in planned[0]  # a flag given explicitly stays fixed
    spec = planned[0].split("--mesh=")[1].split(" ")[0]
    assert spec in ("stage:1,replica:2", "stage:2,replica:1")  # the form a shell takes
    assert f"mesh {spec.replace(',', ';')} devices" in run.stdout and "done:" in run.stdout
    deferred = "--defer_weight_gradients=True" in planned[0]  # the plan's choice is applied
    assert deferred or "--defer_weight_gradients=False" in planned[0], planned[0]
    assert ("deferred weight gradients" in run.stdout) == deferred
    sharded = "--shard_optimizer_states=True" in planned[0]  # judged under a memory budget
    assert sharded or "--shard_optimizer_states=False" in planned[0], planned[0]
    # capped devices (one worker process each): their own allocators' peaks, measured
    assert "\npeak memory per stage (replica 0): stage 0" in run.stdout


def test_micro_batches_auto_times_every_m_at_the_first_step():
    run = launch(
        "--mesh=stage:2;replica:1", "--micro_batches=auto", "--model=mlp", "--data=synthetic",
        "--width=16", "--depth=1", "--global_batch_size=4", "--train_steps=2",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "micro_batches auto schedule gpipe" in run.stdout, run.stdout[-2000:]
    (chose,) = [line for line in run.stderr.splitlines() if "micro_batches='auto' chose" in line]
    timed = chose.split("(gradient step: ")[1]
    assert [t.split(" ")[0] for t in timed.split(", ")] == ["M=1", "M=2", "M=4"]
    assert "done:" in run.stdout


def test_trains_your_own_model_and_data_with_any_optimizer_and_precision(tmp_path):
    run = launch(
        "--model=user_model:model", "--data=user_model:data", "--mesh=stage:2,replica:1",
        "--micro_batches=2", "--global_batch_size=32", "--train_steps=30", "--log_every=30",
        "--optimizer=adamw", '--optimizer_config={"weight_decay": 0.001}',
        "--learning_rate=0.01", "--precision=mixed_bfloat16", f"--keras_file={tmp_path}/m.keras",
        "--validation_data=user_model:data", "--validation_steps=2", f"--model_dir={tmp_path}/run",
        env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    first, last, done = first_and_last_loss(run)
    assert last < 0.8 * first, done
    trained = keras.saving.load_model(tmp_path / "m.keras")
    assert trained.layers[1].dtype_policy.name == "mixed_bfloat16"
    # What it is doing: the compile announced and timed, your metrics, validation, outputs.
    lines = run.stdout.splitlines()
    assert "compiling 2 stage programs (the first step)..." in lines, run.stdout[-3000:]
    assert any(line.startswith("compiled and ran step 1 in ") for line in lines)
    (step,) = [line for line in lines if line.startswith("step ")]
    assert "  accuracy 0." in step, step  # the model function's metrics=["accuracy"]
    (validation,) = [line for line in lines if line.startswith("validation after step 30: ")]
    assert "val_accuracy" in validation and "val_loss" in validation
    assert f"  tensorboard --logdir {tmp_path}/run" in lines
    assert f"  keras_file  {tmp_path}/m.keras (import user_model; keras.saving.load_model)" in lines
    assert "Sharding callback" not in run.stderr and "I1" not in run.stderr, run.stderr[-2000:]
    tags = set()
    import tensorflow as tf

    for name in os.listdir(tmp_path / "run" / "train"):
        for event in tf.compat.v1.train.summary_iterator(str(tmp_path / "run" / "train" / name)):
            tags.update(value.tag for value in event.summary.value)
    assert {"loss", "accuracy", "val_accuracy", "val_loss"} <= tags, tags


def test_dry_run_prints_the_plan_and_trains_nothing(tmp_path):
    run = launch(
        "--dry_run", "--model=mlp", "--data=synthetic", "--width=8", "--depth=1",
        "--mesh=stage:2,replica:1", "--micro_batches=2", "--global_batch_size=8",
        f"--model_dir={tmp_path}/run",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert "Pipeline: mesh stage:2;replica:1, M=2, gpipe, remat=except_last, balance (1, 3)" in (
        lines
    ), run.stdout[-3000:]
    assert any(line.startswith("    1  device:CPU:1 ") for line in lines)
    (predicted,) = [line for line in lines if line.startswith("predicted (profiled at 4 rows")]
    assert " per step, bubble " in predicted and "device 0 " in predicted, predicted
    assert lines[-1] == "dry run: nothing trained (drop --dry_run to train)"
    assert not any(line.startswith("step ") for line in lines)  # no training step ran
    assert not os.path.exists(tmp_path / "run")


def test_dry_run_of_a_planned_mesh_shows_the_plans_prediction_only():
    """--mesh=auto --dry_run: the plan chooses, the stages table shows its layout, and the
    prediction printed is the plan's (no second profile, no second number). The model is
    test_mesh_auto_trains_on_the_planned_mesh's: whichever runs second reads the profile."""
    run = launch(
        "--dry_run", "--mesh=auto", "--simulated_devices=2", "--model=mlp", "--data=synthetic",
        "--width=16", "--depth=1", "--global_batch_size=8", "--schedule=gpipe", "--remat=never",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    (planned,) = [line for line in lines if line.startswith("planned: ")]
    (predicted,) = [line for line in lines if line.startswith("predicted")]
    assert predicted.startswith("predicted (the plan's): "), predicted
    step = predicted.split(": ", 1)[1].split(" per step")[0]  # e.g. "557 µs"
    value, unit = step.split(" ")
    ms = float(value) * {"s": 1e3, "ms": 1.0, "µs": 1e-3}[unit]
    shown = float(planned.split("(predicted ")[1].split(" ms/step")[0])  # 1 decimal
    assert abs(shown - ms) <= 0.05 + 0.005 * ms, (planned, predicted)  # the same number
    assert lines[-1] == "dry run: nothing trained (drop --dry_run to train)"
    assert not any(line.startswith("step ") for line in lines)
    # planned on this host's measured overheads, as hybrid.plan plans: the step costs at
    # least the calibrated fixed cost (this tiny model's compute alone is far below it)
    from hybrid.core.mesh import local_devices
    from hybrid.planning import host_calibration

    key = host_calibration._key(local_devices()[:2], jit_compile=True)
    with open(os.path.join(os.environ["HYBRID_CACHE_DIR"], "host_calibration.json")) as f:
        fixed = json.load(f)[key]["fixed"]
    assert ms >= 1e3 * fixed > 0.1, (predicted, fixed)


def write_records(directory, files=2, per_file=96):
    """The user_model task as tf.train.Example files: x (12 floats) and its label."""
    import tensorflow as tf

    rng = np.random.default_rng(1)
    for i in range(files):
        with tf.io.TFRecordWriter(str(directory / f"part-{i}.tfrecord")) as writer:
            for x in rng.normal(size=(per_file, 12)).astype("float32"):
                feature = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                    "label": tf.train.Feature(
                        int64_list=tf.train.Int64List(value=[int(np.argmax(x[:3]))])
                    ),
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())


def test_trains_on_tfrecord_files(tmp_path):
    write_records(tmp_path)
    run = launch(
        "--model=user_model:model", f"--data=tfrecord:{tmp_path}/part-*.tfrecord",
        '--tfrecord_features={"x": ["float32", [12]], "label": ["int64", []]}',
        "--mesh=stage:2;replica:1", "--micro_batches=2", "--global_batch_size=32",
        "--train_steps=30", "--learning_rate=0.01", "--remat=never", "--defer_weight_gradients",
        env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "remat never deferred weight gradients" in run.stdout + run.stderr
    assert "per micro-batch, not once" not in run.stdout + run.stderr  # both stages deferred
    first, last, done = first_and_last_loss(run)
    assert last < 0.8 * first, done


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--mesh=stage:2;replica:2", "--micro_batches=4", "--global_batch_size=30"],
            "--global_batch_size=30 --mesh=stage:2;replica:2 --micro_batches=4: global batch 30 "
            "is not divisible by replicas (2) × micro_batches (4) = 8",
        ),
        (["--mesh=stages:2"], "--mesh: bad mesh spec 'stages:2'"),
        (
            ["--keras_file=lm.keras", "--tie_embeddings"],
            "--keras_file=lm.keras --tie_embeddings: the tied head holds the embedding layer",
        ),
        (["--schedule=gpip"], "flag --schedule=gpip: value should be one of"),
        (["--remat=sometimes"], "flag --remat=sometimes: value should be one of"),
        (["--model=gpt"], "flag --model=gpt: value should be one of"),
        (["--model=mine:model"], "--data=text:python-docs --model=mine:model: model 'mine:model'"),
        (["--optimizer=adamx"], "--optimizer=adamx: not a Keras optimizer; one of"),
        (["--data=tfrecord:/x/*.rec"], "tfrecord data needs --tfrecord_features"),
        (
            ["--data=tfrecord:/x/*.rec", '--tfrecord_features={"x": ["float32", [3]]}'],
            "it needs the label 'label' and at least one input feature",
        ),
        (["--optimizer_config=weight_decay"], "--optimizer_config=weight_decay is not JSON"),
        (["--micro_batches=0"], "--micro_batches=0 must be a positive integer, or 'auto'"),
        (
            ["--micro_batches=auto", "--platform=tpu", "--tpu=n", "--tpu_zone=z"]
            + ["--gcp_project=p"],
            "--micro_batches=auto times a Pipeline's gradient step at each M",
        ),
        (
            ["--mesh=stage:2", "--simulated_devices=1"],
            "--mesh=stage:2 needs 2 devices but --simulated_devices=1",
        ),
        (
            ["--mesh=stage:20", "--depth=2"],
            "--mesh=stage:20 --virtual_stages=1 --model=transformer --depth=2: more stages than "
            "layers: the run has 20 model stages but the model has only 5 layers",
        ),
        (
            ["--mesh=stage:4", "--schedule=interleaved", "--virtual_stages=2", "--micro_batches=6"],
            "--micro_batches=6 --mesh=stage:4 --schedule=interleaved: the interleaved schedule "
            "needs micro_batches to be a multiple of the pipeline stages: M=6, S=4",
        ),
        (
            ["--virtual_stages=2"],
            "--virtual_stages=2 --schedule=gpipe: schedule 'gpipe' runs one stage per device",
        ),
        (
            ["--balance=4,4"],
            "--balance=4,4 --mesh=stage:2;replica:2 --virtual_stages=1 --model=transformer "
            "--depth=2: balance [4, 4] sums to 8 but the model has 5 layers",
        ),
        (
            ["--balance=half"],
            "--balance=half must be one of ['compute', 'params', 'time', 'memory'] or layer counts",
        ),
        (["--memory_per_device=16"], "--memory_per_device: '16' is not a memory size"),
        (
            ["--data=text:/no/such/file.txt"],
            "--data=text:/no/such/file.txt --model=transformer: data file '/no/such/file.txt'",
        ),
        (["--data=imagenet"], "--data=imagenet --model=transformer: unknown data source"),
        (
            ["--model=mlp"],
            "--data=text:python-docs --model=mlp: data source 'text:python-docs' is a "
            "language-modelling corpus, but model 'mlp' classifies",
        ),
        (["--width=30", "--num_heads=4"], "--width=30 must be divisible by --num_heads=4"),
        (["--checkpoint_every=5"], "--checkpoint_every=5 needs --model_dir"),
        (
            ["--steps_per_execution=4"],
            "--steps_per_execution=4 runs that many steps per call and logs, checkpoints and "
            "times only after a call; --log_every=10 is not a multiple of it",
        ),
        (["--profile_steps=5,3", "--model_dir=/tmp/x"], "--profile_steps=5,3 must satisfy"),
        (["--platform=tpu", "--tpu=n"], "--platform=tpu needs --tpu_zone, --gcp_project"),
        (["--tpu=node", "--tpu_zone=z"], "--tpu, --tpu_zone only apply with --platform=tpu"),
        (["--platform=gpu", "--simulated_devices=4"], "--simulated_devices only applies with"),
        (["--mesh=auto"], "--mesh=auto on --platform=cpu needs --simulated_devices=N"),
        (["--boundary_dtype=float16"], "value should be one of <float32|bfloat16|int8>"),
        (
            ["--defer_weight_gradients"],
            "--defer_weight_gradients=True --remat=except_last: defer_weight_gradients=True "
            "keeps every micro-batch's activations",
        ),
        (
            ["--defer_weight_gradients", "--remat=never", "--platform=tpu", "--tpu=n"]
            + ["--tpu_zone=z", "--gcp_project=p"],
            "--defer_weight_gradients needs stage programs of their own",
        ),
        (["stray"], "unexpected arguments: ['stray']"),
        (["--validation_steps=2"], "--validation_steps=2 needs --validation_data"),
        (
            ["--validation_data=text:python-docs"],
            "--validation_data=text:python-docs needs --validation_steps=N",
        ),
    ],
)
def test_bad_flags_fail_before_training(flags, message):
    run = launch(*flags, "--train_steps=1")
    assert run.returncode != 0
    assert message in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]
    assert "step " not in run.stdout


def test_mesh_auto_plans_your_model_with_a_skip():
    """--mesh=auto --dry_run on a --model=module:function graph (a skip and a merge): its
    layer calls profiled, the plan's layout shown, the plan's prediction printed."""
    run = launch(
        "--model=user_model:model", "--data=user_model:data", "--mesh=auto", "--dry_run",
        "--simulated_devices=2", "--global_batch_size=8", "--micro_batches=2",
        "--schedule=1f1b", "--remat=never",
        env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    (planned,) = [line for line in lines if line.startswith("planned: ")]
    assert "--micro_batches=2 --schedule=1f1b --remat=never" in planned, planned
    balance = planned.split("--balance=")[1].split(" ")[0]
    assert sum(map(int, balance.split(","))) == 4, planned  # dense, dense, add, dense
    assert any(line.startswith("predicted (the plan's): ") for line in lines), lines[-5:]
    assert lines[-1] == "dry run: nothing trained (drop --dry_run to train)"


def test_dry_run_profiles_a_kerashub_model_at_your_datas_sequence_length():
    """A KerasHub task model (two inputs of open length, its backbone nested) is profiled
    for the dry run's prediction at the shapes of your --data's first batch."""
    run = launch(
        "--model=user_model:gpt2", "--data=user_model:tokens", "--mesh=stage:2,replica:1",
        "--micro_batches=2", "--global_batch_size=8", "--remat=never", "--dry_run",
        env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    (predicted,) = [line for line in lines if line.startswith("predicted")]
    assert predicted.startswith("predicted (profiled at 4 rows per micro-batch): "), predicted
    assert "device 1 " in predicted and lines[-1].startswith("dry run: nothing trained")


def test_a_nan_loss_stops_with_the_step_and_the_last_good_checkpoint(tmp_path):
    run = launch(
        "--model=mlp",
        "--data=synthetic",
        "--mesh=stage:2;replica:1",
        "--micro_batches=2",
        "--global_batch_size=8",
        "--width=8",
        "--depth=1",
        "--learning_rate=1e30",
        "--train_steps=20",
        "--checkpoint_every=1",
        f"--model_dir={tmp_path}",
        "--nojit_compile",
    )
    assert run.returncode == 1, run.stderr[-3000:]
    error = [line for line in run.stderr.splitlines() if line.startswith("error: loss is")]
    assert error, run.stderr[-3000:]
    step = int(error[0].split(" at step ")[1].split(";")[0])
    assert f"the last good checkpoint is {tmp_path}/ckpt-{step - 1}" in error[0]
    assert "Lower learning_rate (now 1e+30) or check the data (--learning_rate)" in error[0]
    assert not os.path.exists(os.path.join(tmp_path, f"ckpt-{step}.index"))


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
