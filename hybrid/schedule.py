"""Pipeline schedules as plain data: generators, a validator and a simulator.

A schedule says, for every pipeline device, the order in which it runs its actions. An
action is ``F`` (forward) or ``B`` (backward) of one stage on one micro-batch:

    "0: F0 F1 F2 F3 B0 B1 B2 B3 | 1: F0 F1 F2 F3 B0 B1 B2 B3"

Nothing here knows about TensorFlow. The engine (``pipeline.py``) interprets a schedule by
issuing each device's actions in order, in the global order returned by
:func:`execution_order`; :func:`validate` proves the schedule can run (no deadlock, every
micro-batch goes forward through all stages and back) and :func:`simulate` predicts its
makespan, bubble and memory from per-action costs.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "Action",
    "Costs",
    "Op",
    "Schedule",
    "ScheduleError",
    "SimulationResult",
    "execution_order",
    "get",
    "gpipe",
    "names",
    "simulate",
    "validate",
]


class ScheduleError(ValueError):
    """A schedule that cannot run; the message shows the grid with the bad cell marked."""


class Op(str, enum.Enum):
    """What an action computes: ``F`` forward, ``B`` backward (input and weight gradients)."""

    F = "F"
    B = "B"

    def __str__(self) -> str:
        return self.value


_ACTION_RE = re.compile(r"^([FB])(\d+)$")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``op`` of pipeline stage ``stage`` on micro-batch ``microbatch``."""

    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}"

    @classmethod
    def parse(cls, text: str, stage: int) -> Action:
        """Parses the short form (``"F0"``, ``"B3"``) of an action on ``stage``."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}; expected an op F or B followed by a "
                "micro-batch number, e.g. 'F0' or 'B3'"
            )
        return cls(stage=stage, op=Op(match.group(1)), microbatch=int(match.group(2)))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Ordered actions per pipeline device: ``actions[d]`` runs on device (stage) ``d``.

    Attributes:
      num_stages: S, the number of pipeline stages (and devices along the pipeline axis).
      num_microbatches: M, the number of micro-batches each step is split into.
      actions: for each stage, the actions that stage's device runs, in order.
      name: the generator that produced it, for messages.
    """

    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    name: str = "custom"

    def __str__(self) -> str:
        return " | ".join(
            f"{d}: " + " ".join(str(a) for a in acts) for d, acts in enumerate(self.actions)
        )

    @classmethod
    def parse(cls, text: str, num_microbatches: int | None = None) -> Schedule:
        """Parses the string form ``"0: F0 F1 B0 B1 | 1: F0 B0 F1 B1"``."""
        rows = [row.strip() for row in text.split("|")]
        actions = []
        for d, row in enumerate(rows):
            head, _, body = row.partition(":")
            if not _ or int(head) != d:
                raise ValueError(f"row {d} of {text!r} must start with '{d}:'")
            actions.append(tuple(Action.parse(tok, d) for tok in body.split()))
        if num_microbatches is None:
            num_microbatches = 1 + max((a.microbatch for row in actions for a in row), default=-1)
        return cls(len(actions), num_microbatches, tuple(actions))

    def grid(self, mark: Iterable[tuple[int, int]] = ()) -> str:
        """Renders the schedule as a steps × stages text grid.

        Args:
          mark: (stage, position) cells to highlight as ``>F0<``.
        """
        marked = set(mark)
        length = max((len(row) for row in self.actions), default=0)
        lines = ["step  " + " ".join(f"{'s' + str(d):>6}" for d in range(self.num_stages))]
        for i in range(length):
            cells = []
            for d, row in enumerate(self.actions):
                text = str(row[i]) if i < len(row) else "."
                cells.append(f"{'>' + text + '<' if (d, i) in marked else text:>6}")
            lines.append(f"{i:>4}  " + " ".join(cells))
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Generators
# ---------------------------------------------------------------------------


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"a schedule needs at least one stage and one micro-batch; got "
            f"num_stages={num_stages}, num_microbatches={num_microbatches}"
        )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards in reverse micro-batch order, on every stage.

    With S = 2 stages and M = 4 micro-batches, uniform costs F = B = 1 give::

        s0: F0 F1 F2 F3 .  .  B3 B2 B1 B0
        s1: .  F0 F1 F2 F3 B3 B2 B1 B0 .

    makespan (M + S - 1)(F + B) and bubble fraction (S - 1) / (M + S - 1). The backward
    starts with the last micro-batch, whose activations the last stage has just made: that
    is the micro-batch remat="except_last" does not recompute.
    """
    _check_sizes(num_stages, num_microbatches)
    rows = tuple(
        tuple(Action(s, Op.F, m) for m in range(num_microbatches))
        + tuple(Action(s, Op.B, m) for m in reversed(range(num_microbatches)))
        for s in range(num_stages)
    )
    return Schedule(num_stages, num_microbatches, rows, name="gpipe")


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Every stage runs F0 … F(M-1): the inference pipeline used by evaluate/predict."""
    _check_sizes(num_stages, num_microbatches)
    rows = tuple(
        tuple(Action(s, Op.F, m) for m in range(num_microbatches)) for s in range(num_stages)
    )
    return Schedule(num_stages, num_microbatches, rows, name="forward")


