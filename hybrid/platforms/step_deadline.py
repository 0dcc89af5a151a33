"""A deadline on a cluster job's progress: a step that takes far longer than it should is
diagnosed instead of waited on forever.

A worker that dies fails the step at once (its connections close: ``Cluster.guard``). A
worker that hangs (a frozen process, a host off the network, a device that never returns)
leaves TensorFlow's runtime waiting without a deadline. :class:`StepDeadline` watches the
job's progress from a daemon thread: the caller reports each finished step
(:meth:`StepDeadline.progressed`); when none is reported within the deadline, every task is
probed, each with a trivial op on its CPU run in a thread of its own that is waited on
for ``probe_timeout_s`` (and with a gRPC handshake, which tells a server that runs nothing
from one that does not answer at all), and the caller's ``on_hang`` receives a
:class:`Hang` naming the silent tasks and the mesh devices they hold. ``on_hang`` runs on
the watcher's thread while the step still blocks the caller, so it should end the process
(TensorFlow cannot cancel the step, nor reconnect this process: a supervisor starts a new
client, see ``hybrid-train --max_restarts``).

The deadline is a fixed number of seconds, or derived from the steps measured so far
(``deadline_s=None``): ``factor`` times the longest interval between two finished steps,
at least ``floor_s``. It is armed by the first finished step (the first step compiles, for
as long as compiling takes). When the deadline passes and every task answers, the step is
given one more deadline (a slow step, not a lost task) before ``on_hang`` is called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import tensorflow as tf

from hybrid.platforms.cluster_tasks import Task, unreachable

__all__ = ["AUTO_FACTOR", "AUTO_FLOOR_S", "Hang", "StepDeadline", "probe_tasks"]

AUTO_FLOOR_S = 60.0  # the derived deadline's least value
AUTO_FACTOR = 10.0  # the derived deadline over the longest interval between steps seen


@dataclasses.dataclass(frozen=True)
class Hang:
    """What the deadline found.

    Attributes:
      step: the last step that finished (the one after it has not).
      waited_s: seconds since then.
      deadline_s: the deadline that passed.
      silent: tasks that did not answer the probe (empty: every task answered).
      unserved: of ``silent``, those whose gRPC server does not even accept a connection.
      devices: per silent task, the mesh positions it holds as ``(stage, replica, device)``.
      answering: tasks that answered.
    """

    step: int
    waited_s: float
    deadline_s: float
    silent: tuple[Task, ...]
    unserved: tuple[Task, ...]
    devices: dict[Task, tuple[tuple[int, int, str], ...]]
    answering: tuple[Task, ...]

    def line(self, deadline: str | None = None) -> str:
        """One line: which step waits, on which tasks and devices (``deadline``: how to
        name the deadline, e.g. the flag that set it; default ``deadline N s``)."""
        said = deadline or f"deadline {self.deadline_s:g} s"
        head = (
            f"step {self.step + 1} has not finished {self.waited_s:.0f} s after step "
            f"{self.step} ({said})"
        )
        answering = ", ".join(str(t) for t in self.answering)
        if not self.silent:
            return f"{head}, although every task answers a probe ({answering})"
        parts = []
        for task in self.silent:
            how = "its server does not answer" if task in self.unserved else "it runs nothing"
            held = self.devices.get(task, ())
            where = ", ".join(f"stage {s} replica {r} ({d})" for s, r, d in held)
            parts.append(f"{task}: {how}" + (f"; it holds {where}" if held else ""))
        if self.answering:
            verb = "answers" if len(self.answering) == 1 else "answer"
            parts.append(f"{answering} {verb}")
        return f"{head}: {'; '.join(parts)}"


def probe_tasks(tasks: Sequence[Task], timeout_s: float) -> tuple[Task, ...]:
    """The tasks that do not run a trivial op on their CPU within ``timeout_s`` (all probed
    at once; a probe that does not return is left to its daemon thread)."""
    answered: set[Task] = set()
    threads = []

    def probe(task: Task) -> None:
        """Runs ``1 + 1`` on ``task``'s CPU and reads the result back."""
        try:
            with tf.device(f"{task.name}/device:CPU:0"):
                value = tf.constant(1) + 1
            # Soft placement runs an op for a device that is not there on this process's.
            if int(value.numpy()) == 2 and value.device.startswith(task.name + "/"):
                answered.add(task)
        except Exception:  # noqa: BLE001 - any failure means the task did not answer
            return

    for task in tasks:
        thread = threading.Thread(target=probe, args=(task,), name="hybrid-probe", daemon=True)
        thread.start()
        threads.append(thread)
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return tuple(t for t in tasks if t not in answered)


