"""Lowering: turn a schedule (data) into the TensorFlow ops of one replica's step.

Conceptually, for one replica::

    for action in execution_order(schedule):          # a global order, data edges respected
        on device_of(action.stage), after that device's previous action:
            F(k, m): out[k, m] = stage_k(out[k-1, m])                 (the last stage: loss)
            B(k, m): dx[k, m], dW = backward of stage k at out[k-1, m] against dx[k+1, m]
            W(k, m): dW = the weight half of that backward (split schedules only)
            acc[k] += dW
        deferring weight gradients: B is the input-gradient half only, and stage k's last
        B or W also runs W once over all its micro-batches (``deferral.py``)

Every action is created inside ``tf.control_dependencies`` on the previous action of its
device, so each device runs one action at a time in schedule order; cross-device edges are
ordinary data edges. The Python loop runs once, while tracing; nothing runs per micro-batch
in Python at step time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla

from hybrid.core.schedule import Action, Op, Schedule
from hybrid.engine.model.sparse import flat_tensors
from hybrid.engine.programs import deferred_backward
from hybrid.engine.step import synced_norm
from hybrid.engine.step.clocks import DeviceClock, Recorder
from hybrid.engine.step.compression import Codec
from hybrid.engine.step.stage import Labels, Saved, StageReplica

__all__ = [
    "ReplicaStep",
    "action_scope",
    "lower_inference",
    "lower_replicas_inference",
    "lower_training",
    "remat_policy",
    "seeds",
]


def remat_policy(mode: str, micro_batches: int) -> Callable[[int], bool]:
    """micro-batch -> whether its forward keeps no activations, for a ``remat`` mode."""
    if mode == "always":
        return lambda microbatch: True
    if mode == "except_last":
        return lambda microbatch: microbatch != micro_batches - 1
    return lambda microbatch: False


def seeds(
    step: tf.Tensor, replica: int | tf.Tensor, micro_batches: int
) -> Callable[[int], tf.Tensor]:
    """micro-batch -> the (step, unit) seed of its random layers on ``replica`` (one tensor
    per micro-batch, shared by its forward and any recomputation). ``replica`` is a tensor
    in a program every replica runs (the replica context's id)."""
    units: dict[int, tf.Tensor] = {}

    def seed(microbatch: int) -> tf.Tensor:
        if microbatch not in units:
            if isinstance(replica, int):
                unit = tf.constant(replica * micro_batches + microbatch, tf.int64)
            else:
                unit = tf.cast(replica, tf.int64) * micro_batches + microbatch
            units[microbatch] = tf.stack([step, unit])
        return units[microbatch]

    return seed


@dataclasses.dataclass
class ReplicaStep:
    """The tensors one replica's lowered step produces.

    Attributes:
      losses: each micro-batch's loss [numerator, denominator], in completion order.
      grads: ``grads[k]``: model stage k's gradients summed over micro-batches (a sparse
        one: every micro-batch's IndexedSlices, concatenated in micro-batch order).
      tails: ``tails[d]``: the last outputs of device d's chain (the all-reduce waits on them).
      stats: ``stats[k]``: model stage k's BatchNormalization statistics, one per forward.
      activity: every forward's activity-regularization penalty (unweighted).
      events: (device, action, start, end) timestamps when recording, else empty.
      predictions: ``predictions[m]``: micro-batch m's model outputs (when the last stage
        returns them, for metrics), else empty.
      finished: each issued action's last outputs (what waits for it waits on them).
    """

    losses: list[tf.Tensor]
    grads: list[list[tf.Tensor]]
    tails: list[list[tf.Tensor]]
    events: list[tuple[int, Action, tf.Tensor, tf.Tensor]]
    stats: list[list[tf.Tensor]]
    activity: list[tf.Tensor]
    predictions: dict[int, list[tf.Tensor]]
    finished: dict[Action, list[tf.Tensor]] = dataclasses.field(default_factory=dict)


Outputs = tuple[list[tf.Tensor], list[tf.Tensor]]  # (what the action computed, the chain tail)


class _TrainingLowering:
    """One replica's lowering state: what each action leaves for the actions after it.

    Attributes:
      grads: ``grads[k]``: model stage k's gradients summed so far.
      tails: ``tails[d]``: the newest outputs of device d (its next action waits on them).
      outputs: F results waiting for stage k + 1, by (k, m).
      saved: what a forward kept for its backward, by (k, m).
      upstream: the gradient flowing into stage k, by (k, m).
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Sequence[StageReplica],
        loss_seed: tf.Tensor,
        codec: Codec | None = None,
        defer: bool = False,
    ) -> None:
        self.schedule, self.stages, self.codec = schedule, stages, codec
        self.defer = defer and schedule.num_microbatches > 1
        self.split = schedule.splits_backward or self.defer  # B without W
        # The last stage outputs [numerator, denominator] of each output's loss; the
        # backward starts from d loss / d terms (``Objective.seed``).
        # The model's outputs after the terms (for metrics) get no gradient.
        returned = len(stages[-1].segment.outputs) if stages[-1].predicts else 0
        self.loss_scale: list[tf.Tensor | None] = [loss_seed] + [None] * returned
        self.predictions: dict[int, list[tf.Tensor]] = {}
        self.grads: list[list[tf.Tensor]] = [[] for _ in range(schedule.num_model_stages)]
        self.tails: list[list[tf.Tensor]] = [[] for _ in range(schedule.num_stages)]
        self.losses: list[tf.Tensor] = []
        self.stats: list[list[tf.Tensor]] = [[] for _ in range(schedule.num_model_stages)]
        self.activity: list[tf.Tensor] = []
        self.outputs: dict[tuple[int, int], list[Any]] = {}
        self.saved: dict[tuple[int, int], Saved] = {}
        self.upstream: dict[tuple[int, int], list[Any]] = {}

    def send(self, tensors: list[Any]) -> tuple[list[Any], list[tf.Tensor]]:
        """What crosses a stage boundary, encoded on the sender's device (``codec``), and
        the tensors that cross."""
        if self.codec is None:
            return tensors, [t for t in tensors if t is not None]
        wires = self.codec.encode(tensors)
        return wires, self.codec.tensors(wires)

    def receive(self, sent: list[Any]) -> list[Any]:
        """What crossed a boundary, decoded on the receiver's device."""
        return sent if self.codec is None else self.codec.decode(sent)

    def accumulate(self, k: int, dw: list[tf.Tensor]) -> None:
        """Stage k's gradients so far: ``dw`` already holds the earlier micro-batches' sum
        (the backward adds it, inside its program when it is one)."""
        if dw:
            self.grads[k] = dw

    def output_gradient(self, k: int, m: int, keep: bool) -> list[tf.Tensor | None]:
        """The gradients arriving at stage k's outputs for micro-batch m."""
        if self.stages[k].is_last:
            return self.loss_scale
        return self.receive(self.upstream[(k, m)] if keep else self.upstream.pop((k, m)))

    def pass_down(self, k: int, m: int, dx: list[tf.Tensor | None] | None) -> list[tf.Tensor]:
        if dx is None:
            return []
        self.upstream[(k - 1, m)], sent = self.send(dx)
        return sent

    @staticmethod
    def needs_dx(k: int) -> bool:
        """Whether model stage k's backward computes its input gradients: all but the
        first's (stage 0's inputs are the batch)."""
        return k > 0

    def fused(self, k: int, m: int, x: list[tf.Tensor], labels: Labels, seed: tf.Tensor) -> Outputs:
        out, dx, dw, activity, stats = self.stages[k].forward_backward(
            x, labels, seed, self.loss_scale, self.needs_dx(k), self.grads[k]
        )
        self.stats[k] += stats
        self.activity += activity
        loss = out[0]
        self.losses.append(loss)
        self.predictions[m] = out[1:]
        self.accumulate(k, dw)
        sent = self.pass_down(k, m, dx)
        return [loss] + sent + flat_tensors(dw), [loss] + sent + flat_tensors(self.grads[k])

    def forward(
        self,
        k: int,
        m: int,
        x: list[tf.Tensor],
        labels: Labels | None,
        seed: tf.Tensor,
        remat: bool,
    ) -> Outputs:
        record = self.stages[k].forward(x, labels, seed, remat, self.split, self.needs_dx(k))
        self.saved[(k, m)] = record
        self.stats[k] += record.stats
        self.activity += record.activity
        if self.stages[k].is_last:
            self.losses.append(record.output[0])
            self.predictions[m] = record.output[1:]
            return list(record.output), list(record.output)
        self.outputs[(k, m)], sent = self.send(record.output)
        return sent, sent

    def backward(self, k: int, m: int, dy: list[tf.Tensor | None]) -> Outputs:
        keep = self.saved[(k, m)] if self.split else self.saved.pop((k, m))
        dx, dw = self.stages[k].backward(
            keep, dy, need_dx=self.needs_dx(k), need_dw=not self.split, acc=self.grads[k]
        )
        self.accumulate(k, dw)
        sent = self.pass_down(k, m, dx)
        if not self.split:
            self.upstream.pop((k, m), None)
        if not (sent or dw):  # stage 0's B in a split schedule computes nothing
            tail = self.tails[self.schedule.device_of(k)]
            return tail, tail
        return sent + flat_tensors(dw), sent + flat_tensors(self.grads[k])

    def weight(self, k: int, m: int, dy: list[tf.Tensor | None]) -> Outputs:
        if self.defer:  # W runs once, after the stage's last backward action (deferred)
            tail = self.tails[self.schedule.device_of(k)]
            return tail, tail
        saved = self.saved.pop((k, m))
        _, dw = self.stages[k].backward(saved, dy, need_dx=False, need_dw=True, acc=self.grads[k])
        self.accumulate(k, dw)
        return flat_tensors(dw), flat_tensors(self.grads[k])

    def deferred(self, k: int, outputs: Outputs) -> Outputs:
        """Stage k's weight gradients of every micro-batch at once (``deferral``), after
        the action that computed ``outputs``."""
        M = self.schedule.num_microbatches
        saved = [self.saved.pop((k, m)) for m in range(M)]
        dys = [self.output_gradient(k, m, keep=False) for m in range(M)]
        dw = deferred_backward(self.stages[k], saved, dys, self.grads[k])
        self.accumulate(k, dw)
        return outputs[0] + flat_tensors(dw), outputs[1] + flat_tensors(self.grads[k])


def lower_training(
    schedule: Schedule,
    order: Sequence[Action],
    fused: frozenset[Action],
    stages: Sequence[StageReplica],
    xs: Sequence[list[tf.Tensor]],
    ys: Sequence[Labels],
    seed: Callable[[int], tf.Tensor],
    remat: Callable[[int], bool],
    loss_seed: tf.Tensor,
    clocks: Sequence[DeviceClock] | None = None,
    codec: Codec | None = None,
    order_by_data: bool = False,
    defer: bool = False,
    after: Mapping[Action, list[tf.Tensor]] | None = None,
) -> ReplicaStep:
    """Issues one replica's training actions in ``order``.

    Args:
      schedule: the validated schedule; ``order`` is its execution order.
      fused: last-stage F actions whose backward directly follows: run as one program.
      stages: this replica's copy of every model stage, indexed by model stage.
      xs, ys: this replica's micro-batches of inputs (each the list of model inputs) and of
        (labels, sample weights).
      seed: micro-batch -> the (step, unit) seed its random layers use.
      remat: micro-batch -> whether its forward keeps no activations.
      loss_seed: the gradient of the step's loss with respect to the last stage's output
        (``Objective.seed``).
      clocks: one per pipeline device: record start and end of every action.
      codec: compresses what crosses each stage boundary (``compression.py``), or None.
      order_by_data: also make each action's inputs (its activations or output gradients)
        data-dependent on its device's previous action, through an XLA optimization
        barrier: for a step compiled as one XLA program (a TPU's), where the compiler
        schedules by data and may drop control dependencies.
      defer: compute each stage's weight gradients once per step, over all its
        micro-batches (``deferral.py``; ``fused`` is then ignored).
      after: each action also waits for these tensors (another replica's same action:
        ``ReplicaStep.finished``), so that its programs compile after that replica's.
    """
    state = _TrainingLowering(schedule, stages, loss_seed, codec, defer)
    recorder = Recorder(clocks, compiled=all(stage.jit_compile for stage in stages))
    fused = frozenset() if state.defer else fused
    closing = {a.stage: a for a in order if a.op is not Op.F} if state.defer else {}
    skipped = {Action(a.stage, op, a.microbatch) for a in fused for op in (Op.B, Op.W)}
    finished: dict[Action, list[tf.Tensor]] = {}
    for action in order:
        if action in skipped:
            continue  # already run together with its forward
        k, m, d = action.stage, action.microbatch, schedule.device_of(action.stage)
        labels = ys[m] if stages[k].is_last else None
        with tf.device(stages[k].device), tf.name_scope(action_scope(action)):
            # What the action waits for besides its device's previous action.
            if action.op is Op.F:
                x = list(xs[m]) if k == 0 else state.receive(state.outputs.pop((k - 1, m)))
                x = _after(x, state.tails[d]) if order_by_data else x
                inputs = list(x)
                # the micro-batch's seed, and the keys of a stage's all-reduced BN moments
                unit = synced_norm.keyed(stages[k].synced, seed(m), m, schedule.num_microbatches)
            else:
                dy = state.output_gradient(k, m, keep=action.op is Op.B or state.defer)
                dy = _after(dy, state.tails[d]) if order_by_data else dy
                inputs = [g for g in dy if g is not None] if action.op is Op.B else []
            start = recorder.start(d, state.tails[d] + inputs)
            waits = list((after or {}).get(action, []))
            with tf.control_dependencies(state.tails[d] + start + waits):
                if action in fused:
                    assert labels is not None  # only the last stage's forwards fuse
                    direct, done = state.fused(k, m, x, labels, unit)
                elif action.op is Op.F:
                    direct, done = state.forward(k, m, x, labels, unit, remat(m))
                elif action.op is Op.B:
                    direct, done = state.backward(k, m, dy)
                else:
                    direct, done = state.weight(k, m, dy)
                if closing.get(k) == action:
                    direct, done = state.deferred(k, (direct, done))
            state.tails[d] = list(done) + recorder.end(d, action, start, direct)
            finished[action] = state.tails[d]
    return ReplicaStep(
        state.losses,
        state.grads,
        state.tails,
        recorder.events,
        state.stats,
        state.activity,
        state.predictions,
        finished,
    )


def action_scope(action: Action) -> str:
    """The name scope of an action's ops (``F_s1_m0``: the forward of stage 1, micro-batch 0),
    which a traced program's op names start with."""
    return f"{action.op.name}_s{action.stage}_m{action.microbatch}"


def _after(values: list[Any], tails: list[tf.Tensor]) -> list[Any]:
    """``values`` (None entries kept) passed through one XLA optimization barrier together
    with ``tails``: they come out only once ``tails`` are computed, whatever order the
    compiler picks."""
    present = [i for i, v in enumerate(values) if v is not None]
    if not tails or not present:
        return values
    out = xla.optimization_barrier(*[values[i] for i in present], *tails)
    ordered = list(values)
    for i, t in zip(present, out, strict=False):
        ordered[i] = t
    return ordered


def lower_inference(
    schedule: Schedule,
    order: Sequence[Action],
    stages: Sequence[StageReplica],
    xs: Sequence[list[tf.Tensor]],
    ys: Sequence[Labels] | None,
    seed: Callable[[int], tf.Tensor],
) -> tuple[list[list[tf.Tensor]], list[tf.Tensor]]:
    """Issues a forward-only schedule; returns the last stage's outputs per micro-batch
    (``[[numerator, denominator]]`` of its loss when ``ys`` is given) and every forward's
    weighted activity-regularization penalty."""
    K = schedule.num_model_stages
    outputs: dict[tuple[int, int], list[tf.Tensor]] = {}
    activity: list[tf.Tensor] = []
    tails: list[list[tf.Tensor]] = [[] for _ in range(schedule.num_stages)]
    for action in order:
        k, m = action.stage, action.microbatch
        d = schedule.device_of(k)
        stage = stages[k]
        with tf.device(stage.device), tf.control_dependencies(tails[d]):
            inputs = list(xs[m]) if k == 0 else outputs.pop((k - 1, m))
            labels = ys[m] if (ys is not None and stage.is_last) else None
            outputs[(k, m)], penalty = stage.infer(inputs, labels, seed(m))
            activity += penalty
            tails[d] = list(outputs[(k, m)]) + penalty
    return [outputs[(K - 1, m)] for m in range(schedule.num_microbatches)], activity


def lower_replicas_inference(
    schedule: Schedule,
    order: Sequence[Action],
    stages: Sequence[Sequence[StageReplica]],
    xs: Sequence[Sequence[list[tf.Tensor]]],
    ys: Sequence[Sequence[Labels]] | None,
    seed: Callable[[int], Callable[[int], tf.Tensor]],
    ordered: bool = False,
) -> tuple[list[list[tf.Tensor]], list[tf.Tensor]]:
    """:func:`lower_inference` on every replica r (``stages[r]``, ``xs[r]``, ``ys[r]``,
    ``seed(r)``): the last stage's outputs per micro-batch, replica-major, and every
    forward's weighted activity penalty. ``ordered``: each replica's forwards after all of
    replica r − 1's, so that their programs compile once and the later replicas load them
    from a persistent XLA cache (``hybrid.engine.compile_cache``)."""
    outputs: list[list[tf.Tensor]] = []
    activity: list[tf.Tensor] = []
    previous: list[tf.Tensor] = []
    for r, replica in enumerate(stages):
        with tf.control_dependencies(previous):
            out, penalty = lower_inference(
                schedule, order, replica, xs[r], ys[r] if ys is not None else None, seed(r)
            )
        outputs, activity = outputs + out, activity + penalty
        if ordered:
            previous = [t for o in out for t in o] + penalty
    return outputs, activity
