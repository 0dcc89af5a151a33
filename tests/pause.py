"""Drives a launcher run by events: it pauses after a chosen step until the test releases it.

    env = {**os.environ, **pause.env(step=5, directory=d)}
    process = subprocess.Popen([... "-m", "hybrid.launch.train", ...], env=env)
    pause.wait_until_paused(d, 5, process)    # step 5 and its checkpoint are written
    ...inject the fault (kill a worker, SIGKILL the run)...
    pause.release(d, 5)                       # the run continues (or is already dead)

``hybrid.launch.train`` implements the other side (``PAUSE_ENV``). The timeout is a bound against a
hang, never what decides whether a healthy run passes.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

import pytest

PAUSE_ENV = "HYBRID_PAUSE_AFTER_STEP"
HANG_BOUND_S = 600.0


def env(step: int | tuple[int, ...], directory: str | os.PathLike) -> dict[str, str]:
    """The environment entry that makes a launcher run pause after ``step`` (or each of
    several steps); a run that passes a step again (resumed) pauses there again unless
    that step was released."""
    os.makedirs(directory, exist_ok=True)
    steps = step if isinstance(step, tuple) else (step,)
    return {PAUSE_ENV: f"{','.join(map(str, steps))}:{directory}"}


def wait_until_paused(
    directory: str | os.PathLike,
    step: int,
    process: subprocess.Popen,
    describe: Callable[[], str] | str = "",
    timeout_s: float = HANG_BOUND_S,
) -> None:
    """Returns once the run has paused after ``step``; fails if it exits or hangs first."""
    marker = os.path.join(directory, f"paused-{step}")

    def context() -> str:
        return describe() if callable(describe) else describe

    deadline = time.monotonic() + timeout_s
    while not os.path.exists(marker):
        if process.poll() is not None:
            pytest.fail(f"the run exited ({process.returncode}) before step {step}: {context()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the run did not reach step {step} within {timeout_s} s: {context()}")
        time.sleep(0.05)


def release(directory: str | os.PathLike, step: int) -> None:
    """Lets a run paused after ``step`` continue."""
    open(os.path.join(directory, f"resume-{step}"), "w").close()