_GENERATORS: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe}


def names() -> list[str]:
    """The registered training schedule names, sorted."""
    return sorted(_GENERATORS)


def get(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """Builds the registered schedule ``name`` for S stages and M micro-batches."""
    if name not in _GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {names()}")
    return _GENERATORS[name](num_stages, num_microbatches)


# ---------------------------------------------------------------------------
# Dependencies, validation and the global issue order
# ---------------------------------------------------------------------------


def _dependencies(action: Action, num_stages: int) -> tuple[Action, ...]:
    """The actions whose results ``action`` consumes.

    F(s, m) reads the activation of F(s-1, m); B(s, m) reads its own stage's forward F(s, m)
    and the input gradient of B(s+1, m).
    """
    s, m = action.stage, action.microbatch
    if action.op is Op.F:
        return (Action(s - 1, Op.F, m),) if s > 0 else ()
    deps = [Action(s, Op.F, m)]
    if s + 1 < num_stages:
        deps.append(Action(s + 1, Op.B, m))
    return tuple(deps)


def _check_contents(schedule: Schedule, ops: Sequence[Op]) -> None:
    """Every (stage, op, micro-batch) appears exactly once, on its own stage's device."""
    S, M = schedule.num_stages, schedule.num_microbatches
    if len(schedule.actions) != S:
        raise ScheduleError(
            f"schedule has {len(schedule.actions)} device rows but num_stages={S}\n"
            + schedule.grid()
        )
    seen: dict[Action, tuple[int, int]] = {}
    for d, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            problem = None
            if a.stage != d:
                problem = f"action {a} of stage {a.stage} is on device {d}"
            elif not 0 <= a.microbatch < M:
                problem = f"micro-batch {a.microbatch} is out of range [0, {M})"
            elif a.op not in ops:
                problem = f"op {a.op} is not allowed here; expected only {[str(o) for o in ops]}"
            elif a in seen:
                problem = f"{a} on stage {d} appears twice"
            if problem:
                raise ScheduleError(f"{problem}:\n" + schedule.grid(mark=[(d, i)]))
            seen[a] = (d, i)
    for s in range(S):
        for op in ops:
            for m in range(M):
                if Action(s, op, m) not in seen:
                    raise ScheduleError(
                        f"stage {s} never runs {op}{m}; every micro-batch must run "
                        f"{'/'.join(str(o) for o in ops)} on every stage:\n" + schedule.grid()
                    )


def execution_order(schedule: Schedule) -> list[Action]:
    """A global order of all actions that respects each device's order and every data edge.

    The engine creates its ops in this order; each device runs its own actions in the order
    the schedule gives. Conceptually: repeatedly let every device run its next action if the
    actions it depends on have run; if no device can move, the schedule deadlocks.

    Raises:
      ScheduleError: the schedule deadlocks; the grid marks each device's blocked action.
    """
    ops = (Op.F, Op.B) if any(a.op is Op.B for row in schedule.actions for a in row) else (Op.F,)
    _check_contents(schedule, ops)
    done: set[Action] = set()
    cursor = [0] * schedule.num_stages
    order: list[Action] = []
    total = sum(len(row) for row in schedule.actions)
    while len(order) < total:
        progressed = False
        for d, row in enumerate(schedule.actions):
            while cursor[d] < len(row):
                action = row[cursor[d]]
                if not all(dep in done for dep in _dependencies(action, schedule.num_stages)):
                    break
                done.add(action)
                order.append(action)
                cursor[d] += 1
                progressed = True
        if not progressed:
            blocked = [
                (d, cursor[d])
                for d in range(schedule.num_stages)
                if cursor[d] < len(schedule.actions[d])
            ]
            waits = "; ".join(
                f"stage {d} waits at {schedule.actions[d][i]} for "
                + ", ".join(
                    f"{dep.op}{dep.microbatch} on stage {dep.stage}"
                    for dep in _dependencies(schedule.actions[d][i], schedule.num_stages)
                    if dep not in done
                )
                for d, i in blocked
            )
            raise ScheduleError(f"schedule deadlocks: {waits}\n" + schedule.grid(mark=blocked))
    return order


def validate(schedule: Schedule) -> Schedule:
    """Checks that ``schedule`` can train: returns it unchanged, or raises ScheduleError.

    Every micro-batch must run F then B once on every stage, F in stage order 0..S-1 and B in
    reverse; each device must be able to run its list in order without waiting on itself.
    """
    if not any(a.op is Op.B for row in schedule.actions for a in row):
        raise ScheduleError("a training schedule needs backward actions:\n" + schedule.grid())
    execution_order(schedule)
    return schedule


# ---------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------

Number = Any  # int, float or fractions.Fraction: simulate keeps exact arithmetic exact.


@dataclasses.dataclass(frozen=True)
class Costs:
    """Time of each action kind, per stage (a number applies to every stage).

    Attributes:
      forward: time of one F on each stage.
      backward: time of one B on each stage.
      transfer: latency added to every cross-device edge (activation or gradient).
    """

    forward: Number | Sequence[Number] = 1
    backward: Number | Sequence[Number] = 2
    transfer: Number = 0

    def of(self, action: Action) -> Number:
        value = self.forward if action.op is Op.F else self.backward
        if isinstance(value, Sequence):
            return value[action.stage]
        return value


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` predicts for one step.

    Attributes:
      makespan: time from the first action's start to the last action's end.
      busy: per device, the total time spent computing.
      bubble_fraction: idle share of all devices over the makespan, 1 - sum(busy)/(S·makespan).
      peak_in_flight: per device, the most micro-batches whose forward has run and whose
        backward has not (the activations the device holds at once).
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
    finish: dict[Action, Number] = {}
    device_free: list[Number] = [0] * schedule.num_stages
    timeline = []
    for action in execution_order(schedule):
        start = device_free[action.stage]
        for dep in _dependencies(action, schedule.num_stages):
            ready = finish[dep] + (costs.transfer if dep.stage != action.stage else 0)
            start = max(start, ready)
        end = start + costs.of(action)
        finish[action] = end
        device_free[action.stage] = end
        timeline.append((action, start, end))
    makespan = max(device_free)
    busy = tuple(sum(costs.of(a) for a in row) for row in schedule.actions)
    total = schedule.num_stages * makespan
    bubble = (total - sum(busy)) / total if total else 0
    return SimulationResult(
        makespan=makespan,
        busy=busy,
        bubble_fraction=bubble,
        peak_in_flight=tuple(_peak_in_flight(row) for row in schedule.actions),
        timeline=tuple(timeline),
    )


def _peak_in_flight(row: Sequence[Action]) -> int:
    live = peak = 0
    for a in row:
        live += 1 if a.op is Op.F else -1
        peak = max(peak, live)
    return peak


def adjacent_last_stage_pairs(schedule: Schedule) -> frozenset[Action]:
    """The last stage's F actions whose own B comes right after them on the device.

    Such a pair needs no stored activations: the engine runs it as one forward+backward
    program (the loss gradient is known), e.g. GPipe's last micro-batch, or every
    micro-batch of the last stage in 1F1B.
    """
    last = schedule.num_stages - 1
    row = schedule.actions[last]
    pairs = itertools.pairwise(row)
    return frozenset(a for a, b in pairs if a.op is Op.F and b == Action(last, Op.B, a.microbatch))


def bubble_formula(num_stages: int, num_microbatches: int) -> float:
    """The GPipe bubble fraction (S-1)/(M+S-1), for documentation and planners."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def from_mapping(rows: Mapping[int, str], num_microbatches: int) -> Schedule:
    """Builds a schedule from ``{stage: "F0 F1 B0 B1"}`` (handy for hand-made schedules)."""
    actions = tuple(
        tuple(Action.parse(tok, s) for tok in rows[s].split()) for s in range(len(rows))
    )
    return Schedule(len(actions), num_microbatches, actions)
