"""The profiler's compiles on threads: XLA compiles a program without holding Python's lock,
so while the main thread traces the next probe, the probes traced already compile (and run
once) on other cores. A probe's memory is measured once its programs are compiled, with
the device to itself: the allocator's peak counts everything running on the device, so a
measurement waits for the programs in flight and holds new ones back until it is done
(:class:`DeviceGate`)."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

__all__ = ["Compiler", "DeviceGate", "compile_threads"]


def compile_threads() -> int:
    """Threads that compile: one per core this process may use, at most 4."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


class DeviceGate:
    """Programs share the device; a measurement has it alone (and goes first: once one
    waits, no new program starts)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = 0
        self._measuring = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """While a program runs beside others."""
        with self._changed:
            self._changed.wait_for(lambda: not self._measuring)
            self._running += 1
        try:
            yield
        finally:
            with self._changed:
                self._running -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """While a measurement runs with nothing else on the device."""
        with self._changed:
            self._changed.wait_for(lambda: not self._measuring)
            self._measuring = True
            self._changed.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            with self._changed:
                self._measuring = False
                self._changed.notify_all()


class Compiler:
    """Compiles items on threads and measures each, in submission order, on the calling
    thread once it is compiled, alone on the device.

    ``compile(item, gate)`` runs on a pool thread (each program call inside
    ``gate.shared()``); ``measure(item)`` on the thread that calls :meth:`submit` and
    :meth:`finish`, inside ``gate.alone()``.
    """

    def __init__(
        self,
        compile: Callable[[Any, DeviceGate], None],
        measure: Callable[[Any], None],
        threads: int | None = None,
    ) -> None:
        self.gate = DeviceGate()
        self._compile, self._measure = compile, measure
        self._pool = futures.ThreadPoolExecutor(threads or compile_threads())
        self._pending: collections.deque[tuple[Any, futures.Future[None]]] = collections.deque()

    def submit(self, item: Any) -> list[Any]:
        """Starts compiling ``item``; measures the items compiled since, returns them."""
        self._pending.append((item, self._pool.submit(self._compile, item, self.gate)))
        return self._measure_while(lambda future: future.done())

    def finish(self) -> list[Any]:
        """Waits for every compile, measures the items left; returns them."""
        try:
            return self._measure_while(lambda future: True)
        finally:
            self._pool.shutdown()

    def _measure_while(self, ready: Callable[[futures.Future[None]], bool]) -> list[Any]:
        measured = []
        while self._pending and ready(self._pending[0][1]):
            item, future = self._pending.popleft()
            future.result()  # a compile's error, raised here
            with self.gate.alone():
                self._measure(item)
            measured.append(item)
        return measured

    def __enter__(self) -> Compiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(cancel_futures=True)