class StepDeadline:
    """Watches a cluster job's progress; see the module docstring.

    Args:
      tasks: the tasks to probe when the deadline passes.
      on_hang: called once, on the watcher's thread, with the :class:`Hang`.
      deadline_s: seconds a step may take after the previous one finished; None: derived
        from the intervals measured (``factor`` × the longest, at least ``floor_s``).
      mesh_devices: the mesh's devices, stage-major (``[stage][replica]``), to name what a
        silent task holds.
      probe_timeout_s: how long each probe may take.
      floor_s, factor: the derived deadline's terms.
      clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        tasks: Sequence[Task],
        on_hang: Callable[[Hang], None],
        deadline_s: float | None = None,
        mesh_devices: Sequence[Sequence[str]] = (),
        probe_timeout_s: float = 5.0,
        floor_s: float = AUTO_FLOOR_S,
        factor: float = AUTO_FACTOR,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"deadline_s={deadline_s} must be positive seconds (or None: auto)")
        self.tasks = tuple(tasks)
        self.on_hang = on_hang
        self.fixed_s = deadline_s
        self.mesh_devices = [list(row) for row in mesh_devices]
        self.probe_timeout_s = probe_timeout_s
        self.floor_s, self.factor = floor_s, factor
        self.clock = clock
        self.longest_s = 0.0
        self.step: int | None = None
        self.last = 0.0
        self._changed = threading.Condition()
        self._stopped = False
        self._held = 0
        self._thread = threading.Thread(target=self._watch, name="hybrid-deadline", daemon=True)
        self._thread.start()

    @property
    def deadline_s(self) -> float | None:
        """The deadline now: None until the first step has finished."""
        if self.step is None:
            return None
        if self.fixed_s is not None:
            return self.fixed_s
        return max(self.floor_s, self.factor * self.longest_s)

    def progressed(self, step: int) -> None:
        """Reports that ``step`` finished (and what follows it: logs, a checkpoint)."""
        with self._changed:
            now = self.clock()
            if self.step is not None:
                self.longest_s = max(self.longest_s, now - self.last)
            self.step, self.last = step, now
            self._changed.notify_all()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No deadline inside the block (the caller's own work between steps: a callback
        that waits); the next step's deadline counts from the block's end."""
        with self._changed:
            self._held += 1
        try:
            yield
        finally:
            with self._changed:
                self._held -= 1
                self.last = self.clock()
                self._changed.notify_all()

    def close(self) -> None:
        """Stops watching."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def _watch(self) -> None:
        """Waits for each deadline; probes and reports when one passes without progress."""
        extended = False
        with self._changed:
            while not self._stopped:
                deadline = self.deadline_s
                if deadline is None or self._held:
                    self._changed.wait()
                    continue
                step, waited = self.step, self.clock() - self.last
                if waited < deadline * (2 if extended else 1):
                    self._changed.wait(deadline * (2 if extended else 1) - waited)
                    if self.step != step:
                        extended = False
                    continue
                assert step is not None
                self._changed.release()
                try:
                    hang = self._diagnose(step, deadline)
                finally:
                    self._changed.acquire()
                if self.step != step or self._stopped or self._held:
                    extended = False
                    continue  # the step finished while the tasks were probed
                if hang.silent or extended:
                    self._stopped = True
                    self._changed.release()
                    try:
                        self.on_hang(hang)
                    finally:
                        self._changed.acquire()
                    return
                extended = True  # every task answers: a slow step gets one more deadline

    def _diagnose(self, step: int, deadline: float) -> Hang:
        """Probes every task: which run nothing, which do not even answer gRPC."""
        waited = self.clock() - self.last
        unanswered: list[tuple[Task, ...]] = []  # the gRPC handshake, beside the op probes
        handshake = threading.Thread(
            target=lambda: unanswered.append(unreachable(self.tasks, self.probe_timeout_s)),
            name="hybrid-probe",
            daemon=True,
        )
        handshake.start()
        silent = probe_tasks(self.tasks, self.probe_timeout_s)
        handshake.join()
        unserved = tuple(t for t in unanswered[0] if t in silent) if unanswered else ()
        held: dict[Task, tuple[tuple[int, int, str], ...]] = {}
        for task in silent:
            held[task] = tuple(
                (s, r, device)
                for s, row in enumerate(self.mesh_devices)
                for r, device in enumerate(row)
                if device.startswith(task.name + "/")
            )
        return Hang(
            step=step,
            waited_s=waited,
            deadline_s=deadline,
            silent=silent,
            unserved=unserved,
            devices=held,
            answering=tuple(t for t in self.tasks if t not in silent),
        )
