"""What a worker's allocator held at its peak, from TensorFlow's memory log.

A process started with ``TF_CPP_VMODULE=log_memory=2`` (and ``TF_CPP_MIN_LOG_LEVEL=0``) logs
every tensor and raw allocation of its allocators (``__LOG_MEMORY__`` lines: the kernel that
allocated, the bytes the allocator gave, an id its deallocation names). :func:`replay` plays a
log back in order and returns the bytes live at the high-water mark, grouped by kernel: where
a stage's peak goes (weights, accumulators, received activations, one action's temporaries).

    python benchmarks/memory_trace.py results/memory_trace_1f1b_stage0.log
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections import Counter

_ALLOC = re.compile(r"__LOG_MEMORY__ MemoryLog(?:Tensor|Raw)Allocation ")
_FREE = re.compile(r"__LOG_MEMORY__ MemoryLog(?:Tensor|Raw)Deallocation ")
_KERNEL = re.compile(r"(?:kernel_name|operation): \"([^\"]*)\"")
_SIZE = re.compile(r"(?:allocated_bytes|num_bytes): (\d+)")
_ID = re.compile(r"allocation_id: (\d+)")
_ALLOCATOR = re.compile(r"allocator_name: \"([^\"]*)\"")


def _field(pattern: re.Pattern[str], line: str) -> str:
    m = pattern.search(line)
    return m.group(1) if m else ""


@dataclasses.dataclass(frozen=True)
class Peak:
    """The replayed high-water mark: ``bytes`` live then, ``by_kernel`` (kernel -> bytes,
    largest first), and ``final`` bytes live at the end of the log."""

    bytes: int
    by_kernel: list[tuple[str, int]]
    final: int


def _group(kernel: str) -> str:
    """A kernel name without its micro-batch and call suffixes (``F_s1_m3/PartitionedCall`` ->
    ``F_s1``)."""
    kernel = re.sub(r"_m\d+(/.*)?$", "", kernel)
    if kernel.startswith(("F_", "B_", "W_")):
        return kernel
    return re.sub(r"(_\d+)?(/.*)?$", "", kernel)


def replay(lines: list[str], after: int = 0) -> Peak:
    """The live bytes at the log's high-water mark (at or after line ``after``)."""
    live: dict[tuple[str, str], tuple[str, int]] = {}
    total = best = 0
    best_live: dict[tuple[str, str], tuple[str, int]] = {}
    for i, line in enumerate(lines):
        if "__LOG_MEMORY__" not in line:
            continue
        key = (_field(_ALLOCATOR, line), _field(_ID, line))
        if _ALLOC.search(line):
            size = int(_field(_SIZE, line) or 0)
            live[key] = (_group(_field(_KERNEL, line)), size)
            total += size
            if total > best and i >= after:
                best, best_live = total, dict(live)
        elif _FREE.search(line):
            freed = live.pop(key, None)
            total -= freed[1] if freed else 0
    groups: Counter[str] = Counter()
    for kernel, size in best_live.values():
        groups[kernel] += size
    return Peak(best, groups.most_common(), total)


def main(argv: list[str]) -> None:
    for path in argv[1:]:
        with open(path) as f:
            peak = replay(f.readlines())
        print(f"{path}: peak {peak.bytes / 2**20:.2f} MiB, final {peak.final / 2**20:.2f} MiB")
        for kernel, size in peak.by_kernel[:25]:
            print(f"  {size / 2**20:8.3f} MiB  {kernel}")


if __name__ == "__main__":
    main(sys.argv)
