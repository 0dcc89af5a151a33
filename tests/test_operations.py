"""Operating a run: nothing is lost silently, one run per model_dir, config drift refused,
interrupts checkpointed, one-line errors. Tiny MLPs, few steps, no XLA.

In-process runs call ``hybrid.run.trainer.train``; the launcher's own behaviour (signals, exit
codes, its one-line messages) runs in real processes driven by events: the pause hook
(``pause.py``) and the files the runs write, never by timing.
"""

import os
import resource
import signal
import socket
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import hybrid
from hybrid.run import run_record
from hybrid.run.checkpoint import UnreadableCheckpointsError
from hybrid.run.output_paths import check_output_paths
from hybrid.run.run_lock import LOCK_FILE, RunLock, RunLockError
from hybrid.run.train_config import TrainConfig
from hybrid.run.trainer import train
from hybrid.run.user_model import UserFunctionError, optimizer_for

import pause
import reference
import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = TrainConfig.of(
    model="mlp",
    data="synthetic",
    mesh="stage:2;replica:1",
    micro_batches=2,
    global_batch_size=8,
    width=8,
    depth=1,
    train_steps=2,
    checkpoint_every=1,
    log_every=1,
    jit_compile=False,
    prefetch=0,
)
# The launcher's flags for CONFIG (its other fields are the flags' defaults).
FLAGS = [
    "--model=mlp", "--data=synthetic", "--mesh=stage:2;replica:1", "--micro_batches=2",
    "--global_batch_size=8", "--width=8", "--depth=1", "--log_every=1", "--nojit_compile",
    "--prefetch=0",
]  # fmt: skip


def run(model_dir, log=None, **changes):
    """CONFIG (with ``changes``) trained in this process in ``model_dir``."""
    config = CONFIG.replace(model_dir=str(model_dir), **changes)
    return train(config, log=(log.append if log is not None else lambda _: None))


def ckpts(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".index"))


# -- 1. a model_dir never loses work silently ------------------------------------------------


def test_a_garbled_or_missing_state_file_resumes_from_the_newest_listed_checkpoint(tmp_path):
    run(tmp_path, train_steps=3)
    with open(tmp_path / "checkpoint", "w") as f:
        f.write("this is not a checkpoint state\x00\x01")
    os.makedirs(tmp_path / "ckpt-4_temp")  # a save killed half-way
    log = []
    result = run(tmp_path, log, train_steps=4)
    assert f"removed {tmp_path}/ckpt-4_temp, a save an earlier run did not finish" in log
    warning = [line for line in log if line.startswith("WARNING")]
    assert warning == [
        f"WARNING the checkpoint state file {tmp_path}/checkpoint is unreadable; found 3 "
        f"checkpoints by listing the directory, the newest {tmp_path}/ckpt-3"
    ]
    assert result.start_step == 3 and f"restored {tmp_path}/ckpt-3: resuming at step 4" in log
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("ckpt-4")  # the state repaired
    os.remove(tmp_path / "checkpoint")
    log = []
    assert run(tmp_path, log, train_steps=4).start_step == 4
    assert "is missing; found 3 checkpoints" in log[0], log


def test_all_checkpoints_unreadable_stops_and_fresh_start_moves_them_aside(tmp_path):
    run(tmp_path, train_steps=2)
    for name in os.listdir(tmp_path):
        if ".data-" in name:
            with open(tmp_path / name, "r+b") as f:
                f.truncate(8)  # torn
    with pytest.raises(UnreadableCheckpointsError) as error:
        run(tmp_path, train_steps=3)
    assert str(error.value) == (
        f"{tmp_path} holds checkpoint files but none can be restored (ckpt-2: IndexError; "
        "ckpt-1: IndexError); repair or remove them, point --model_dir at another "
        "directory, or pass --fresh_start to move them aside (into an aside-<time> folder "
        "there) and start from step 1"
    )
    assert ckpts(tmp_path) == ["ckpt-1.index", "ckpt-2.index"]  # nothing overwritten
    log = []
    result = run(tmp_path, log, train_steps=1, fresh_start=True)
    assert result.start_step == 0 and ckpts(tmp_path) == ["ckpt-1.index"]
    (aside,) = [n for n in os.listdir(tmp_path) if n.startswith("aside-")]
    assert ckpts(tmp_path / aside) == ["ckpt-1.index", "ckpt-2.index"]
    assert (
        f"--fresh_start: moved 6 files and train/ to {tmp_path}/{aside}; starting from step 1"
        in log
    )
    assert os.listdir(tmp_path / aside / "train")  # the old run's events kept, apart


