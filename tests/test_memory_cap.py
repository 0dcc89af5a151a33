"""Devices with real memory limits (``hybrid.platforms.local_workers``: one local worker per
simulated device, its CPU allocator capped) and a device out of memory said in one line
(``hybrid.engine.api.out_of_memory``).

The launcher case runs ``hybrid-train --memory_per_device`` twice on one run directory: under
a cap that holds the run it trains and checkpoints; under one that does not, it ends with
exit code 1 and the one line (TensorFlow's own report filtered out), and the checkpoint stays
as it was. The rest reads TensorFlow's three forms of the error and raises one through
``fit`` on a pipeline in this process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import hybrid
from hybrid.core import device_limits, schedule
from hybrid.core.memory import format_bytes, parse_bytes
from hybrid.engine.api import out_of_memory
from hybrid.engine.api.out_of_memory import OutOfMemoryError, Where

import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20


def launch(model_dir: str, cap: str, steps: int) -> subprocess.CompletedProcess:
    """``hybrid-train`` on two capped devices: a 4-layer MLP at a batch of 8192, so that
    its activations, not its weights, decide what fits."""
    env = {**os.environ}
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # the launcher's default verbosity
    return subprocess.run(
        [
            sys.executable, "-m", "hybrid.launch.train", "--model=mlp", "--data=synthetic",
            "--width=64", "--depth=4", "--mesh=stage:2,replica:1", "--micro_batches=8",
            "--global_batch_size=8192", "--remat=never", "--checkpoint_every=1",
            f"--model_dir={model_dir}", f"--memory_per_device={cap}", f"--train_steps={steps}",
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.long
def test_capped_devices_train_within_the_cap_and_fail_beyond_it_in_one_line(tmp_path):
    model_dir = str(tmp_path / "run")
    fits = launch(model_dir, "48MiB", 2)
    assert fits.returncode == 0, fits.stderr[-3000:]
    assert "2 simulated devices, one worker process each, capped at 48 MiB" in fits.stdout
    assert "done: loss" in fits.stdout
    # each device's peak, read from its own worker's allocator: under the cap, above nothing
    said = re.search(r"^peak memory per stage \(replica 0\): (.*)$", fits.stdout, re.M)
    assert said, fits.stdout[-2000:]
    peaks = re.findall(r"stage \d ([\d.]+ [KMG]iB) \(predicted", said.group(1))
    assert len(peaks) == 2, said.group(0)
    assert all(0 < parse_bytes(peak) <= 48 * MIB for peak in peaks), said.group(0)
    index = os.path.join(model_dir, "ckpt-2.index")
    before = open(index, "rb").read()

    over = launch(model_dir, "8MiB", 3)
    assert over.returncode == 1, over.stdout[-2000:] + over.stderr[-3000:]
    lines = over.stderr.strip().splitlines()
    # nothing but the one line: no traceback, none of TensorFlow's C++ report
    assert len(lines) == 1, over.stderr[-3000:]
    assert lines[0].startswith("error: out of memory on pipeline device "), lines[0]
    assert "/job:worker/replica:0/task:" in lines[0] and "limit 8 MiB" in lines[0]
    assert "it asked for " in lines[0] and "--mesh=auto --memory_per_device=8MiB" in lines[0]
    # the last checkpoint is intact: unchanged, and nothing newer was written
    assert tf.train.get_checkpoint_state(model_dir).model_checkpoint_path.endswith("ckpt-2")
    assert open(index, "rb").read() == before
    assert tf.train.load_checkpoint(model_dir.rstrip("/") + "/ckpt-2").get_variable_to_shape_map()


# TensorFlow's three reports of an allocation that does not fit: a kernel's, an XLA
# program's (with the scope of the action that ran it), and the allocator's own log line.
KERNEL = (
    "OOM when allocating tensor with shape[32,64,256] and type float on "
    "/job:worker/replica:0/task:1/device:CPU:0 by allocator bfc_cpu_allocator_for_gpu"
)
XLA = (
    "Additional GRPC error information from remote target /job:worker/replica:0/task:1 while "
    'calling RecvTensor: {grpc_message:"Out of memory while trying to allocate 16.00MiB.\\n\\t '
    "[[{{node F_s0_m1/PartitionedCall}}]] Additional GRPC error information from remote target "
    '/job:worker/replica:0/task:0 ..."}'
)
ALLOCATOR = "ran out of memory trying to allocate 64.00MiB"


@pytest.mark.parametrize(
    "text, nbytes",
    [(KERNEL, 32 * 64 * 256 * 4), (XLA, 16 * MIB), (ALLOCATOR, 64 * MIB), ("OOM", None)],
)
def test_the_bytes_asked_for_are_read_from_each_report(text, nbytes):
    assert out_of_memory.requested_bytes(text) == nbytes


def test_the_device_is_the_one_named_or_the_failing_actions_stage_on_its_task():
    task = "/job:worker/replica:0/task:{}/device:CPU:0".format
    mesh = hybrid.DeviceMesh(((task(0), task(2)), (task(1), task(3))))  # stage-major rows
    one_f_one_b = schedule.get("1f1b", 2, 2)
    kernel = out_of_memory.locate(KERNEL, mesh, one_f_one_b)
    assert kernel == Where(1, None, "/job:worker/replica:0/task:1/device:CPU:0")
    # stage 0 (F_s0_m1), and the innermost remote task (task 0) of the report
    xla = out_of_memory.locate(XLA, mesh, one_f_one_b)
    assert xla == Where(0, 0, "/job:worker/replica:0/task:0/device:CPU:0")
    assert out_of_memory.locate(ALLOCATOR, mesh, one_f_one_b) == Where(None, None, None)


@pytest.fixture
def limits():
    yield device_limits
    device_limits.clear()


def test_device_limits_are_found_by_the_longest_declared_prefix(limits):
    limits.declare("/job:worker", 4 * MIB)
    limits.declare("/job:worker/replica:0/task:1", 2 * MIB)
    assert limits.limit_of("/job:worker/replica:0/task:1/device:CPU:0") == 2 * MIB
    assert limits.limit_of("/job:worker/replica:0/task:10/device:CPU:0") == 4 * MIB
    assert limits.limit_of("/job:localhost/replica:0/task:0/device:CPU:0") is None
    with pytest.raises(ValueError, match="must be positive, got 0"):
        limits.declare("/job:worker", 0)


class Failing:
    """Stands for ``Pipeline._first``: every step it hands out raises ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def function(self, *args, **kwargs):
        def step(*_):
            raise self.error

        return step


