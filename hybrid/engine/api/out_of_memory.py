"""A device out of memory, said in one line: which stage and device, the bytes it asked for,
the predicted peak, the device's limit, and what to change.

TensorFlow reports an allocation that does not fit in one of three forms, all read here:

    OOM when allocating tensor with shape[2048,2048] and type float on DEVICE by allocator ...
    Out of memory while trying to allocate 16.00MiB.  [[{{node F_s1_m0/...}}]]   (XLA)
    ran out of memory trying to allocate 64.00MiB                          (the allocator's log)

The device is the one named, else the stage is read from the failing program's scope
(``F_s1_m0``: ``lowering.action_scope``) and the replica from the innermost remote task the
error came from. :func:`explain` turns the error into :class:`OutOfMemoryError`, still a
``tf.errors.ResourceExhaustedError``, whose message is that one line;
:meth:`OutOfMemoryError.line` words the remedies as the launcher's flags instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from hybrid.core import device_limits
from hybrid.core.memory import format_bytes

__all__ = [
    "OutOfMemoryError", "Where", "explain", "locate", "remedies", "requested_bytes", "row_of",
    "said",
]  # fmt: skip

_SIZE = re.compile(r"allocate (\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|bytes)\b")
_TENSOR = re.compile(r"OOM when allocating tensor with shape\[([\d,\s]*)\] and type (\w+) on (\S+)")
_SCOPE = re.compile(r"\b[A-Z]+_s(\d+)_m\d+\b")
_REMOTE = re.compile(r"remote target (/job:[^/\s]+/replica:\d+/task:\d+)")
_UNITS = {"B": 1, "bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def requested_bytes(text: str) -> float | None:
    """The bytes of the allocation that failed, as the error or the allocator's log says
    them; None when it says no size."""
    tensor = _TENSOR.search(text)
    if tensor:
        dims = [int(d) for d in tensor.group(1).replace(" ", "").split(",") if d]
        try:
            size = tf.as_dtype(tensor.group(2)).size
        except TypeError:
            size = np.dtype(tensor.group(2)).itemsize
        return float(math.prod(dims) * size)
    match = _SIZE.search(text)
    return float(match.group(1)) * _UNITS[match.group(2)] if match else None


@dataclasses.dataclass(frozen=True)
class Where:
    """Where an allocation failed: the mesh row (pipeline device, None if unknown), the
    model stage if a program's scope names it, and the device if known."""

    row: int | None
    stage: int | None
    device: str | None


def locate(text: str, mesh: Any, schedule: Any) -> Where:
    """The row, stage and device of the error ``text`` on ``mesh`` (a ``DeviceMesh``) run by
    ``schedule`` (stage k on row ``schedule.device_of(k)``)."""
    tensor = _TENSOR.search(text)
    scope = _SCOPE.search(text)
    stage = int(scope.group(1)) if scope else None
    if tensor:
        return Where(row_of(tensor.group(3), mesh), stage, tensor.group(3))
    if stage is None:
        return Where(None, None, None)
    row = schedule.device_of(stage) if schedule is not None else stage
    tasks = _REMOTE.findall(text)
    devices = mesh.devices[row]
    if tasks:  # the innermost remote task is where it failed
        named = [d for d in devices if d.startswith(tasks[-1] + "/")]
        return Where(row, stage, named[0] if named else None)
    return Where(row, stage, devices[0] if len(devices) == 1 else None)


def row_of(device: str, mesh: Any) -> int | None:
    """The mesh row holding ``device`` (as TensorFlow names it, fully or not); None if none."""
    for d, row in enumerate(mesh.devices):
        if any(device == name or device.endswith(name) or name.endswith(device) for name in row):
            return d
    return None


