"""``hybrid-train --cluster=... --max_restarts=N``: a client that recovers on its own.

TensorFlow connects a process to a cluster once (a lost task cannot be reconnected in the
same process), so recovery is a new client process. With ``--max_restarts=N`` the launcher
becomes a supervisor: it runs the same command as a child (``--max_restarts=0``) and, when
the child ends because the cluster failed it — a lost worker (exit :data:`LOST_WORKER`) or
a hung step (exit :data:`HUNG`, ``--step_deadline``) — starts a new child, up to ``N``
times. Each child waits up to ``--cluster_timeout`` for every worker to answer (the
workers' own supervisor, SLURM or Kubernetes or a shell loop, restarts a lost one) and
resumes from the newest checkpoint in ``--model_dir``. Any other end (done, a user error,
an interrupt) is the supervisor's own, with the child's exit code. The supervisor imports
no TensorFlow; SIGTERM and SIGINT sent to it reach the child.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

__all__ = ["HUNG", "LOST_WORKER", "RESTARTABLE", "supervise"]

LOST_WORKER = 3  # a worker cannot be reached, or was lost during a step
HUNG = 4  # a step outlived --step_deadline
RESTARTABLE = {LOST_WORKER: "a lost worker", HUNG: "a hung step"}


def supervise(
    argv: Sequence[str],
    max_restarts: int,
    log: Callable[[str], None] = lambda line: print(line, flush=True),
    command: Sequence[str] = (sys.executable, "-m", "hybrid.launch.train"),
) -> int:
    """Runs ``command + argv + ['--max_restarts=0']`` until it ends with a code that is not
    in :data:`RESTARTABLE`, or ``max_restarts`` restarts are used up.

    Returns:
      The last child's exit code (a signal's death as 128 + the signal).
    """
    restarts = 0
    while True:
        code = _run_child([*command, *argv, "--max_restarts=0"])
        if code not in RESTARTABLE:
            return code
        if restarts >= max_restarts:
            print(
                f"error: the client ended after {RESTARTABLE[code]} (exit {code}) and "
                f"--max_restarts={max_restarts} restart(s) are used up; the newest checkpoint "
                "is kept: run the same command to resume once the workers answer",
                file=sys.stderr,
                flush=True,
            )
            return code
        restarts += 1
        log(
            f"restart {restarts} of at most {max_restarts}: the client ended after "
            f"{RESTARTABLE[code]} (exit {code}); a new client waits --cluster_timeout for the "
            "workers and resumes from the newest checkpoint"
        )


def _run_child(command: list[str]) -> int:
    """Runs one child with the supervisor's streams, in a process group of its own (a
    terminal's Ctrl-C reaches the supervisor only, and it passes SIGTERM and SIGINT on
    once)."""
    child = subprocess.Popen(command, process_group=0)

    def forward(signum: int, frame: object) -> None:
        """Passes the signal on; the child decides how to end (a checkpoint first)."""
        del frame
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code
