"""What each model stage and each scheduled action costs: a stage's summed layer costs at
one micro-batch size, the seconds of every F, B and W of a schedule under a remat mode, and
the bytes it holds (for :mod:`hybrid.core.memory`).

Conventions: times in seconds, sizes in bytes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from hybrid.core import memory
from hybrid.core import schedule as schedule_lib
from hybrid.planning.costs import CostProfile
from hybrid.planning.hardware import Hardware

__all__ = [
    "ActionCosts",
    "StageCost",
    "action_costs",
    "deferred_schedule",
    "fused_pairs",
]


@functools.lru_cache(maxsize=512)
def fused_pairs(sched: schedule_lib.Schedule) -> frozenset[schedule_lib.Action]:
    """The F actions of ``sched`` that run with their whole backward as one program
    (:func:`hybrid.core.schedule.pairs_to_fuse`), cached per schedule."""
    return schedule_lib.pairs_to_fuse(sched)


class StageCost:
    """Summed costs of one model stage's layers at one micro-batch size."""

    def __init__(
        self, profile: CostProfile, first: int, count: int, batch: float, scale: float
    ) -> None:
        ids = range(first, first + count)

        def total(name: str) -> float:
            return sum(profile.value(i, name, batch) for i in ids)

        self.forward = scale * total("forward")
        self.backward = scale * total("backward")
        self.recompute = scale * total("recompute_backward")
        self.input_backward = scale * total("input_backward")
        # The first layer's input gradient is B's job in a split backward; model stage 0
        # never computes it (nothing upstream needs it).
        self.first_dx = scale * profile.value(first, "input_backward", batch)
        self.stored = total("stored_bytes")
        working = [profile.value(i, "working_bytes", batch) for i in ids]
        stored = [profile.value(i, "stored_bytes", batch) for i in ids]
        self.working = max(working)
        self.recompute_working = memory.recompute_working(stored, working)
        self.output = profile.value(first + count - 1, "output_bytes", batch)
        self.params = sum(profile.layers[i].param_bytes for i in ids)
        self.tensors = sum(profile.layers[i].param_tensors for i in ids)
        # One update program per stage: its launch once, its weights' own share per layer.
        layers_update = sum(profile.layers[i].update for i in ids)
        self.update = scale * (layers_update + (profile.update_call if self.params else 0.0))
        if first == 0:
            self.input = profile.input_bytes * batch
            self.needs_dx = False
        else:
            self.input = profile.value(first - 1, "output_bytes", batch)
            self.needs_dx = True


@dataclasses.dataclass(frozen=True)
class ActionCosts(schedule_lib.Costs):
    """:class:`hybrid.core.schedule.Costs` with a time for every single action: a fused pair or
    ``except_last`` makes one micro-batch's backward cost differ from the others'."""

    table: Mapping[schedule_lib.Action, float] = dataclasses.field(default_factory=dict)

    def of(self, action: schedule_lib.Action, split: bool) -> float:
        return self.table[action]


