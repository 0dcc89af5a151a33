"""What a plan found: the feasible candidates ranked by predicted step time, the rejected ones
with their reasons, and the text table of both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from hybrid.core.config import RunConfig
from hybrid.core.memory import format_bytes
from hybrid.planning.cost_model import Prediction
from hybrid.planning.hardware import Hardware

__all__ = ["Plan", "Rejection", "format_bytes", "format_time"]


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A candidate that cannot run or does not fit, and why.

    Attributes:
      config: the candidate.
      kind: "out of memory" or a :attr:`hybrid.core.config.ConfigError.kind`.
      reason: with the values, e.g. "out of memory: needs 3.1 GiB per device, has 2.0 GiB".
      prediction: the prediction, when the candidate could run but does not fit.
    """

    config: RunConfig
    kind: str
    reason: str
    prediction: Prediction | None = None


def format_time(seconds: float) -> str:
    """1.5 s, 3.2 ms, 12 µs."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every candidate the planner considered: the ones that fit, fastest first, and the
    rejected ones with their reasons.

    Attributes:
      devices: N, the device budget.
      global_batch: examples per step.
      hardware: the machine planned for.
      ranked: predictions of the feasible candidates, fastest first.
      rejected: the others.
      merged: feasible candidates left out of ``ranked`` because their prediction equals a
        ranked one but for the schedule (the schedules coincide on a 1-stage mesh).
      seconds: how long planning took, profiling included.
    """

    devices: int
    global_batch: int
    hardware: Hardware
    ranked: tuple[Prediction, ...]
    rejected: tuple[Rejection, ...]
    merged: int = 0
    seconds: float = 0.0

    @property
    def best(self) -> Prediction:
        """The fastest feasible candidate.

        Raises:
          ValueError: none is feasible; the message summarises why.
        """
        if not self.ranked:
            raise ValueError(
                f"no configuration of {self.devices} devices fits a global batch of "
                f"{self.global_batch}: " + "; ".join(self.reasons()) + self._smallest_miss()
            )
        return self.ranked[0]

    def _smallest_miss(self) -> str:
        """By how much the candidate needing the least memory misses the budget ("" when no
        candidate was out of memory)."""
        limit = self.hardware.usable_memory
        short = [r.prediction for r in self.rejected if r.prediction is not None]
        if limit is None or not short:
            return ""
        smallest = min(short, key=lambda p: p.peak_memory)
        needs, miss = smallest.peak_memory, smallest.peak_memory - limit
        headroom = self.hardware.allocator_headroom
        kept = f" after the {headroom:.0%} left to the allocator" if headroom else ""
        return (
            f"; the smallest candidate, {smallest.config.label()}, needs "
            f"{format_bytes(needs)} per device: {format_bytes(miss)} "
            f"({miss / limit:.0%}) more than the {format_bytes(limit)} each device has{kept}"
        )

    def reasons(self) -> list[str]:
        """Each kind of rejection with its count and one example, most frequent first:
        ``"out of memory ×12 (e.g. 1x8 M=1 gpipe never: needs 3.1 GiB per device, ...)"``."""
        groups: dict[str, list[Rejection]] = {}
        for r in self.rejected:
            groups.setdefault(r.kind, []).append(r)
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        return [
            f"{kind} ×{len(rs)} (e.g. {rs[0].config.label()}: {rs[0].reason})"
            for kind, rs in ordered
        ]

    def table(self, top: int = 10, rejected: int = 5) -> str:
        """A text table of the ``top`` fastest candidates, then up to ``rejected``
        rejections (the fastest out-of-memory ones first)."""
        memory = self.hardware.memory_per_device
        head = (
            f"plan for {self.devices} devices, global batch {self.global_batch}"
            + (f", {format_bytes(memory)} per device" if memory else "")
            + (
                f" ({self.hardware.allocator_headroom:.0%} left to the allocator)"
                if memory and self.hardware.allocator_headroom
                else ""
            )
            + f": {len(self.ranked)} feasible, {len(self.rejected)} rejected"
            + (
                f", {self.merged} left out as equal to a row but for the schedule (1-stage meshes)"
                if self.merged
                else ""
            )
            + (f"; planned in {format_time(self.seconds)}" if self.seconds else "")
        )
        cols = f"{'#':>3} {'mesh':>6} {'M':>4} {'schedule':<16} {'remat':<14} {'step':>9} "
        cols += f"{'examples/s':>11} {'bubble':>7} {'mem/device':>11}  balance"
        lines = [head, cols]
        lines += [_ranked_row(i, p) for i, p in enumerate(self.ranked[:top], 1)]
        if self.rejected and rejected > 0:
            lines += self._rejected_lines(rejected)
        return "\n".join(lines)

    def _rejected_lines(self, count: int) -> list[str]:
        """The rejection reasons, then the ``count`` fastest candidates that do not fit."""
        lines = ["rejected:"] + [f"    {reason}" for reason in self.reasons()]
        fastest = sorted(
            (r for r in self.rejected if r.prediction is not None),
            key=lambda r: r.prediction.step_time if r.prediction else math.inf,
        )[:count]
        if fastest:
            lines.append("fastest that do not fit:")
            for r in fastest:
                assert r.prediction is not None
                step = format_time(r.prediction.step_time)
                lines.append(f"    {r.config.label()}: {step}, {r.reason}")
        return lines

    def __str__(self) -> str:
        return self.table()


def _ranked_row(rank: int, p: Prediction) -> str:
    """One row of the table: rank, mesh, M, schedule, remat (``+deferred``: weight
    gradients deferred), step, throughput, bubble, memory and balance."""
    c = p.config
    sched = c.schedule + (f"(v={c.virtual_stages})" if c.virtual_stages > 1 else "")
    bal = _runs(c.balance) if isinstance(c.balance, tuple) else ""
    remat = c.remat + ("+deferred" if c.defer_weight_gradients else "")
    return (
        f"{rank:>3} {f'{c.stages}x{c.replicas}':>6} {c.micro_batches:>4} {sched:<16} "
        f"{remat:<14} {format_time(p.step_time):>9} {p.throughput:>11.4g} "
        f"{p.bubble:>7.1%} {format_bytes(p.peak_memory):>11}  {bal}"
    )


def _runs(balance: Sequence[int]) -> str:
    """``(4, 3, 3, 3, 4)`` -> ``"4,3×3,4"``: runs of three or more equal counts shortened."""
    parts: list[str] = []
    i = 0
    while i < len(balance):
        j = i
        while j < len(balance) and balance[j] == balance[i]:
            j += 1
        run = j - i
        parts += [f"{balance[i]}×{run}"] if run > 2 else [str(balance[i])] * run
        i = j
    return ",".join(parts)
