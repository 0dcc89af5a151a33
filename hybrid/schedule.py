"""Pipeline schedules as plain data: generators, a validator and a simulator.

A schedule says, for every pipeline device, the order in which it runs its actions. An
action is one op of one model stage on one micro-batch:

    F  forward
    B  backward: input and weight gradients, or only the input gradient when the schedule
       also has W actions
    W  weight gradient (zero-bubble schedules split the backward into B and W)

    "0: F0 F1 B1 B0 | 1: F0 F1 B1 B0"               GPipe, 2 devices, 2 micro-batches

With ``v`` virtual stages per device (interleaved schedules) the model is cut into S·v
stages and device d holds stages d, d + S, d + 2S, …; actions then print with their stage,
``"0F1"`` (stage 0, forward, micro-batch 1).

Nothing here knows about TensorFlow. The engine (``pipeline.py``) interprets a schedule by
issuing each device's actions in order, in the global order returned by
:func:`execution_order`; :func:`validate` proves the schedule can run and :func:`simulate`
predicts its makespan, bubble and memory from per-action costs.
"""

from __future__ import annotations

import dataclasses
import enum
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
    "interleaved",
    "names",
    "one_f_one_b",
    "simulate",
    "validate",
    "zero_bubble_h1",
]


class ScheduleError(ValueError):
    """A schedule that cannot run; the message shows the grid with the bad cell marked."""


class Op(str, enum.Enum):
    """What an action computes: ``F`` forward, ``B`` backward, ``W`` weight gradient."""

    F = "F"
    B = "B"
    W = "W"

    def __str__(self) -> str:
        return self.value


_ACTION_RE = re.compile(r"^(\d+)?([FBW])(\d+)$")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One unit of work: ``op`` of model stage ``stage`` on micro-batch ``microbatch``."""

    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}"

    def long(self) -> str:
        """The form that names the stage too: ``"3B1"``."""
        return f"{self.stage}{self.op}{self.microbatch}"

    @classmethod
    def parse(cls, text: str, stage: int) -> Action:
        """Parses ``"F0"`` (an action of ``stage``) or ``"3B1"`` (an action of stage 3)."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}; expected an op F, B or W followed by a "
                "micro-batch number, e.g. 'F0' or 'B3', optionally after a stage: '2F0'"
            )
        own = stage if match.group(1) is None else int(match.group(1))
        return cls(stage=own, op=Op(match.group(2)), microbatch=int(match.group(3)))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Ordered actions per pipeline device: ``actions[d]`` runs on device ``d``.

    Attributes:
      num_stages: S, the devices along the pipeline axis.
      num_microbatches: M, the micro-batches each step is split into.
      actions: for each device, the actions it runs, in order.
      name: the generator that produced it, for messages.
      virtual_stages: v, model stages per device; model stage k lives on device k % S.
    """

    num_stages: int
    num_microbatches: int
    actions: tuple[tuple[Action, ...], ...]
    name: str = "custom"
    virtual_stages: int = 1

    @property
    def num_model_stages(self) -> int:
        """S·v: how many pieces the model is cut into."""
        return self.num_stages * self.virtual_stages

    @property
    def splits_backward(self) -> bool:
        """True when backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.op is Op.W for row in self.actions for a in row)

    def device_of(self, stage: int) -> int:
        return stage % self.num_stages

    def _cell(self, action: Action) -> str:
        return action.long() if self.virtual_stages > 1 else str(action)

    def __str__(self) -> str:
        return " | ".join(
            f"{d}: " + " ".join(self._cell(a) for a in row) for d, row in enumerate(self.actions)
        )

    @classmethod
    def parse(
        cls, text: str, num_microbatches: int | None = None, virtual_stages: int = 1
    ) -> Schedule:
        """Parses the string form ``"0: F0 F1 B1 B0 | 1: F0 B0 F1 B1"``."""
        rows = [row.strip() for row in text.split("|")]
        actions = []
        for d, row in enumerate(rows):
            head, sep, body = row.partition(":")
            if not sep or head.strip() != str(d):
                raise ValueError(f"row {d} of {text!r} must start with '{d}:'")
            actions.append(tuple(Action.parse(tok, d) for tok in body.split()))
        if num_microbatches is None:
            num_microbatches = 1 + max((a.microbatch for row in actions for a in row), default=-1)
        return cls(len(actions), num_microbatches, tuple(actions), virtual_stages=virtual_stages)

    def grid(self, mark: Iterable[tuple[int, int]] = ()) -> str:
        """Renders the schedule as a steps × devices text grid.

        Args:
          mark: (device, position) cells to highlight as ``>F0<``.
        """
        marked = set(mark)
        length = max((len(row) for row in self.actions), default=0)
        width = 7 if self.virtual_stages > 1 else 6
        lines = ["step  " + " ".join(f"{'d' + str(d):>{width}}" for d in range(self.num_stages))]
        for i in range(length):
            cells = []
            for d, row in enumerate(self.actions):
                text = self._cell(row[i]) if i < len(row) else "."
                cells.append(f"{'>' + text + '<' if (d, i) in marked else text:>{width}}")
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

    makespan (M + S - 1)(F + B), bubble fraction (S - 1) / (M + S - 1), and every stage
    holds all M micro-batches' activations at its peak. The backward starts with the last
    micro-batch, whose activations the last stage has just made: that is the micro-batch
    remat="except_last" does not recompute.
    """
    _check_sizes(num_stages, num_microbatches)
    M = num_microbatches
    rows = tuple(
        tuple(Action(s, Op.F, m) for m in range(M))
        + tuple(Action(s, Op.B, m) for m in reversed(range(M)))
        for s in range(num_stages)
    )
    return Schedule(num_stages, M, rows, name="gpipe")


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm up with S - s - 1 forwards, then alternate F and B.

    S = 3, M = 4, uniform costs::

        s0: F0 F1 F2 .  .  .  B0 F3 .  B1 .  B2 .  B3
        s1: .  F0 F1 .  .  B0 F2 .  B1 F3 .  B2 B3 .
        s2: .  .  F0 B0 .  F1 B1 .  F2 B2 F3 B3 .  .      (shape, not exact times)

    Same bubble as GPipe, (S - 1) / (M + S - 1), but stage s never holds more than S - s
    micro-batches' activations (GPipe: M).
    """
    _check_sizes(num_stages, num_microbatches)
    M = num_microbatches
    rows = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, M)
        row = [Action(s, Op.F, m) for m in range(warmup)]
        for i in range(M - warmup):
            row += [Action(s, Op.F, warmup + i), Action(s, Op.B, i)]
        row += [Action(s, Op.B, m) for m in range(M - warmup, M)]
        rows.append(tuple(row))
    return Schedule(num_stages, M, tuple(rows), name="1f1b")