# -- 2. one run per model_dir ------------------------------------------------------------------


def test_a_held_lock_refuses_a_second_run_and_a_stale_one_is_taken_over(tmp_path):
    with RunLock(str(tmp_path)):
        with pytest.raises(RunLockError, match=rf"is in use by pid {os.getpid()} on host "):
            run(tmp_path)
    assert not os.path.exists(tmp_path / LOCK_FILE)  # released at exit
    host = socket.gethostname()
    with open(tmp_path / LOCK_FILE, "w") as f:  # a run of this host killed with SIGKILL
        f.write(f'{{"host": "{host}", "pid": 999999999, "started": "2026-12-04T10:00:00"}}')
    log = []
    with RunLock(str(tmp_path), log=log.append):
        assert f'"pid": {os.getpid()}' in open(tmp_path / LOCK_FILE).read()
    assert log == [
        f"WARNING taking over the lock {tmp_path}/{LOCK_FILE} of pid 999999999 on host {host} "
        "(started 2026-12-04T10:00:00), which is no longer running"
    ]


def test_a_lock_of_another_host_is_honoured_unless_taken_over(tmp_path):
    with open(tmp_path / LOCK_FILE, "w") as f:
        f.write('{"host": "other-host", "pid": 12, "started": "2026-12-04T10:00:00"}')
    with pytest.raises(RunLockError) as error:
        RunLock(str(tmp_path)).__enter__()
    assert str(error.value) == (
        f"--model_dir={tmp_path} is locked by pid 12 on host other-host (started "
        f"2026-12-04T10:00:00): {tmp_path}/{LOCK_FILE}; if that run is gone, pass "
        "--take_over_lock; or point --model_dir at another directory"
    )
    assert "other-host" in open(tmp_path / LOCK_FILE).read()  # left as it was
    with RunLock(str(tmp_path), take_over=True, log=lambda _: None):
        assert socket.gethostname() in open(tmp_path / LOCK_FILE).read()


# -- 3. the run's configuration, recorded and compared on resume -------------------------------


def learning_rates_logged(model_dir):
    """TensorBoard's ``learning_rate`` scalars: step -> value."""
    found = {}
    for name in os.listdir(model_dir / "train"):
        for event in tf.compat.v1.train.summary_iterator(str(model_dir / "train" / name)):
            for value in event.summary.value:
                if value.tag == "learning_rate":
                    found[event.step] = float(tf.make_ndarray(value.tensor))
    return found


def test_config_drift_is_refused_per_field_and_allowed_changes_are_logged(tmp_path):
    run(tmp_path, train_steps=1)
    record = run_record.read(str(tmp_path))
    assert record["config"]["optimizer"] == "adam" and record["version"] == hybrid.__version__
    assert record["layers"][0].startswith("Dense float32 [[64, 8], [8]]"), record["layers"]
    with pytest.raises(run_record.ConfigDriftError) as error:
        run(tmp_path, optimizer="adamw", seed=3, train_steps=2)
    assert str(error.value) == (
        f"--model_dir={tmp_path} was trained as another run: --optimizer: adam in the "
        "checkpoint, adamw now; --seed: 0 in the checkpoint, 3 now. Resume with the "
        "checkpoint's values, or start another run: another --model_dir, or --fresh_start "
        "(moves these checkpoints aside)"
    )
    with pytest.raises(run_record.ConfigDriftError, match="--precision: float32 in the check"):
        run(tmp_path, precision="mixed_bfloat16", train_steps=2)
    with pytest.raises(run_record.ConfigDriftError, match="--optimizer_config: {} in the chec"):
        run(tmp_path, optimizer_config='{"beta_1": 0.8}', train_steps=2)
    log = []
    result = run(
        tmp_path, log, mesh="stage:1;replica:2", micro_batches=1, learning_rate=0.0, train_steps=2
    )
    assert result.start_step == 1
    assert "resuming with a change: --mesh: stage:2;replica:1 -> stage:1;replica:2" in log
    assert "resuming with a change: --micro_batches: 2 -> 1" in log
    assert "learning rate 0.0 (--learning_rate) applies; the checkpoint's run used 0.003" in log
    assert learning_rates_logged(tmp_path) == {1: pytest.approx(0.003), 2: 0.0}
    assert run_record.read(str(tmp_path))["config"]["mesh"] == "stage:1;replica:2"


