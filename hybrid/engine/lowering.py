"""Lowering: turn a schedule (data) into the TensorFlow ops of one replica's step.

Conceptually, for one replica::

    for action in execution_order(schedule):          # a global order, data edges respected
        on device_of(action.stage), after that device's previous action:
            F(k, m): out[k, m] = stage_k(out[k-1, m])                 (the last stage: loss)
            B(k, m): dx[k, m], dW = backward of stage k at out[k-1, m] against dx[k+1, m]
            W(k, m): dW = the weight half of that backward (split schedules only)
            acc[k] += dW

Every action is created inside ``tf.control_dependencies`` on the previous action of its
device, so each device runs one action at a time in schedule order; cross-device edges are
ordinary data edges. The Python loop runs once, while tracing; nothing runs per micro-batch
in Python at step time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import tensorflow as tf

from hybrid.core.schedule import Action, Op, Schedule
from hybrid.engine.stage import Saved, StageReplica
from hybrid.engine.timing import DeviceClock, Recorder

__all__ = ["ReplicaStep", "lower_inference", "lower_training"]


@dataclasses.dataclass
class ReplicaStep:
    """The tensors one replica's lowered step produces.

    Attributes:
      losses: each micro-batch's mean loss, in completion order.
      grads: ``grads[k]``: model stage k's gradients summed over micro-batches.
      tails: ``tails[d]``: the last outputs of device d's chain (the all-reduce waits on them).
      events: (device, action, start, end) timestamps when recording, else empty.
    """

    losses: list[tf.Tensor]
    grads: list[list[tf.Tensor]]
    tails: list[list[tf.Tensor]]
    events: list[tuple[int, Action, tf.Tensor, tf.Tensor]]


def lower_training(
    schedule: Schedule,
    order: Sequence[Action],
    fused: frozenset[Action],
    stages: Sequence[StageReplica],
    xs: Sequence[tf.Tensor],
    ys: Sequence[tf.Tensor],
    seed: Callable[[int], tf.Tensor],
    remat: Callable[[int], bool],
    clocks: Sequence[DeviceClock] | None = None,
) -> ReplicaStep:
    """Issues one replica's training actions in ``order``.

    Args:
      schedule: the validated schedule; ``order`` is its execution order.
      fused: last-stage F actions whose backward directly follows: run as one program.
      stages: this replica's copy of every model stage, indexed by model stage.
      xs, ys: this replica's micro-batches of inputs and labels.
      seed: micro-batch -> the (step, unit) seed its random layers use.
      remat: micro-batch -> whether its forward keeps no activations.
      clocks: one per pipeline device: record start and end of every action.
    """
    K, M = schedule.num_model_stages, schedule.num_microbatches
    split = schedule.splits_backward
    loss_scale = tf.constant(1.0 / M)  # d(mean over micro-batches) / d(loss of one)
    grads: list[list[tf.Tensor]] = [[] for _ in range(K)]
    tails: list[list[tf.Tensor]] = [[] for _ in range(schedule.num_stages)]
    losses: list[tf.Tensor] = []
    outputs: dict[tuple[int, int], tf.Tensor] = {}  # F results consumed by stage k+1
    saved: dict[tuple[int, int], Saved] = {}
    upstream: dict[tuple[int, int], tf.Tensor] = {}  # gradient flowing into stage k
    recorder = Recorder(clocks)
    skipped = {Action(a.stage, op, a.microbatch) for a in fused for op in (Op.B, Op.W)}

    def accumulate(k: int, dw: list[tf.Tensor]) -> None:
        if dw:
            grads[k] = dw if not grads[k] else [a + g for a, g in zip(grads[k], dw, strict=True)]

    for action in order:
        if action in skipped:
            continue  # already run together with its forward
        k, m = action.stage, action.microbatch
        d = schedule.device_of(k)
        stage = stages[k]
        labels = ys[m] if stage.is_last else None
        with tf.device(stage.device):
            if action.op is Op.F:
                inputs = xs[m] if k == 0 else outputs.pop((k - 1, m))
                waits = tails[d] + [inputs]
            elif action.op is Op.B:
                dy = loss_scale if stage.is_last else upstream[(k, m)]
                waits = tails[d] + [dy]
            else:
                waits = tails[d]
            start = recorder.start(d, waits)
            with tf.control_dependencies(tails[d] + start):
                if action in fused:
                    loss, dx, dw = stage.forward_backward(
                        inputs, labels, seed(m), loss_scale, k > 0
                    )
                    losses.append(loss)
                    accumulate(k, dw)
                    if dx is not None:
                        upstream[(k - 1, m)] = dx
                    direct = [loss] + ([dx] if dx is not None else []) + dw
                    done = [loss] + ([dx] if dx is not None else []) + grads[k]
                elif action.op is Op.F:
                    record_ = stage.forward(inputs, labels, seed(m), remat(m), split)
                    saved[(k, m)] = record_
                    if stage.is_last:
                        losses.append(record_.output)
                    else:
                        outputs[(k, m)] = record_.output
                    direct = done = [record_.output]
                elif action.op is Op.B:
                    keep = saved[(k, m)] if split else saved.pop((k, m))
                    dx, dw = stage.backward(keep, dy, need_dx=k > 0, need_dw=not split)
                    accumulate(k, dw)
                    if dx is not None:
                        upstream[(k - 1, m)] = dx
                    if not split:
                        upstream.pop((k, m), None)
                    direct = ([dx] if dx is not None else []) + dw
                    done = ([dx] if dx is not None else []) + grads[k]
                    if not done:  # stage 0's B in a split schedule computes nothing
                        direct = done = tails[d]
                else:
                    dy = loss_scale if stage.is_last else upstream.pop((k, m))
                    _, dw = stage.backward(saved.pop((k, m)), dy, need_dx=False, need_dw=True)
                    accumulate(k, dw)
                    direct, done = dw, grads[k]
            recorder.end(d, action, start, direct)
            tails[d] = list(done)
    return ReplicaStep(losses, grads, tails, recorder.events)


def lower_inference(
    schedule: Schedule,
    order: Sequence[Action],
    stages: Sequence[StageReplica],
    xs: Sequence[tf.Tensor],
    ys: Sequence[tf.Tensor] | None,
    seed: Callable[[int], tf.Tensor],
) -> list[tf.Tensor]:
    """Issues a forward-only schedule; returns the last stage's output per micro-batch
    (its loss when ``ys`` is given)."""
    K = schedule.num_model_stages
    outputs: dict[tuple[int, int], tf.Tensor] = {}
    tails: list[list[tf.Tensor]] = [[] for _ in range(schedule.num_stages)]
    for action in order:
        k, m = action.stage, action.microbatch
        d = schedule.device_of(k)
        stage = stages[k]
        with tf.device(stage.device), tf.control_dependencies(tails[d]):
            inputs = xs[m] if k == 0 else outputs.pop((k - 1, m))
            labels = ys[m] if (ys is not None and stage.is_last) else None
            outputs[(k, m)] = stage.infer(inputs, labels, seed(m))
            tails[d] = [outputs[(k, m)]]
    return [outputs[(K - 1, m)] for m in range(schedule.num_microbatches)]
