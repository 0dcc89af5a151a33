"""A schedule on an ideal machine: makespan, bubble and peak in-flight activations."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hybrid.core.schedule.actions import Action, Op, Schedule, dependencies
from hybrid.core.schedule.ordering import execution_order

__all__ = ["Costs", "SimulationResult", "bubble_formula", "simulate"]

Number = Any  # int, float or fractions.Fraction: simulate keeps exact arithmetic exact.


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time of each action kind, per model stage (a number applies to every stage).

    A full backward (B in a schedule without W) costs ``backward + weight``; a split one
    costs ``backward`` for B and ``weight`` for W, so every schedule does the same work.

    Attributes:
      forward: one F.
      backward: the input-gradient part of a backward.
      weight: the weight-gradient part of a backward.
      transfer: latency added to every cross-device edge (activation or gradient).
    """

    forward: Number | Sequence[Number] = 1
    backward: Number | Sequence[Number] = 1
    weight: Number | Sequence[Number] = 1
    transfer: Number = 0

    @staticmethod
    def _at(value: Number | Sequence[Number], stage: int) -> Number:
        return value[stage] if isinstance(value, Sequence) else value

    def of(self, action: Action, split: bool) -> Number:
        if action.op is Op.F:
            return self._at(self.forward, action.stage)
        if action.op is Op.W:
            return self._at(self.weight, action.stage)
        b = self._at(self.backward, action.stage)
        return b if split else b + self._at(self.weight, action.stage)


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` predicts for one step.

    Attributes:
      makespan: time from the first action's start to the last action's end.
      busy: per device, the total time spent computing.
      bubble_fraction: idle share of all devices over the makespan, 1 - sum(busy)/(S·makespan).
      peak_in_flight: per device, the most (stage, micro-batch) pairs whose forward has run
        and whose backward (W, when split) has not: the activations it holds at once.
      timeline: (action, start, end) for every action, in execution order.
    """

    makespan: Number
    busy: tuple[Number, ...]
    bubble_fraction: Number
    peak_in_flight: tuple[int, ...]
    timeline: tuple[tuple[Action, Number, Number], ...]


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimulationResult:
    """Runs ``schedule`` on an ideal machine: each action starts when its device is free and
    its inputs have arrived (plus ``costs.transfer`` across devices).

    With int or Fraction costs every result is exact.
    """
    costs = costs or Costs()
    split = schedule.splits_backward
    K = schedule.num_model_stages
    finish: dict[Action, Number] = {}
    device_free: list[Number] = [0] * schedule.num_stages
    busy: list[Number] = [0] * schedule.num_stages
    timeline = []
    for action in execution_order(schedule):
        d = schedule.device_of(action.stage)
        start = device_free[d]
        for dep in dependencies(action, K):
            crosses = schedule.device_of(dep.stage) != d
            start = max(start, finish[dep] + (costs.transfer if crosses else 0))
        duration = costs.of(action, split)
        finish[action] = start + duration
        device_free[d] = start + duration
        busy[d] += duration
        timeline.append((action, start, start + duration))
    makespan = max(device_free)
    total = schedule.num_stages * makespan
    bubble = (total - sum(busy)) / total if total else 0
    release = Op.W if split else Op.B
    return SimulationResult(
        makespan=makespan,
        busy=tuple(busy),
        bubble_fraction=bubble,
        peak_in_flight=tuple(_peak_in_flight(row, release) for row in schedule.actions),
        timeline=tuple(timeline),
    )


def _peak_in_flight(row: Sequence[Action], release: Op) -> int:
    live = peak = 0
    for a in row:
        if a.op is Op.F:
            live += 1
        elif a.op is release:
            live -= 1
        peak = max(peak, live)
    return peak


def bubble_formula(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """(S-1)/(v·M+S-1): GPipe and 1F1B (v = 1) and interleaved bubbles with uniform costs."""
    return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)
