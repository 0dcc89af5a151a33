"""Each device's memory limit, where one is known, and the devices that died of running
out of memory (no TensorFlow).

TensorFlow does not say how much memory a device may hold, so whoever knows declares it:
``hybrid.platforms.local_workers`` for the devices it caps, ``hybrid-train
--memory_per_device`` for the mesh it trains on. An out-of-memory error reads it back to say
the limit beside the request (``hybrid.engine.api.out_of_memory``).

    declare("/job:worker/replica:0/task:1", 512 * 2**20)   # a task's devices, or one device
    limit_of("/job:worker/replica:0/task:1/device:CPU:0")   # -> 536870912.0

A device whose process dies of an allocation it could not serve (TensorFlow's CPU runtime
can crash instead of raising) leaves the client only a lost connection; whoever can read
the dead process's own report (its log) adds a reporter, and the error is said as the
out-of-memory error it was.

A device whose allocator lives in another process (a capped local worker) cannot be asked
with ``tf.config.experimental.get_memory_info`` from the client; whoever can ask that process
adds a reader, and :func:`memory_info` answers for the device (the launcher's peak memory per
stage: measured beside predicted).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "add_reader",
    "add_reporter",
    "clear",
    "covers",
    "declare",
    "limit_of",
    "lost_to_memory",
    "memory_info",
    "remove_reader",
    "remove_reporter",
]

Reporter = Callable[[], dict[str, str]]  # -> {device: the allocator's out-of-memory line}
# device -> its allocator's {"current": bytes, "peak": bytes}; None: not a device it knows
Reader = Callable[[str], dict[str, int] | None]

_LIMITS: dict[str, float] = {}
_REPORTERS: list[Reporter] = []
_READERS: list[Reader] = []


def declare(device: str, nbytes: float) -> None:
    """``device`` (a device name, or a prefix of device names such as a task's
    ``/job:worker/replica:0/task:1``; "" for every device) holds at most ``nbytes``.

    Raises:
      ValueError: ``nbytes`` not positive.
    """
    if not nbytes > 0:
        raise ValueError(f"a device's memory limit must be positive, got {nbytes} for {device!r}")
    _LIMITS[device] = float(nbytes)


def limit_of(device: str) -> float | None:
    """The limit declared for ``device`` by its longest declared prefix; None if none is."""
    matches = [name for name in _LIMITS if covers(name, device)]
    return _LIMITS[max(matches, key=len)] if matches else None


def clear() -> None:
    """Forgets every declared limit, reporter and reader."""
    _LIMITS.clear()
    _REPORTERS.clear()
    _READERS.clear()


def add_reporter(reporter: Reporter) -> None:
    """``reporter()`` names the devices that died out of memory, each with its allocator's
    line (e.g. ``ran out of memory trying to allocate 64.00MiB``)."""
    _REPORTERS.append(reporter)


def remove_reporter(reporter: Reporter) -> None:
    """Stops asking ``reporter``."""
    if reporter in _REPORTERS:
        _REPORTERS.remove(reporter)


def lost_to_memory() -> dict[str, str]:
    """Every device a reporter says died out of memory, with its allocator's line."""
    found: dict[str, str] = {}
    for reporter in _REPORTERS:
        found.update(reporter())
    return found


def add_reader(reader: Reader) -> None:
    """``reader(device)`` reads the allocator statistics of the devices it knows."""
    _READERS.append(reader)


def remove_reader(reader: Reader) -> None:
    """Stops asking ``reader``."""
    if reader in _READERS:
        _READERS.remove(reader)


def memory_info(device: str) -> dict[str, int] | None:
    """``device``'s allocator statistics (``current`` and ``peak`` bytes in use) from the
    first reader that knows it; None if none does."""
    for reader in _READERS:
        info = reader(device)
        if info is not None:
            return info
    return None


def covers(prefix: str, device: str) -> bool:
    """Whether ``prefix`` names ``device`` or a part of the name above it."""
    return device == prefix or device.startswith(prefix.rstrip("/") + "/") or not prefix
