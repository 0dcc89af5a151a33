"""What a process's allocator held at its peak, from a TensorFlow profile of that process.

While the profiler runs, TensorFlow's BFC allocator records every allocation and
deallocation it serves (``MemoryAllocation`` / ``MemoryDeallocation`` events: the bytes
requested, the bytes of the chunk it gave, the op, its bytes in use after the event), the
buffers of XLA programs included. :func:`replay` plays them back in order:

    allocated peak   the chunks in use at their high-water mark (what
                     ``tf.config.experimental.get_memory_info``'s "peak" reports)
    requested peak   the bytes the tensors asked for at their high-water mark:
                     chunks in use − Σ (chunk − request) over the allocations live then
    waste            chunk − request over what was live at the allocated peak: BFC serves
                     a request with a free chunk of less than twice its size unsplit
    by_op            at the requested peak, the requested bytes live per op ("" for an XLA
                     program's buffers and transfers, which name none)

Allocations made before the profile started count at their chunk size (their requests are
not recorded).

    python benchmarks/allocations.py LOGDIR    # a tf.profiler log directory
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["Event", "Peak", "events", "latest_xplane", "replay"]


@dataclasses.dataclass(frozen=True)
class Event:
    """One allocator event: ``allocated`` the allocator's bytes in use after it."""

    time_ps: int
    allocation: bool
    address: int
    requested: int
    chunk: int
    allocated: int
    op: str


@dataclasses.dataclass(frozen=True)
class Peak:
    """The replayed high-water marks (bytes; see the module docstring)."""

    allocated: int
    requested: int
    waste: int
    by_op: list[tuple[str, int]]


def latest_xplane(logdir: str) -> str:
    """The newest ``*.xplane.pb`` a ``tf.profiler.experimental`` run wrote under ``logdir``.

    Raises:
      FileNotFoundError: none there.
    """
    found = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    if not found:
        raise FileNotFoundError(f"no *.xplane.pb under {logdir}/plugins/profile")
    return max(found, key=os.path.getmtime)


def events(path: str) -> list[Event]:
    """Every allocator event of the profile at ``path``, in time order."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    found = []
    for plane in space.planes:
        names, stat_names = plane.event_metadata, plane.stat_metadata
        for line in plane.lines:
            for ev in line.events:
                name = names[ev.metadata_id].name
                if name not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {stat_names[s.metadata_id].name: _value(s, stat_names) for s in ev.stats}
                found.append(
                    Event(
                        time_ps=line.timestamp_ns * 1000 + ev.offset_ps,
                        allocation=name == "MemoryAllocation",
                        address=int(stats.get("addr", 0)),
                        requested=int(stats.get("requested_bytes", 0)),
                        chunk=int(stats.get("allocation_bytes", 0)),
                        allocated=int(stats.get("bytes_allocated", 0)),
                        op=str(stats.get("tf_op", "")),
                    )
                )
    return sorted(found, key=lambda e: e.time_ps)


def _value(stat: Any, stat_names: Any) -> Any:
    """An XStat's value (a string it refers to by id, resolved)."""
    kind = stat.WhichOneof("value")
    return stat_names[stat.ref_value].name if kind == "ref_value" else getattr(stat, kind)


def replay(timeline: Sequence[Event]) -> Peak:
    """The allocated and requested high-water marks of ``timeline`` (one allocator's)."""
    live: dict[int, Event] = {}
    waste = 0
    allocated = (0, 0)  # (chunks in use, waste then)
    requested = (0, {})  # (requests in use, what was live then)
    for e in timeline:
        if e.allocation:
            old = live.pop(e.address, None)  # (an address reused without its free seen)
            waste -= old.chunk - old.requested if old else 0
            live[e.address] = e
            waste += e.chunk - e.requested
        elif e.address in live:
            gone = live.pop(e.address)
            waste -= gone.chunk - gone.requested
        if e.allocated > allocated[0]:
            allocated = (e.allocated, waste)
        if e.allocated - waste > requested[0]:
            requested = (e.allocated - waste, dict(live))
    by_op: collections.Counter[str] = collections.Counter()
    for e in requested[1].values():
        by_op[e.op] += e.requested
    return Peak(allocated[0], requested[0], allocated[1], by_op.most_common())


def main(argv: list[str]) -> int:
    peak = replay(events(latest_xplane(argv[1])))
    mib = 1 << 20
    print(
        f"allocated peak {peak.allocated / mib:.2f} MiB (waste {peak.waste / mib:.2f}), "
        f"requested peak {peak.requested / mib:.2f} MiB"
    )
    for op, nbytes in peak.by_op[:20]:
        print(f"  {nbytes / mib:8.2f} MiB  {op or '(XLA program / transfer)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
