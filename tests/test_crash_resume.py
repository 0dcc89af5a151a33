"""Crash safety with real processes: SIGKILL mid-run, the same command again, same weights.

One launcher run trains uninterrupted to step 12. A second, with the same flags and its own
--model_dir, pauses after step 7 (the launcher's test hook) and is killed there with SIGKILL:
its newest checkpoint is step 6, step 7 is lost. Started again with the same command it
resumes at step 7 and must end with exactly the weights and optimizer state of the
uninterrupted run.
"""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import pause
import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 12
FLAGS = [
    "--model=transformer",
    "--data=text:python-docs",
    "--mesh=stage:2;replica:2",
    "--schedule=1f1b",
    "--micro_batches=2",
    "--global_batch_size=8",
    "--width=16",
    "--depth=2",
    "--seq_len=16",
    "--dropout=0.1",  # random layers too: their seeds must resume exactly
    f"--train_steps={STEPS}",
    "--checkpoint_every=2",
    "--log_every=1",
    "--nojit_compile",
]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}


def command(model_dir):
    return [sys.executable, "-m", "hybrid.launch.train", *FLAGS, f"--model_dir={model_dir}"]


def run_to_end(model_dir):
    run = subprocess.run(
        command(model_dir),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=pause.HANG_BOUND_S,
        env=ENV,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def run_and_kill_after(model_dir, step, events):
    """Starts the run, lets it pause after ``step`` and SIGKILLs it there."""
    process = subprocess.Popen(
        command(model_dir),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**ENV, **pause.env(step, events)},
    )
    try:
        pause.wait_until_paused(events, step, process)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=pause.HANG_BOUND_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGKILL


def state(path):
    reader = tf.train.load_checkpoint(path)
    keys = [k for k in reader.get_variable_to_shape_map() if not k.startswith("_CHECKPOINTABLE")]
    return {k: reader.get_tensor(k) for k in keys if k.split("/")[0] in ("model", "optimizer")}


@pytest.mark.long
def test_sigkill_then_same_command_ends_with_identical_weights(tmp_path):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    run_to_end(whole)
    run_and_kill_after(crashed, 7, tmp_path / "events")
    assert tf.train.latest_checkpoint(str(crashed)).endswith("ckpt-6")
    resumed = run_to_end(crashed)
    assert "ckpt-6: resuming at step 7" in resumed
    assert f"step      7/{STEPS}" in resumed and f"step      6/{STEPS}" not in resumed

    expected = state(str(whole / f"ckpt-{STEPS}"))
    actual = state(str(crashed / f"ckpt-{STEPS}"))
    assert expected.keys() == actual.keys()
    assert any(k.startswith("optimizer/v0") for k in expected)  # Adam slots compared too
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
