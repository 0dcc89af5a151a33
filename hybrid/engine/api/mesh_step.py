"""The step over the mesh's own devices: every replica's schedule lowered into one program,
then the reductions across the mesh (``Pipeline``'s executor without a strategy).

    for each replica r:  lower the schedule onto replica r's stage copies (F/B/W actions)
    the loss of the global batch from every replica's terms
    each stage's gradients all-reduced inside its replica group, tied ones summed

``Pipeline(strategy=...)`` runs the same lowering for one replica under a ``tf.distribute``
strategy instead (``strategy_step.py``).
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
from hybrid.engine.devices import host_cpu
from hybrid.engine.model.objective import Objective
from hybrid.engine.model.variables import sum_tied
from hybrid.engine.step import assembly, lowering, reduction
from hybrid.engine.step import clocks as timing
from hybrid.engine.step.collectives import ReplicaGroup
from hybrid.engine.step.compression import Codec
from hybrid.engine.step.stage import StageReplica

__all__ = ["MeshExecutor", "MeshStep", "Placing", "StepResult", "TrainOutputs"]

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

    def gradients(self, parts: Shards, record: bool, ordered: bool = False) -> StepResult:
        """Runs the schedule on every replica, then reduces over the mesh: the loss of the
        global batch, each stage's gradients of it on each replica's device (a tied
        variable's: the sum over its stages), BatchNormalization statistics summed over the
        global batch, timing events when ``record``, the predictions when returned.
        ``ordered``: each replica's every action after replica r − 1's same action (a first
        step whose programs replicas r > 0 load from a persistent XLA cache)."""
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
        steps: list[lowering.ReplicaStep] = []
        for r in range(R):
            steps.append(
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
                    after=steps[-1].finished if ordered and steps else None,
                )
            )
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

    def forward(self, parts: Shards, ordered: bool = False) -> Any:
        """The forward-only schedule on every replica (``lower_replicas_inference``);
        ``ordered``: replica by replica (see :meth:`gradients`)."""
        config = self.steps.config
        firsts, lasts = self.devices
        labelled = parts[0].ys is not None
        labels = batches.micro_labels(config, parts, lasts) if labelled else None
        copies = [[row[r] for row in self.stages] for r in range(self.mesh.num_replicas)]
        xs = batches.micro_inputs(config, parts, firsts)
        inference, order = self.steps.inference, self.steps.inference_order
        return lowering.lower_replicas_inference(
            inference, order, copies, xs, labels, self.seeds, ordered
        )


class TrainOutputs(NamedTuple):
    """What a training step gives the metrics (and, timed, the timeline).

    Attributes:
      loss, output_losses: the step's loss and each output's, as Keras reports them.
      predictions: the batch's model outputs per output (None unless returned).
      events: replica 0's (device, action, start, end) timing events (when recorded).
    """

    loss: tf.Tensor
    output_losses: Any
    predictions: list[tf.Tensor] | None
    events: list[Any]


Apply = Callable[[list[list[list[tf.Tensor]]], list[Any], bool], None]
Placed = tuple[list[list[StageReplica]], list[ReplicaGroup]]


class Placing(NamedTuple):
    """What placing the stage copies takes besides the layout (``assembly.place``)."""

    schedule: Any
    mesh: DeviceMesh
    optimizers: Any
    objective: Objective
    jit_compile: bool
    defer: bool
    batch: int | None
    shard: bool = False


class MeshExecutor:
    """Runs the pipeline's steps over the mesh's own devices: every copy a device of the
    mesh, every replica's schedule in the one program, all-reduces between named devices.
    The executor without a strategy (``strategy_step.StrategyExecutor`` is the other)."""

    strategy = None
    cannot: dict[str, str] = {}  # everything is possible here

    def step_variable(self, mesh: DeviceMesh) -> tf.Variable:
        """The optimizer step counter, on the host of the first device (the step reads it
        for the random seeds, the caller's host resets and reads it between steps)."""
        with tf.device(host_cpu(mesh.device(0, 0))):
            return tf.Variable(0, dtype=tf.int64, trainable=False, name="step")

    def place(self, layout: assembly.Layout, placing: Placing) -> Placed:
        """Every stage's copies (``stages[k][r]``: ``assembly.place``) and each stage's
        replica group on the mesh."""
        schedule, mesh = placing.schedule, placing.mesh
        rows = [schedule.device_of(k) for k in range(schedule.num_model_stages)]
        groups = [ReplicaGroup(mesh.replica_group(d)) for d in rows]
        stages = assembly.place(
            layout,
            schedule,
            mesh,
            placing.optimizers,
            placing.objective,
            placing.jit_compile,
            defer=placing.defer,
            batch=placing.batch,
            shard=placing.shard,
        )
        return stages, groups

    def input_devices(
        self, stages: list[list[StageReplica]], mesh: DeviceMesh
    ) -> tuple[list[str], list[str]]:
        """Each replica's first-stage device (its inputs) and last-stage device (labels)."""
        return [s.device for s in stages[0]], [s.device for s in stages[-1]]

    def replica_weights(self, stages: list[list[StageReplica]], replica: int) -> list[list[Any]]:
        """Replica ``replica``'s weights, per stage."""
        return [row[replica].get_weights() for row in stages]

    def train(
        self, step: MeshStep, parts: Shards, record: bool, apply: Apply, ordered: bool = False
    ) -> TrainOutputs:
        """The training step: gradients over the mesh (:meth:`MeshStep.gradients`), then
        every device's update (``apply``); ``ordered``: replica by replica (see there)."""
        result = step.gradients(parts, record, ordered)
        apply(result.grads, result.stats, ordered)
        return TrainOutputs(result.loss, result.output_losses, result.predictions, result.events)

    def forward(self, step: MeshStep, parts: Shards, ordered: bool = False) -> Any:
        """The forward-only schedule on every replica; ``ordered``: replica by replica."""
        return step.forward(parts, ordered)
