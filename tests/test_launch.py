"""The launcher as a user runs it: a real process, real flags, clear errors."""

import os
import subprocess
import sys

import pytest

import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.train", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )


def test_trains_and_loss_falls():
    run = launch(
        "--mesh=stage:2;replica:2",
        "--micro_batches=2",
        "--global_batch_size=64",
        "--train_steps=30",
        "--width=32",
        "--depth=2",
        "--learning_rate=0.01",
        "--log_every=10",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "mesh stage:2;replica:2" in run.stdout
    assert "examples/s" in run.stdout
    done = [line for line in run.stdout.splitlines() if line.startswith("done:")]
    first, last = (float(v) for v in done[0].split("loss ")[1].split(",")[0].split(" -> "))
    assert last < 0.8 * first, done


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--mesh=stage:2;replica:2", "--micro_batches=4", "--global_batch_size=30"],
            "--global_batch_size=30 is not divisible by replicas (2, from --mesh) × "
            "--micro_batches (4) = 8",
        ),
        (["--mesh=stages:2"], "--mesh: bad mesh spec 'stages:2'"),
        (["--schedule=gpip"], "flag --schedule=gpip: value should be one of"),
        (["--remat=sometimes"], "flag --remat=sometimes: value should be one of"),
        (["--micro_batches=0"], "--micro_batches"),
        (
            ["--mesh=stage:2", "--simulated_devices=1"],
            "--mesh=stage:2 needs 2 devices but --simulated_devices=1",
        ),
        (
            ["--mesh=stage:20", "--depth=2"],
            "make 20 stages but --depth=2 gives the model only 7",
        ),
        (
            ["--mesh=stage:4", "--schedule=interleaved", "--virtual_stages=2", "--micro_batches=6"],
            "--schedule=interleaved needs --micro_batches (6) to be a multiple of the pipeline "
            "stages (4, from --mesh)",
        ),
        (["--virtual_stages=2"], "--virtual_stages=2 needs --schedule=interleaved"),
        (["stray"], "unexpected arguments: ['stray']"),
    ],
)
def test_bad_flags_fail_before_training(flags, message):
    run = launch(*flags, "--train_steps=1")
    assert run.returncode != 0
    assert message in run.stdout + run.stderr, (run.stdout + run.stderr)[-3000:]
    assert "step " not in run.stdout


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