def test_the_record_refuses_other_layers_or_another_loss_and_names_them():
    record = {"config": {"model": "m:f"}, "layers": ["Dense float32 [[4, 8], [8]]"], "loss": "mse"}
    same = run_record.compare(record, {"model": "m:f"}, record["layers"], "mse")
    assert (same.refused, same.applied, same.learning_rate) == ([], [], None)
    other = run_record.compare(record, {"model": "m:f"}, ["Dense float32 [[4, 9], [9]]"], "mae")
    assert other.refused == [
        "--model (its layers): layer 0: Dense float32 [[4, 8], [8]] in the checkpoint, "
        "Dense float32 [[4, 9], [9]] now",
        "--model (its loss): mse in the checkpoint, mae now",
    ]


# -- 5. output paths, checked before any work ---------------------------------------------------


@pytest.mark.parametrize(
    "paths,message",
    [
        ({"model_dir": "{f}/run"}, "--model_dir={f}/run is under {f}, a regular file"),
        ({"model_dir": "{f}"}, "--model_dir={f} is a regular file, not a directory"),
        ({"export_dir": "{f}/x/y"}, "--export_dir={f}/x/y is under {f}, a regular file"),
        ({"keras_file": "{f}/m.keras"}, "--keras_file={f}/m.keras is under {f}, a regular"),
        ({"export_dir": "{d}"}, "--export_dir={d} holds files already (an earlier export?)"),
        ({"keras_file": "{f}"}, "--keras_file={f} exists already; saving would overwrite it"),
        ({"model_dir": "{d}"}, "--model_dir={d}: {d}/train is a regular file, but the run"),
    ],
)
def test_output_paths_are_checked_before_any_work(tmp_path, paths, message):
    values = {"f": str(tmp_path / "file"), "d": str(tmp_path)}
    open(values["f"], "w").close()
    open(tmp_path / "train", "w").close()
    given = {k: v.format(**values) for k, v in paths.items()}
    for check in (
        lambda: check_output_paths(**given),
        lambda: train(CONFIG.replace(**given)),  # before any work
    ):
        with pytest.raises(ValueError) as error:
            check()
        assert str(error.value).startswith(message.format(**values)), str(error.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_directory_that_is_not_writable_is_refused(tmp_path):
    os.chmod(tmp_path, 0o500)
    try:
        with pytest.raises(ValueError, match="is not writable by this user"):
            check_output_paths(model_dir=str(tmp_path / "run"))
    finally:
        os.chmod(tmp_path, 0o700)


# -- 6. a user's error is one line naming the flag ------------------------------------------


def broken_model():
    raise RuntimeError("no weights file at /data/w.h5")


def test_your_function_that_raises_is_named_with_its_message():
    config = CONFIG.replace(model="test_operations:broken_model")
    with pytest.raises(UserFunctionError) as error:
        train(config)
    assert str(error.value) == (
        "--model=test_operations:broken_model: your function broken_model() raised "
        "RuntimeError: no weights file at /data/w.h5"
    )


@pytest.mark.parametrize(
    "arguments,message",
    [
        ('{"beta_1": "x"}', "beta_1='x' is a str; Adam takes a float there (default 0.9)"),
        ('{"foo": 1}', "Adam has no argument 'foo'; it takes ["),
        ('{"amsgrad": 1}', "amsgrad=1 is a int; Adam takes a bool there (default False)"),
    ],
)
def test_optimizer_arguments_of_the_wrong_name_or_type_name_the_flag(arguments, message):
    with pytest.raises(ValueError) as error:
        optimizer_for(TrainConfig.of(optimizer_config=arguments))
    assert str(error.value).startswith(f"--optimizer_config={arguments}: "), str(error.value)
    assert message in str(error.value)


def test_an_internal_error_shows_its_traceback_and_says_it_is_a_bug(capsys):
    from hybrid.launch.train import report_error

    assert report_error(OSError(28, "No space left on device")) == 1
    assert capsys.readouterr().err == "error: OSError: [Errno 28] No space left on device\n"
    missing = "{{function_node __wrapped__ReadFile}} /data/x.txt; No such file [Op:ReadFile]"
    assert report_error(tf.errors.NotFoundError(None, None, missing)) == 1
    assert capsys.readouterr().err == "error: NotFoundError: /data/x.txt; No such file\n"
    assert report_error(tf.errors.OutOfRangeError(None, None, "End of sequence")) == 2
    capsys.readouterr()
    try:
        raise KeyError("stage")
    except KeyError as err:
        assert report_error(err) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.endswith(
        "error: internal error (KeyError) in hybrid, not in your flags: this is a bug; please "
        "report it with the traceback above\n"
    )


# -- 7. the API checks its arguments ----------------------------------------------------------


def pipeline(**arguments):
    arguments = {"mesh": "stage:2;replica:1", "loss": "mse", "optimizer": "sgd", **arguments}
    compiling = reference.compile_options(arguments)
    pipe = hybrid.Pipeline(reference.mlp_layers(), **arguments)
    pipe.compile(**compiling)
    return pipe


@pytest.mark.parametrize(
    "arguments,error,message",
    [
        ({"mesh": 3}, TypeError, "mesh=3 (int): give a hybrid.DeviceMesh or a spec"),
        ({"mesh": None}, ValueError, "Pipeline(model, mesh=None) needs a config"),
        ({"mesh": "stages:2"}, ValueError, "mesh='stages:2': bad mesh spec 'stages:2'"),
        ({"jit_compile": "no"}, TypeError, "jit_compile='no' (str): give True or False"),
        ({"micro_batches": 2.0}, ValueError, "micro_batches must be a positive integer, got 2.0"),
        ({"prefetch": "2"}, ValueError, "prefetch='2': give the number of batches to prepare"),
        (
            {"balance": 5},
            TypeError,
            "balance=5 (int): give None, one of ['compute', 'params', 'time', 'memory'], or",
        ),
    ],
)
def test_pipeline_refuses_arguments_of_the_wrong_type(arguments, error, message):
    with pytest.raises(error) as raised:
        pipeline(**arguments)
    assert str(raised.value).startswith(message), str(raised.value)


def test_pipeline_takes_a_mesh_spec_as_the_launcher_does():
    assert pipeline().mesh == hybrid.DeviceMesh.create(2, 1)


def test_fit_and_evaluate_on_empty_data_return_what_keras_returns():
    x = np.zeros((0, reference.IN_FEATURES), "float32")
    data = tf.data.Dataset.from_tensor_slices((x, np.zeros((0,), "int64"))).batch(4)
    model = keras.Sequential([keras.Input((reference.IN_FEATURES,)), keras.layers.Dense(3)])
    model.compile("sgd", reference.loss_fn())
    pipe = reference.pipeline(jit_compile=False)
    for fitted in (model, pipe):
        assert fitted.fit(data, verbose=0).history == {}
        assert fitted.evaluate(data, verbose=0, return_dict=True) == {}
        assert fitted.evaluate(data, verbose=0) == []


# -- the launcher: interrupts, the lock, a full disk, one-line errors (real processes) ---------

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}


