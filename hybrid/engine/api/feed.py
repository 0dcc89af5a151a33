"""Keeps the mesh fed: each global batch prepared and on its devices before its step starts.

``fit``, ``evaluate`` and ``predict`` read their data through Keras's epoch iterator. With a
prefetch depth d > 0, a feeding thread takes each epoch's batches from it, prepares each one
(pads it, cuts it into the replicas' shards: ``Pipeline._batch``) and copies every shard onto
the devices that read it::

    shard r's inputs                          -> replica r's first-stage device
    shard r's labels, sample weights, valid   -> replica r's last-stage device

up to d batches ahead of the step (``fit`` asks for d executions: d × ``steps_per_execution``
batches, which the loop takes at once). A device that shares the host's memory (a CPU of this
process) gets no copy: TensorFlow hands a host tensor to it as it is, and the copy would cost
an op per tensor on the feeding thread. The step then starts on data already in place: the
transfers (host to accelerator, or to another host's devices) overlap the previous step
instead of leading this one, and the host's work on the batch (the input pipeline's own,
padding, splitting) is off the step's critical path. One thread produces and the loop
consumes in order, so the batches and the training are exactly those without prefetching.

The thread runs only tensor work: the pipeline is built, and its metrics created, on the
caller's thread before the first batch is prefetched (Keras keeps its dtype policy and name
scopes per thread).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import tensorflow as tf

from hybrid.engine.api.batches import Shard

__all__ = ["Feed", "Prefetcher", "check_depth", "on_devices", "shares_host_memory"]

T = TypeVar("T")

_ITEM, _END, _ERROR = range(3)


def check_depth(depth: Any) -> int:
    """The prefetch depth as an int.

    Raises:
      ValueError: ``depth`` is not an integer ≥ 0.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(
            f"prefetch={depth!r}: give the number of batches to prepare on the devices "
            "ahead of the step, an integer >= 0 (0 prepares each batch when its step starts)"
        )
    return depth


def shares_host_memory(device: str) -> bool:
    """Whether ``device`` is a CPU of this process (a simulated device): a tensor made on
    the host is already where it reads it (TensorFlow hands it over without a copy)."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.device_type == "CPU" and spec.job in (None, "localhost")


def on_devices(parts: Sequence[Shard], firsts: Sequence[str], lasts: Sequence[str]) -> list[Shard]:
    """Each replica's shard copied onto its devices: inputs onto ``firsts[r]``, labels,
    sample weights and valid flags onto ``lasts[r]`` (left where they are for a device that
    shares the host's memory: :func:`shares_host_memory`)."""

    def to(device: str, tensors: list[tf.Tensor] | None) -> list[tf.Tensor] | None:
        if tensors is None or shares_host_memory(device):
            return tensors
        with tf.device(device):
            return [tf.identity(t) for t in tensors]

    placed = []
    for part, first, last in zip(parts, firsts, lasts, strict=True):
        valid = to(last, [part.valid]) if part.valid is not None else None
        placed.append(
            Shard(
                to(first, part.xs),  # type: ignore[arg-type]
                to(last, part.ys),
                to(last, part.ws),
                valid[0] if valid else None,
            )
        )
    return placed


class Prefetcher(Generic[T]):
    """Iterates ``source`` on a thread, up to ``depth`` items ahead of the consumer, in
    order; an exception raised by ``source`` is raised by ``__next__`` where it occurred in
    the sequence."""

    def __init__(self, source: Iterable[T], depth: int) -> None:
        self._queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=depth)
        self._stopped = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=self._produce, args=(iter(source),), name="hybrid-feed", daemon=True
        )
        self._thread.start()

    def _produce(self, source: Iterator[T]) -> None:
        try:
            for item in source:
                if not self._put((_ITEM, item)):
                    return
            self._put((_END, None))
        except BaseException as error:  # raised to the consumer, in order
            self._put((_ERROR, error))

    def _put(self, entry: tuple[int, Any]) -> bool:
        """Waits for room in the queue; False once the consumer has closed it."""
        while not self._stopped.is_set():
            try:
                self._queue.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        kind, value = self._queue.get()
        if kind == _ITEM:
            return value  # type: ignore[no-any-return]
        self._done = True
        if kind == _ERROR:
            raise value
        raise StopIteration

    def close(self) -> None:
        """Stops the thread: what it prefetched is dropped, as an unread tf.data prefetch
        buffer is; it ends once its current read of ``source`` returns."""
        self._stopped.set()
        self._done = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break


class Feed:
    """One ``fit``/``evaluate``/``predict`` call's feeding: maps each epoch's batch iterator
    to the prepared batches (``prepare``), ``depth`` of them ahead of the loop (0: each one
    prepared when the loop asks for it). A context manager: leaving it stops the threads."""

    def __init__(
        self,
        prepare: Callable[[Any], Any],
        depth: int,
        source: Callable[[Iterator[Any]], Iterator[Any]] | None = None,
    ) -> None:
        self.prepare, self.depth = prepare, check_depth(depth)
        self.source = source  # an epoch's iterator -> what ``prepare`` takes (None: itself)
        self._running: list[Prefetcher[Any]] = []

    def __call__(self, batches: Iterable[Any]) -> Iterator[Any]:
        items = self.source(iter(batches)) if self.source is not None else batches
        prepared = map(self.prepare, items)
        if not self.depth:
            return prepared
        prefetcher = Prefetcher(prepared, self.depth)
        self._running.append(prefetcher)
        return prefetcher

    def __enter__(self) -> Feed:
        return self

    def __exit__(self, *exc: Any) -> None:
        for prefetcher in self._running:
            prefetcher.close()
        self._running.clear()