class OutOfMemoryError(tf.errors.ResourceExhaustedError):
    """A device of the pipeline ran out of memory; the message is one line.

    Attributes:
      where: the mesh row, model stage and device (each None where the error did not say).
      requested: the bytes of the allocation that failed (None: not said).
      predicted: the pipeline's predicted peak for that row (``pipe.predicted_memory()``).
      limit: the device's memory limit (``hybrid.core.device_limits``), if declared.
      remedies: what may make it fit, as (Python API, launcher flag) pairs.
    """

    def __init__(
        self,
        where: Where,
        requested: float | None,
        predicted: float | None,
        limit: float | None,
        remedies: tuple[tuple[str, str], ...],
        cause: tf.errors.OpError | None = None,
    ) -> None:
        self.where, self.requested, self.predicted = where, requested, predicted
        self.limit, self.remedies = limit, remedies
        node_def, op = (cause.node_def, cause.op) if cause is not None else (None, None)
        super().__init__(node_def, op, self.line())

    def __reduce__(self) -> Any:
        return (type(self), (self.where, self.requested, self.predicted, self.limit, self.remedies))

    def line(self, flags: bool = False) -> str:
        """The one line; ``flags``: the remedies as ``hybrid-train``'s flags."""
        w = self.where
        at = "a device" if w.row is None else f"pipeline device {w.row}"
        if w.stage is not None:
            at += f" (model stage {w.stage})"
        if w.device:
            at += f" {w.device}"
        asked = f"{format_bytes(self.requested)} more" if self.requested else "memory"
        known = [
            f"predicted peak {format_bytes(self.predicted)}" if self.predicted else "",
            f"limit {format_bytes(self.limit)}" if self.limit else "",
        ]
        facts = f" ({', '.join(k for k in known if k)})" if any(known) else ""
        fixes = [flag if flags else api for api, flag in self.remedies]
        return f"out of memory on {at}: it asked for {asked}{facts}; to fit, try " + (
            ", ".join(fixes[:-1]) + f" or {fixes[-1]}" if len(fixes) > 1 else fixes[0]
        )


def remedies(pipe: Any, limit: float | None, building: bool) -> tuple[tuple[str, str], ...]:
    """What may make ``pipe`` fit, most effective first, as (API, flag) wordings;
    ``building``: the weights and optimizer state alone did not fit (activations are not
    the matter)."""
    config = pipe.config
    found: list[tuple[str, str]] = []
    if pipe.remat != "always" and not building:
        found.append(('remat="always"', "--remat=always"))
    more = 2 * pipe.micro_batches
    if not building:
        found.append((f"micro_batches={more}", f"--micro_batches={more}"))
    if config.replicas > 1 and not config.shard_optimizer_states:
        found.append(("shard_optimizer_states=True", "--shard_optimizer_states"))
    if pipe._balance_mode != "memory":
        found.append(('balance="memory"', "--balance=memory"))
    found.append(("a mesh with more stages", "--mesh with more stages"))
    budget = format_bytes(limit).replace(" ", "") if limit else "<bytes>"
    found.append(
        (
            f"hybrid.plan(..., memory_per_device={int(limit) if limit else '<bytes>'}) for a "
            "layout that fits",
            f"--mesh=auto --memory_per_device={budget}",
        )
    )
    return tuple(found)


def explain(
    err: BaseException,
    pipe: Any,
    building: bool = False,
    lost: tuple[str, str] | None = None,
) -> OutOfMemoryError:
    """``err`` as an :class:`OutOfMemoryError` of ``pipe``; ``building``: raised while
    placing the weights; ``lost``: (device, its allocator's line) of a device that died out
    of memory, when ``err`` is only the lost connection."""
    if lost:
        message, where = lost[1], Where(row_of(lost[0], pipe.mesh), None, lost[0])
    else:
        message = getattr(err, "message", str(err))
        where = locate(message, pipe.mesh, pipe.schedule)
    predicted = None
    if where.row is not None and pipe.built and pipe.compiled:
        peaks = pipe.predicted_memory()
        predicted = peaks[where.row] if peaks else None
    limit = device_limits.limit_of(where.device) if where.device else None
    cause = err if isinstance(err, tf.errors.OpError) else None
    return OutOfMemoryError(
        where, requested_bytes(message), predicted, limit, remedies(pipe, limit, building), cause
    )


@contextlib.contextmanager
def said(pipe: Any, building: bool = False) -> Iterator[None]:
    """Runs the block; a ``ResourceExhaustedError`` in it (an allocation that did not fit),
    or a lost connection to a device that a reporter (``device_limits``) says died out of
    memory, comes out as :class:`OutOfMemoryError` of ``pipe``, from the original."""
    try:
        yield
    except OutOfMemoryError:
        raise
    except tf.errors.ResourceExhaustedError as err:
        raise explain(err, pipe, building) from err
    except (tf.errors.UnavailableError, tf.errors.CancelledError) as err:
        lost = device_limits.lost_to_memory()
        if not lost:
            raise
        raise explain(err, pipe, building, lost=next(iter(lost.items()))) from err