def start(model_dir, *flags, env=None, **popen):
    """The launcher on FLAGS and ``flags``, in ``model_dir`` unless it is a flag itself."""
    where = [str(model_dir) if str(model_dir).startswith("--") else f"--model_dir={model_dir}"]
    return subprocess.Popen(
        [sys.executable, "-m", "hybrid.launch.train", *FLAGS, *where, *flags],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**ENV, **(env or {})},
        **popen,
    )


def finish(process):
    out, err = process.communicate(timeout=pause.HANG_BOUND_S)
    return process.returncode, out, err


def acknowledged(process, number):
    """Reads the run's stderr up to its line for signal ``number`` (the handler has run)."""
    name, seen = signal.Signals(number).name, []
    for line in process.stderr:
        seen.append(line)
        if line.startswith(f"{name}: finishing the step in flight"):
            return "".join(seen)
    pytest.fail(f"the run ended without acknowledging {name}: {''.join(seen)[-3000:]}")


def interrupted(tmp_path, signals, also=None):
    """A run paused after step 2 gets ``signals`` (the first acknowledged before the next
    is sent); ``also()`` runs while it is paused."""
    events = tmp_path / "events"
    process = start(tmp_path / "run", "--train_steps=5", env=pause.env(2, events))
    try:
        pause.wait_until_paused(events, 2, process)
        extra = also() if also else None
        process.send_signal(signals[0])
        before = acknowledged(process, signals[0])
        for number in signals[1:]:
            process.send_signal(number)
        pause.release(events, 2)
        code, out, err = finish(process)
        return code, out, before + err, extra
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sigint_saves_the_step_and_a_second_launcher_is_refused_meanwhile(tmp_path):
    second = lambda: finish(start(tmp_path / "run", "--train_steps=5"))  # noqa: E731
    code, out, err, (code2, _, err2) = interrupted(tmp_path, [signal.SIGINT], also=second)
    assert code == 130, err[-3000:]
    assert out.splitlines()[-1] == (
        "interrupted at step 2; saved ckpt-2; run the same command to resume"
    )
    assert ckpts(tmp_path / "run") == ["ckpt-2.index"] and "Traceback" not in err
    assert code2 == 1 and "Traceback" not in err2
    (line,) = [line for line in err2.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: --model_dir={tmp_path}/run is in use by pid ")
    assert line.endswith("stop that run first, or point --model_dir at another directory")
    assert not os.path.exists(tmp_path / "run" / LOCK_FILE)  # released at exit


def test_sigterm_saves_the_step_exits_143_and_the_same_command_resumes(tmp_path):
    code, out, err, _ = interrupted(tmp_path, [signal.SIGTERM])
    assert code == 143, err[-3000:]
    assert "interrupted at step 2; saved ckpt-2; run the same command to resume" in out
    code, out, err = finish(start(tmp_path / "run", "--train_steps=3"))
    assert code == 0, err[-3000:]
    assert f"restored {tmp_path}/run/ckpt-2: resuming at step 3" in out


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    code, out, err, _ = interrupted(tmp_path, [signal.SIGINT, signal.SIGINT])
    assert code == 130, err[-3000:]
    assert out.splitlines()[-1] == "interrupted again: stopped at once; no checkpoint was saved"
    assert "Traceback" not in err


def limit_file_size(size):
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past it fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return limit


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_what_it_needed(tmp_path):
    run(tmp_path / "run", train_steps=1, width=256)
    size = os.path.getsize(next((tmp_path / "run").glob("ckpt-1.data-*")))
    process = start(
        tmp_path / "run", "--width=256", "--train_steps=2", preexec_fn=limit_file_size(size // 2)
    )
    code, out, err = finish(process)
    assert code == 1, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith(
        f"error: --model_dir={tmp_path}/run: could not write checkpoint ckpt-2 in {tmp_path}/run ("
    )
    assert "File too large" in line and "; it needs about " in line and "Traceback" not in err
    assert line.endswith(
        f"the previous checkpoints are intact (newest: {tmp_path}/run/ckpt-1); free space or "
        "fix the permissions, then run the same command to resume"
    )
    assert sorted(os.listdir(tmp_path / "run")) == [
        "checkpoint", "ckpt-1.data-00000-of-00001", "ckpt-1.index", "run_config.json", "train",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--keras_file={t}/file/m.keras"], "--keras_file={t}/file/m.keras is under {t}/file, a"),
        (["--mesh=auto", "--simulated_devices=0"], "flag --simulated_devices=0: 0 is not a pos"),
        (["--platform=gpu"], "error: --platform=gpu --mesh=stage:2;replica:1 needs 2 GPUs but"),
        (["--fresh_start"], "--fresh_start applies to a --model_dir; none is given"),
        (
            ["--global_batch_size=9"],
            "error: --global_batch_size=9 --mesh=stage:2;replica:1 --micro_batches=2: global "
            "batch 9 is not divisible by replicas (1) × micro_batches (2) = 2",
        ),
    ],
)
def test_flag_errors_are_one_line_naming_the_flag(tmp_path, flags, message):
    if "--platform=gpu" in flags and tf.config.list_physical_devices("GPU"):
        pytest.skip("this host has GPUs")
    open(tmp_path / "file", "w").close()
    model_dir = [] if "--fresh_start" in flags else [tmp_path / "run"]
    process = start(*model_dir, *(f.format(t=tmp_path) for f in flags))
    code, out, err = finish(process)
    assert code == 1 and "Traceback" not in err and "step " not in out, err[-3000:]
    assert message.format(t=tmp_path) in err, err[-3000:]
    assert "FATAL" not in err and "shard_optimizer_states=" not in err, err[-3000:]


def test_help_lists_the_flags_and_exits_0():
    done = subprocess.run(
        [sys.executable, "-m", "hybrid.launch.train", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert done.returncode == 0 and "--micro_batches" in done.stdout, done.stderr[-2000:]


def test_stage_peaks_are_read_only_where_each_device_has_its_own_allocator():
    from hybrid.run.callbacks import stage_peaks

    gpus = [f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(2)]
    memory = {gpus[0]: {"current": 1, "peak": 3 * 2**20}, gpus[1]: {"current": 1, "peak": 5}}
    assert stage_peaks(gpus, memory.__getitem__) == [3 * 2**20, 5]
    cpus = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)]
    assert stage_peaks(cpus, memory.__getitem__) is None  # one process allocator, not a stage's

    def unsupported(device):
        raise ValueError(f"no memory info for {device}")

    assert stage_peaks(gpus, unsupported) is None

    # CPU devices of other processes (capped local workers): read where their reader says
    from hybrid.core import device_limits

    workers = [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(2)]
    own = {workers[0]: {"current": 1, "peak": 7 * 2**20}, workers[1]: {"current": 2, "peak": 9}}
    assert stage_peaks(workers) is None  # no reader: the simulated devices of one process
    device_limits.add_reader(own.get)
    try:
        assert stage_peaks(workers) == [7 * 2**20, 9]
        assert stage_peaks([*workers, cpus[0]]) is None  # one device no reader knows
    finally:
        device_limits.remove_reader(own.get)
    assert device_limits.memory_info(workers[0]) is None


def test_stage_peaks_go_to_the_log_and_tensorboard(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from hybrid.run import callbacks

    predicted = None
    pipe = SimpleNamespace(mesh=hybrid.DeviceMesh.create(2, 1), predicted_memory=lambda: predicted)
    lines = []
    callbacks._report_memory(pipe, 10, lines.append, None)
    assert lines == []  # simulated CPU devices, batch size unknown: nothing to say
    predicted = (1.5 * 2**20, 2.5 * 2**20)
    callbacks._report_memory(pipe, 10, lines.append, None)
    assert lines == [
        "predicted peak memory (from shapes) per stage (replica 0): stage 0 predicted 1.5 MiB, "
        "stage 1 predicted 2.5 MiB"
    ]
    monkeypatch.setattr(callbacks, "stage_peaks", lambda devices: [2**20, 3 * 2**20])
    writer = tf.summary.create_file_writer(str(tmp_path))
    callbacks._report_memory(pipe, 10, lines.append, writer)
    writer.flush()
    assert lines[1] == (
        "peak memory per stage (replica 0): stage 0 1 MiB (predicted 1.5 MiB), "
        "stage 1 3 MiB (predicted 2.5 MiB)"
    )
    events = [str(p) for p in tmp_path.iterdir()]
    tags = {
        (value.tag, event.step, float(tf.make_ndarray(value.tensor)))
        for event in tf.compat.v1.train.summary_iterator(events[0])
        for value in event.summary.value
    }
    assert tags == {
        ("memory/stage_0/peak_bytes", 10, 2.0**20),
        ("memory/stage_1/peak_bytes", 10, 3.0 * 2**20),
    }


def test_the_flat_names_of_a_train_config_round_trip():
    """One table maps the flags (and run_config.json's fields) onto the nested records."""
    config = TrainConfig.of(model="mlp", width=8, optimizer_config='{"beta_1": 0.8}', seed=3)
    assert (config.model.name, config.model.width, config.seed) == ("mlp", 8, 3)
    assert config.optimizer.config == '{"beta_1": 0.8}'
    assert TrainConfig.of(**config.flat()) == config
    assert config.replace(micro_batches=2).layout.micro_batches == 2
    with pytest.raises(TypeError, match=r"no fields \['widht'\]"):
        config.replace(widht=4)


def test_an_output_whose_extra_is_missing_is_refused_before_any_work(tmp_path):
    """--timeline_every draws its charts with matplotlib: without it (blocked here as Python
    blocks a module, ``sys.modules[name] = None``) the flags are refused in one line naming
    the extra, before anything compiles; the trainer refuses the same config."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    process = start(tmp_path / "run", "--timeline_every=2", env={"PYTHONPATH": str(site)})
    code, out, err = finish(process)
    assert code == 1 and "Traceback" not in err and "compiling" not in out, err[-3000:]
    assert "--timeline_every=2 (its Gantt charts in --model_dir) needs matplotlib" in err, err
    assert "pip install 'hybrid[plot]'" in err
    assert not os.path.exists(tmp_path / "run" / "train")


def test_a_failure_after_a_step_saves_it_and_a_resume_logs_each_step_once(tmp_path):
    """An error in the work after step 3 (here the caller's step_callback; a chart that could
    not be drawn, say) checkpoints step 3 first, so the same config resumes at step 4; a
    runtime error (a lost device) saves nothing, and the resumed run drops the events the
    dead run logged after its newest checkpoint: TensorBoard shows each step once."""

    def fail_at(step, error):
        def callback(done, loss):
            if done == step:
                raise error

        return callback

    directory = tmp_path / "run"
    config = CONFIG.replace(model_dir=str(directory), train_steps=6, checkpoint_every=2)
    with pytest.raises(RuntimeError, match="chart"):
        train(config, log=lambda _: None, step_callback=fail_at(3, RuntimeError("chart")))
    assert ckpts(directory)[-1] == "ckpt-3.index"
    lost = tf.errors.UnavailableError(None, None, "device lost")
    with pytest.raises(tf.errors.UnavailableError):
        train(config, log=lambda _: None, step_callback=fail_at(5, lost))
    assert ckpts(directory)[-1] == "ckpt-4.index"  # step 5 was logged, not saved
    lines = []
    resumed = train(config, log=lines.append)
    assert resumed.start_step == 4
    assert "TensorBoard: dropped the events a stopped run logged after step 4" in lines
    straight = run(tmp_path / "straight", train_steps=6, checkpoint_every=2)
    for got, want in zip(
        resumed.pipeline.get_weights(), straight.pipeline.get_weights(), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    steps = []
    folder = directory / "train"
    for name in sorted(os.listdir(folder)):
        for event in tf.compat.v1.train.summary_iterator(str(folder / name)):
            steps += [event.step for value in event.summary.value if value.tag == "loss"]
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]  # each step once, whichever file holds it


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
