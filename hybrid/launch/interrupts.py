"""Ctrl-C and SIGTERM (what ``kill`` and a preempted VM send) for the launcher.

    first SIGINT / SIGTERM   -> a line on stderr ("SIGINT: finishing the step in flight ...");
                                ``stop`` is set: the step in flight finishes, is checkpointed,
                                and the run ends: "interrupted at step N; saved ckpt-N; run
                                the same command to resume", exit 130 / 143 (128 + signal)
    a second one             -> KeyboardInterrupt at once (``Pipeline.fit`` stops its threads)

The library never installs signal handlers: ``hybrid.run.trainer.train(stop=...)`` takes the
event, and ``Pipeline.fit`` lets KeyboardInterrupt through as Keras does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["Interrupts", "exit_code"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_code(signal_number: int) -> int:
    """The shell's code for a process ended by ``signal_number``: 128 + its number."""
    return 128 + signal_number


class Interrupts:
    """Turns the first SIGINT/SIGTERM into ``stop`` and a second into KeyboardInterrupt.

    Attributes:
      stop: set by the first signal.
      received: the first signal's number (None before one arrives).
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.received: int | None = None

    def _handle(self, number: int, frame: FrameType | None) -> None:
        del frame
        if self.stop.is_set():
            raise KeyboardInterrupt(f"{signal.Signals(number).name} again: stopping at once")
        self.received = number
        self.stop.set()
        # os.write, not print: a handler may run in the middle of another print
        os.write(
            2,
            f"{signal.Signals(number).name}: finishing the step in flight, then saving a "
            "checkpoint (send it again to stop at once)\n".encode(),
        )

    @contextlib.contextmanager
    def installed(self) -> Iterator[Interrupts]:
        """The handlers for the body (the previous ones restored after it)."""
        previous = {number: signal.signal(number, self._handle) for number in _SIGNALS}
        try:
            yield self
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
