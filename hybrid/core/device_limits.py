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
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["add_reporter", "clear", "declare", "limit_of", "lost_to_memory", "remove_reporter"]

Reporter = Callable[[], dict[str, str]]  # -> {device: the allocator's out-of-memory line}

_LIMITS: dict[str, float] = {}
_REPORTERS: list[Reporter] = []


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
    matches = [name for name in _LIMITS if _covers(name, device)]
    return _LIMITS[max(matches, key=len)] if matches else None


def clear() -> None:
    """Forgets every declared limit and reporter."""
    _LIMITS.clear()
    _REPORTERS.clear()


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


def _covers(prefix: str, device: str) -> bool:
    """Whether ``prefix`` names ``device`` or a part of the name above it."""
    return device == prefix or device.startswith(prefix.rstrip("/") + "/") or not prefix