def test_fit_raises_a_device_out_of_memory_as_one_typed_line(limits):
    """A stage program's ResourceExhaustedError comes out of ``fit`` (and ``train_step``)
    as OutOfMemoryError: still a ResourceExhaustedError, from the original, naming the
    stage, its device, the bytes asked, the predicted peak and the declared limit."""
    layers = [keras.layers.Dense(16, activation="relu") for _ in range(3)]
    pipe = hybrid.Pipeline([*layers, keras.layers.Dense(4)], "stage:2", micro_batches=2)
    pipe.compile(optimizer="adam", loss="mse", jit_compile=False)
    x = np.zeros((8, 8), "float32")
    y = np.zeros((8, 4), "float32")
    pipe.build(x.shape)
    device = pipe.mesh.device(1, 0)
    limits.declare(device, 64 * MIB)
    report = "Out of memory while trying to allocate 16.00MiB.\n\t [[{{node B_s1_m0/Call}}]]"
    original = tf.errors.ResourceExhaustedError(None, None, report)
    pipe._first = Failing(original)
    with pytest.raises(OutOfMemoryError) as caught:
        pipe.fit(x, y, batch_size=8, epochs=1, verbose=0)
    err = caught.value
    assert isinstance(err, tf.errors.ResourceExhaustedError) and err.__cause__ is original
    assert err.where == Where(1, 1, device) and err.requested == 16 * MIB
    assert err.predicted == pipe.predicted_memory()[1] and err.limit == 64 * MIB
    peak = format_bytes(err.predicted)
    assert str(err) == (
        f"out of memory on pipeline device 1 (model stage 1) {device}: it asked for 16 MiB "
        f'more (predicted peak {peak}, limit 64 MiB); to fit, try remat="always", '
        'micro_batches=4, balance="memory", a mesh with more stages or '
        "hybrid.plan(..., memory_per_device=67108864) for a layout that fits"
    )
    assert err.line(flags=True).endswith(
        "try --remat=always, --micro_batches=4, --balance=memory, --mesh with more stages or "
        "--mesh=auto --memory_per_device=64MiB"
    )
    with pytest.raises(OutOfMemoryError, match="out of memory on pipeline device 1"):
        pipe.train_step(x, y)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
