"""The step over the mesh's own devices: every replica's schedule lowered into one program,
then the reductions across the mesh (``Pipeline``'s executor without a strategy).

    for each replica r:  lower the schedule onto replica r's stage copies (F/B/W actions)
    the loss of the global batch from every replica's terms
    each stage's gradients all-reduced inside its replica group, tied ones summed

``StrategyPipeline`` runs the same lowering for one replica under a ``tf.distribute``
strategy instead (``strategy_pipeline.py``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf

from hybrid.core.mesh import DeviceMesh
from hybrid.engine.api import batches
from hybrid.engine.api.micro_batching import Steps
from hybrid.engine.model.objective import Objective
from hybrid.engine.model.variables import sum_tied
from hybrid.engine.step import clocks as timing
from hybrid.engine.step import lowering, reduction
from hybrid.engine.step.collectives import ReplicaGroup
from hybrid.engine.step.compression import Codec
from hybrid.engine.step.stage import StageReplica

__all__ = ["MeshStep", "StepResult"]

Shards = list[batches.Shard]


class StepResult(NamedTuple):
    """What a pipelined training step computes before any update.

    Attributes:
      loss: the step's loss as Keras reports it (regularization included).
      output_losses: each output's own loss, before its ``loss_weights``.
      grads: ``grads[k][r]``: model stage k's gradients on replica r's device.
      events: replica 0's timing events (when recorded).
      stats: ``stats[k][r]``: stage k's BatchNormalization statistics (empty without).
      predictions: the batch's model outputs, per output (None unless returned).
    """

    loss: tf.Tensor
    output_losses: tf.Tensor
    grads: list[list[list[tf.Tensor]]]
    events: list[Any]
    stats: list[Any]
    predictions: list[tf.Tensor] | None


@dataclasses.dataclass(frozen=True)
class MeshStep:
    """What the step over the mesh reads: ``stages[k][r]`` and their replica groups, the
    tied variables, the objective, the schedules of the current M, how boundaries are
    coded, remat and deferral, the random seeds per replica and replica 0's clocks."""

    stages: list[list[StageReplica]]
    groups: list[ReplicaGroup]
    ties: Any
    objective: Objective
    steps: Steps
    mesh: DeviceMesh
    codec: Codec | None
    remat: str
    defer: bool
    seeds: Callable[[int], Callable[[int], tf.Tensor]]
    clocks: list[timing.DeviceClock]
    devices: tuple[list[str], list[str]]  # each replica's first- and last-stage device

    def gradients(self, parts: Shards, record: bool) -> StepResult:
        """Runs the schedule on every replica, then reduces over the mesh: the loss of the
        global batch, each stage's gradients of it on each replica's device (a tied
        variable's: the sum over its stages), BatchNormalization statistics summed over the
        global batch, timing events when ``record``, the predictions when returned."""
        config, schedule, stages = self.steps.config, self.steps.schedule, self.stages
        loss_fn = self.objective
        R, M = self.mesh.num_replicas, config.micro_batches
        firsts, lasts = self.devices
        xs = batches.micro_inputs(config, parts, firsts)
        labels = batches.micro_labels(config, parts, lasts)
        divisors = reduction.loss_divisors(loss_fn, stages[-1], labels)
        loss_scale = reduction.loss_scale(stages[-1][0])  # LossScaleOptimizer
        seed = loss_fn.seed(divisors) * (1.0 if loss_scale is None else loss_scale)
        lower = functools.partial(lowering.lower_training, codec=self.codec, defer=self.defer)
        remat = lowering.remat_policy(self.remat, M)
        steps = [
            lower(
                schedule,
                self.steps.order,
                self.steps.fused,
                [row[r] for row in stages],
                xs[r],
                labels[r],
                self.seeds(r),
                remat,
                seed,
                clocks=self.clocks if record and r == 0 else None,
            )
            for r in range(R)
        ]
        loss, divisors, output_losses = reduction.global_loss(
            loss_fn, [t for s in steps for t in s.losses], divisors
        )
        rows = [schedule.device_of(k) for k in range(len(stages))]
        starts = timing.reduce_starts(self.clocks, steps[0].tails) if record else []
        grads, stats, penalty = reduction.all_stages(
            steps, stages, self.groups, rows, loss_fn.late_scale(divisors), loss_scale
        )
        if penalty is not None:  # the regularization Keras adds to the loss, once per step
            loss = loss + penalty
        for r in range(R):
            sum_tied([g[r] for g in grads], [row[r].device for row in stages], self.ties)
        predictions = batches.joined([s.predictions[m] for s in steps for m in range(M)])
        events: list[Any] = list(steps[0].events)
        if record:  # replica 0's devices: from their last action to their reduced gradients
            events += timing.reduce_events(self.clocks, starts, rows, [g[0] for g in grads])
        return StepResult(loss, output_losses, grads, events, stats, predictions)

    def forward(self, parts: Shards) -> Any:
        """The forward-only schedule on every replica (``lower_replicas_inference``)."""
        config = self.steps.config
        firsts, lasts = self.devices
        labelled = parts[0].ys is not None
        labels = batches.micro_labels(config, parts, lasts) if labelled else None
        copies = [[row[r] for row in self.stages] for r in range(self.mesh.num_replicas)]
        xs = batches.micro_inputs(config, parts, firsts)
        inference, order = self.steps.inference, self.steps.inference_order
        return lowering.lower_replicas_inference(inference, order, copies, xs, labels, self.seeds)