def action_costs(
    sched: schedule_lib.Schedule,
    stages: Sequence[StageCost],
    remat: str,
    hardware: Hardware,
    whole: Sequence[StageCost] | None = None,
) -> dict[schedule_lib.Action, float]:
    """Seconds of every action of ``sched``.

    F costs ``action_overhead`` + the stage's forward. B recomputes the forward first when
    remat says so; the last stage's B that directly follows its F runs in one program with
    it (no second launch, no recomputation). With a split backward B is the input gradient
    (nothing on model stage 0, which needs none) and W the rest of the backward from
    stored activations (with remat, W recomputes the forward and every layer's input
    gradient but the first's). The action that makes the weight gradients pays
    ``tensor_overhead`` per weight array it accumulates.

    With deferred weight gradients (``whole``: the stages' costs at all M micro-batches'
    rows; ``sched`` a :func:`deferred_schedule`), every B is the input gradient only and
    each stage's last W runs the rest of the backward once, at ``whole``'s rows; nothing
    is fused.
    """
    if whole is not None:
        return _deferred_costs(sched, stages, whole, hardware)
    M = sched.num_microbatches
    split = sched.splits_backward
    fused = fused_pairs(sched)
    launch = hardware.action_overhead
    Op = schedule_lib.Op

    def recomputes(m: int) -> bool:
        return remat == "always" or (remat == "except_last" and m != M - 1)

    def cost(action: schedule_lib.Action) -> float:
        k, m = action.stage, action.microbatch
        st = stages[k]
        skip_dx = 0.0 if st.needs_dx else st.first_dx  # model stage 0: no input gradient
        accumulate = hardware.tensor_overhead * st.tensors
        if action.op is Op.F:
            return launch + st.forward
        if schedule_lib.Action(k, Op.F, m) in fused:  # B (and W) inside F's program
            return st.recompute - skip_dx + accumulate if action.op is Op.B else 0.0
        if not split:
            if recomputes(m):
                return launch + st.forward + st.recompute - skip_dx + accumulate
            return launch + st.backward - skip_dx + accumulate
        if action.op is Op.B:
            if not st.needs_dx:
                return 0.0
            if recomputes(m):
                return launch + st.forward + st.input_backward
            return launch + st.input_backward
        if recomputes(m):
            return launch + st.forward + st.recompute - st.first_dx + accumulate
        # W from stored activations: the rest of the backward B left (model stage 0: all
        # of it but its first layer's input gradient, which nothing needs).
        done = st.input_backward if st.needs_dx else st.first_dx
        return launch + max(0.0, st.backward - done) + accumulate

    return {a: cost(a) for row in sched.actions for a in row}


@functools.lru_cache(maxsize=256)
def deferred_schedule(sched: schedule_lib.Schedule) -> schedule_lib.Schedule:
    """``sched`` as it runs with deferred weight gradients: a schedule without W actions
    gets every micro-batch's W of a model stage right after the stage's last B (the engine
    runs the stage's weight gradients there, once the input gradients have been sent on;
    the last of these W costs it all); a split one keeps its W actions, of which each
    stage's last runs the weight gradients."""
    if sched.splits_backward:
        return sched
    Op, M = schedule_lib.Op, sched.num_microbatches
    closing = _last(sched, Op.B)

    def then(a: schedule_lib.Action) -> tuple[schedule_lib.Action, ...]:
        if closing.get(a.stage) != a:
            return (a,)
        return (a, *(schedule_lib.Action(a.stage, Op.W, m) for m in range(M)))

    rows = tuple(tuple(b for a in row for b in then(a)) for row in sched.actions)
    return dataclasses.replace(sched, actions=rows)


def _last(sched: schedule_lib.Schedule, op: schedule_lib.Op) -> dict[int, schedule_lib.Action]:
    """Each model stage's last ``op`` action (its device runs its row in order)."""
    return {a.stage: a for row in sched.actions for a in row if a.op is op}


def _deferred_costs(
    sched: schedule_lib.Schedule,
    stages: Sequence[StageCost],
    whole: Sequence[StageCost],
    hardware: Hardware,
) -> dict[schedule_lib.Action, float]:
    """:func:`action_costs` with deferred weight gradients, on a
    :func:`deferred_schedule`: each B the input gradients, each stage's last W the rest of
    its backward at all micro-batches' rows, the other W nothing."""
    Op, launch = schedule_lib.Op, hardware.action_overhead
    closing = _last(sched, Op.W)

    def cost(action: schedule_lib.Action) -> float:
        st, full = stages[action.stage], whole[action.stage]
        if action.op is Op.F:
            return launch + st.forward
        if action.op is Op.B:
            return launch + st.input_backward if st.needs_dx else 0.0
        if closing[action.stage] != action:
            return 0.0
        done = full.input_backward if full.needs_dx else full.first_dx
        return launch + max(0.0, full.backward - done) + hardware.tensor_overhead * st.tensors

    return {a: cost(a) for row in sched.actions for a in row}