def interleaved(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: each device holds v model stages (d, d + S, …).

    Forward work unit k on every device runs micro-batch ``(k // (S·v))·S + k % S`` of its
    chunk ``(k // S) % v`` (backward: chunks in reverse). Device d warms up with
    ``2(S - d - 1) + (v - 1)S`` forwards, then alternates one forward and one backward.
    Bubble ≈ (S - 1) / (v·M + S - 1) with uniform costs per model stage.

    Raises:
      ValueError: M is not a multiple of S (the micro-batch groups of S would not fill).
    """
    _check_sizes(num_stages, num_microbatches)
    S, M, v = num_stages, num_microbatches, virtual_stages
    if v < 1:
        raise ValueError(f"virtual_stages must be at least 1, got {v}")
    if M % S:
        raise ValueError(
            f"the interleaved schedule needs micro_batches to be a multiple of the pipeline "
            f"stages: M={M}, S={S}; use M={-(-M // S) * S} or another schedule"
        )
    total = M * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // S) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (k // (S * v)) * S + k % S

    rows = []
    for d in range(S):
        warmup = min(2 * (S - d - 1) + (v - 1) * S, total)

        def fwd(k: int, d: int = d) -> Action:
            chunk, m = unit(k, backward=False)
            return Action(chunk * S + d, Op.F, m)

        def bwd(k: int, d: int = d) -> Action:
            chunk, m = unit(k, backward=True)
            return Action(chunk * S + d, Op.B, m)

        row = [fwd(k) for k in range(warmup)]
        for i in range(total - warmup):
            row += [fwd(warmup + i), bwd(i)]
        row += [bwd(k) for k in range(total - warmup, total)]
        rows.append(tuple(row))
    return Schedule(S, M, tuple(rows), name="interleaved", virtual_stages=v)


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into B and a deferred W.

    B computes only the input gradient, so the backward wave reaches stage 0 sooner; W (the
    weight gradient) waits and fills the time a device would otherwise idle. Built by list
    scheduling with unit costs (F = B = W): whenever a device is free it runs, in order of
    preference, a ready B, a ready F, or its oldest pending W. Stage s never has more than
    S - s micro-batches between their F and their W, so it holds no more activations than
    1F1B; the bubble is smaller whenever W costs anything.
    """
    _check_sizes(num_stages, num_microbatches)
    S, M = num_stages, num_microbatches
    finish: dict[Action, int] = {}
    free = [0] * S
    next_f = [0] * S
    next_b = [0] * S  # B runs in micro-batch order on each stage
    pending_w: list[list[int]] = [[] for _ in range(S)]
    rows: list[list[Action]] = [[] for _ in range(S)]

    def ready_at(action: Action) -> int | None:
        deps = _dependencies(action, S)
        if not all(dep in finish for dep in deps):
            return None
        return max((finish[dep] for dep in deps), default=0)

    def candidates(s: int) -> list[tuple[int, int, Action]]:
        """(ready time, preference, action) for each action stage s could run next."""
        out = []
        if next_b[s] < M:
            b = Action(s, Op.B, next_b[s])
            t = ready_at(b)
            if t is not None:
                out.append((t, 0, b))
        in_flight = next_f[s] - (len(rows[s]) - next_f[s] - next_b[s])  # F done, W not done
        if next_f[s] < M and in_flight < S - s:
            f = Action(s, Op.F, next_f[s])
            t = ready_at(f)
            if t is not None:
                out.append((t, 1, f))
        if pending_w[s]:
            out.append((0, 2, Action(s, Op.W, pending_w[s][0])))
        return out

    total = 3 * S * M
    while sum(len(r) for r in rows) < total:
        best = None
        for s in range(S):
            for t, pref, action in candidates(s):
                start = max(t, free[s])
                key = (start, pref, s)
                if best is None or key < best[0]:
                    best = (key, action)
        assert best is not None, "zero_bubble_h1 stalled"  # unreachable: B0 is always ready
        (start, _, s), action = best
        finish[action] = start + 1
        free[s] = start + 1
        rows[s].append(action)
        if action.op is Op.F:
            next_f[s] += 1
        elif action.op is Op.B:
            next_b[s] += 1
            pending_w[s].append(action.microbatch)
        else:
            pending_w[s].pop(0)
    return Schedule(S, M, tuple(tuple(r) for r in rows), name="zb-h1")


def forward_only(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Every model stage runs F0 … F(M-1), device by device: the inference pipeline."""
    _check_sizes(num_stages, num_microbatches)
    S, M, v = num_stages, num_microbatches, virtual_stages
    rows = tuple(
        tuple(Action(c * S + d, Op.F, m) for c in range(v) for m in range(M)) for d in range(S)
    )
    return Schedule(S, M, rows, name="forward", virtual_stages=v)


_GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zero_bubble_h1,
}
_VIRTUAL = {"interleaved"}


def names() -> list[str]:
    """The registered training schedule names, sorted."""
    return sorted(_GENERATORS)


def get(name: str, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Builds the registered schedule ``name`` for S devices and M micro-batches.

    Raises:
      ValueError: an unknown name, or virtual stages for a schedule that has none.
    """
    if name not in _GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {names()}")
    if name in _VIRTUAL:
        return _GENERATORS[name](num_stages, num_microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per device; virtual_stages={virtual_stages} "
            f"needs one of {sorted(_VIRTUAL)}"
        )
    return _GENERATORS[name](num_stages, num_microbatches)


# ---------------------------------------------------------------------------
# Dependencies, validation and the global issue order
# ---------------------------------------------------------------------------


def _dependencies(action: Action, num_model_stages: int) -> tuple[Action, ...]:
    """The actions whose results ``action`` consumes.

    F(k, m) reads the activation of F(k-1, m); B(k, m) reads its own forward F(k, m) and the
    input gradient of B(k+1, m); W(k, m) reads what B(k, m) computed.
    """
    k, m = action.stage, action.microbatch
    if action.op is Op.F:
        return (Action(k - 1, Op.F, m),) if k > 0 else ()
    if action.op is Op.W:
        return (Action(k, Op.B, m),)
    deps = [Action(k, Op.F, m)]
    if k + 1 < num_model_stages:
        deps.append(Action(k + 1, Op.B, m))
    return tuple(deps)


def _check_contents(schedule: Schedule, ops: Sequence[Op]) -> None:
    """Every (stage, op, micro-batch) appears exactly once, on its own stage's device."""
    S, M, K = schedule.num_stages, schedule.num_microbatches, schedule.num_model_stages
    if len(schedule.actions) != S:
        raise ScheduleError(
            f"schedule has {len(schedule.actions)} device rows but num_stages={S}\n"
            + schedule.grid()
        )
    seen: set[Action] = set()
    for d, row in enumerate(schedule.actions):
        for i, a in enumerate(row):
            problem = None
            if not 0 <= a.stage < K:
                problem = f"stage {a.stage} is out of range [0, {K})"
            elif schedule.device_of(a.stage) != d:
                problem = f"action {a.long()} of stage {a.stage} is on device {d}"
            elif not 0 <= a.microbatch < M:
                problem = f"micro-batch {a.microbatch} is out of range [0, {M})"
            elif a.op not in ops:
                problem = f"op {a.op} is not allowed here; expected only {[str(o) for o in ops]}"
            elif a in seen:
                problem = f"{a} of stage {a.stage} appears twice"
            if problem:
                raise ScheduleError(f"{problem}:\n" + schedule.grid(mark=[(d, i)]))
            seen.add(a)
    for k in range(K):
        for op in ops:
            for m in range(M):
                if Action(k, op, m) not in seen:
                    raise ScheduleError(
                        f"stage {k} never runs {op}{m}; every micro-batch must run "
                        f"{'/'.join(str(o) for o in ops)} on every stage:\n" + schedule.grid()
                    )


def _ops_of(schedule: Schedule) -> tuple[Op, ...]:
    present = {a.op for row in schedule.actions for a in row}
    return tuple(op for op in Op if op in present or op is Op.F)


def execution_order(schedule: Schedule) -> list[Action]:
    """A global order of all actions that respects each device's order and every data edge.

    The engine creates its ops in this order; each device runs its own actions in the order
    the schedule gives. Conceptually: repeatedly let every device run its next action if the
    actions it depends on have run; if no device can move, the schedule deadlocks.

    Raises:
      ScheduleError: the schedule deadlocks; the grid marks each device's blocked action.
    """
    _check_contents(schedule, _ops_of(schedule))
    K = schedule.num_model_stages
    done: set[Action] = set()
    cursor = [0] * schedule.num_stages
    order: list[Action] = []
    total = sum(len(row) for row in schedule.actions)
    while len(order) < total:
        progressed = False
        for d, row in enumerate(schedule.actions):
            while cursor[d] < len(row):
                action = row[cursor[d]]
                if not all(dep in done for dep in _dependencies(action, K)):
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
                f"device {d} waits at {schedule.actions[d][i].long()} for "
                + ", ".join(
                    dep.long()
                    for dep in _dependencies(schedule.actions[d][i], K)
                    if dep not in done
                )
                for d, i in blocked
            )
            raise ScheduleError(f"schedule deadlocks: {waits}\n" + schedule.grid(mark=blocked))
    return order


def validate(schedule: Schedule) -> Schedule:
    """Checks that ``schedule`` can train: returns it unchanged, or raises ScheduleError.

    Every micro-batch must run F then B (then W, if the schedule splits the backward) once on
    every stage, F in stage order and B in reverse; each device must be able to run its list
    in order without waiting on itself.
    """
    if not any(a.op is Op.B for row in schedule.actions for a in row):
        raise ScheduleError("a training schedule needs backward actions:\n" + schedule.grid())
    execution_order(schedule)
    return schedule


def pairs_to_fuse(schedule: Schedule) -> frozenset[Action]:
    """The last model stage's F actions whose whole backward follows them immediately.

    Such a pair needs no stored activations: the engine runs it as one forward+backward
    program (the loss gradient is known), e.g. GPipe's last micro-batch, or every
    micro-batch of the last stage in 1F1B. With a split backward the whole run F B W must
    be adjacent.
    """
    last = schedule.num_model_stages - 1
    row = schedule.actions[schedule.device_of(last)]
    tail = (Op.B, Op.W) if schedule.splits_backward else (Op.B,)
    fused = []
    for i, a in enumerate(row):
        following = row[i + 1 : i + 1 + len(tail)]
        if (
            a.stage == last
            and a.op is Op.F
            and following == tuple(Action(last, op, a.microbatch) for op in tail)
        ):
            fused.append(a)
    return frozenset(fused)


# ---------------------------------------------------------------------------
# Simulation
# ---------------------------------------------------------------------------

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
        for dep in _dependencies(action, K):
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


def from_mapping(
    rows: Mapping[int, str], num_microbatches: int, virtual_stages: int = 1
) -> Schedule:
    """Builds a schedule from ``{device: "F0 F1 B0 B1"}`` (handy for hand-made schedules)."""
    actions = tuple(
        tuple(Action.parse(tok, d) for tok in rows[d].split()) for d in range(len(rows))
    )
    return Schedule(len(actions), num_microbatches, actions, virtual_stages=virtual_stages)


def render(schedule: Schedule, path: str, costs: Costs | None = None, title: str = "") -> str:
    """Draws the simulated timeline of ``schedule`` as a PNG Gantt chart at ``path``."""
    from hybrid.timeline import plot_timelines  # matplotlib is only needed to draw

    result = simulate(schedule, costs)
    return plot_timelines(
        [(title or f"{schedule.name} simulated", schedule, result.timeline)], path
    )
