"""The pipeline's step as one program every replica runs, under a ``tf.distribute``
strategy (``Pipeline(model, mesh, strategy=...)``): on a Cloud TPU, one XLA program per step
spanning the S cores of each replica's pipeline.

The same engine as over a mesh (``mesh_step.py``: its stages, schedule, lowering and
reductions); what changes is who runs the replicas. ``Pipeline`` writes every
replica's ops into one program and all-reduces between devices it names. Here the step is
written once, for one replica, and ``strategy.run`` runs it on each::

    on every replica r, with its shard (x_r, y_r) of the global batch:
        divisors = Keras's divisors of the global batch
                   (this shard's denominators, all-reduced: one sum, on the last stage)
        lower_training(schedule, stages, micro-batches of x_r, y_r)    # F/B/W actions
            stage s's ops on logical device s (``/device:TPU_REPLICATED_CORE:s``)
            on a TPU each action's inputs wait by data (an XLA optimization barrier) for
            its core's previous action: XLA keeps the schedule's order
        for each stage s, on its device, after its last action:
            one all-reduce of [dW_s, BN statistics_s (+ loss terms, activity: last stage)]
        weight penalties, loss scaling, global_clipnorm, tied sums (``reduction``)
        every stage applies its gradients with its copy of the optimizer
    the loss, per-output losses and predictions come back per replica (the metrics update
    on the host, from replica 0's loss and every replica's predictions)

Each stage's variables and optimizer state are created once under the strategy's scope on
their logical device (``assembly.LogicalDevices``): the strategy keeps one copy per replica
(on a TPU, on core s of every replica's pipeline), so memory is split by stage as on a mesh.
The all-reduce is the replica context's (``collectives`` method ``"cross_replica"``): a
``CrossReplicaSum`` on the stage's core on a TPU, ``MirroredStrategy``'s on CPUs or GPUs.
Evaluation and prediction run the forward-only schedule the same way and reduce on the host.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import numpy as np
import tensorflow as tf

from hybrid.core.config import Layout
from hybrid.core.mesh import DeviceMesh
from hybrid.engine import keras_private
from hybrid.engine.api import batches
from hybrid.engine.api.mesh_step import Apply, MeshStep, Placed, Placing, Shards, TrainOutputs
from hybrid.engine.model.variables import sum_tied
from hybrid.engine.step import assembly, lowering, reduction
from hybrid.engine.step.collectives import ReplicaGroup
from hybrid.engine.step.stage import StageReplica

__all__ = ["StrategyExecutor", "logical_devices"]


def _is_tpu(strategy: Any) -> bool:
    return isinstance(strategy, (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy))


def logical_devices(strategy: Any, stages: int) -> assembly.LogicalDevices:
    """Where pipeline row d lives in ``strategy``'s replicated program.

    A ``TPUStrategy`` whose device assignment gives each replica ``stages`` cores: row d is
    logical core d (``/device:TPU_REPLICATED_CORE:d``), its variables made under
    ``extended.experimental_logical_device(d)``. Any other strategy (``MirroredStrategy``)
    has one device per replica: every row runs on it (the program's default device).

    Raises:
      ValueError: a TPU device assignment with another number of cores per replica.
    """
    if not _is_tpu(strategy):
        return assembly.LogicalDevices(("",) * stages, lambda d: contextlib.nullcontext())
    cores = _cores_per_replica(strategy)
    if cores != stages:
        raise ValueError(
            f"the TPUStrategy's device assignment has {cores} core(s) per replica and the "
            f"pipeline {stages} stages; build it from the pipeline's layout: "
            "tpu_strategy(resolver, layout(topology, stages=S, replicas=R))"
        )
    names = tuple(f"/device:TPU_REPLICATED_CORE:{d}" for d in range(stages))
    return assembly.LogicalDevices(names, strategy.extended.experimental_logical_device)


def _cores_per_replica(strategy: Any) -> int:
    """The cores of one replica in a TPUStrategy (TensorFlow keeps the device assignment it
    was given only in a private attribute)."""
    assignment = getattr(strategy.extended, "_device_assignment", None)
    return 1 if assignment is None else int(assignment.num_cores_per_replica)


def _component(variable: Any, replica: int) -> np.ndarray:
    """The value of a (Keras) variable's copy on ``replica`` of the strategy."""
    held = getattr(variable, "value", variable)
    copies = getattr(held, "values", None)
    return np.asarray((copies[replica] if copies else held).numpy())


_TIMED = (
    "timed steps need the devices' clocks, which a replicated program does not read; "
    "time a Pipeline on a mesh"
)


class StrategyExecutor:
    """Runs the pipeline's steps as one program per replica under ``strategy``.

    Args:
      strategy: a ``TPUStrategy`` built on the layout's device assignment (S cores per
        replica), or a ``MirroredStrategy`` over R devices (every stage of a replica on its
        device: the same program with the CPU/GPU all-reduce).
      mesh: the S × R devices of the strategy (a TPU layout's ``mesh``); R must be its
        ``num_replicas_in_sync``.
      layout: the pipeline's layout, checked against what a replicated step can run.

    Raises:
      ValueError: micro_batches="auto" or deferred weight gradients (refused with the
        reason), or a strategy whose replicas or cores do not match the mesh.
    """

    cannot = {
        "timed_train_step": _TIMED,
        "timeline_every": _TIMED,
        "gradients": "a replicated step applies its gradients inside the program and does "
        "not return them; compute gradients with a Pipeline on a mesh",
    }

    def __init__(self, strategy: Any, mesh: DeviceMesh, layout: Layout) -> None:
        if layout.micro_batches == "auto":
            raise ValueError(
                "micro_batches='auto' times the gradient step at each M, which a replicated "
                "step does not run on its own; give an integer "
                "(hybrid.planning.choose_mesh(..., stages=S) predicts the fastest)"
            )
        if layout.defer_weight_gradients:
            raise ValueError(
                "defer_weight_gradients=True needs stage programs of their own (a Pipeline "
                "on a mesh); a replicated step compiles whole, stages inline; leave it False"
            )
        if layout.shard_optimizer_states:
            raise ValueError(
                "shard_optimizer_states=True: under a strategy every replica's optimizer is "
                "one mirrored copy, which cannot be split between replicas yet; leave it "
                "False, or run the Pipeline on a mesh (no strategy) to shard them"
            )
        if strategy.num_replicas_in_sync != mesh.num_replicas:
            raise ValueError(
                f"the strategy runs {strategy.num_replicas_in_sync} replica(s) and the mesh "
                f"has {mesh.num_replicas}; give the strategy one replica per mesh column"
            )
        self.strategy = strategy
        self._logical = logical_devices(strategy, mesh.num_stages)
        # XLA compiles a TPU step whole and schedules by data: each action's inputs also
        # wait, through an optimization barrier, for its core's previous action. Elsewhere
        # TensorFlow's executor keeps the control dependencies (and the barrier, an XLA op,
        # may have no kernel outside XLA: TensorFlow 2.20's TPU build on CPUs).
        self._by_data = _is_tpu(strategy)

    def step_variable(self, mesh: DeviceMesh) -> tf.Variable:
        """The step counter, one per replica under the strategy (replica 0's is read)."""
        with self.strategy.scope(), self._logical.scope(0):
            aggregation = tf.VariableAggregation.ONLY_FIRST_REPLICA
            return tf.Variable(
                0, dtype=tf.int64, trainable=False, name="step", aggregation=aggregation
            )

    def place(self, layout: assembly.Layout, placing: Placing) -> Placed:
        """One copy per stage on its logical device, replicated by the strategy; each
        stage's group is the replica context's all-reduce on that device."""
        schedule = placing.schedule
        rows = [schedule.device_of(k) for k in range(schedule.num_model_stages)]
        groups = [ReplicaGroup([self._logical.names[d]], "cross_replica") for d in rows]
        with self.strategy.scope():
            stages = assembly.place(
                layout,
                schedule,
                placing.mesh,
                placing.optimizers,
                placing.objective,
                placing.jit_compile,
                self._logical,
                batch=placing.batch,
            )
        for row in stages:
            if row[0].optimizer is not None:  # the step hands it reduced gradients
                keras_private.keep_gradients_local(row[0].optimizer)
        return stages, groups

    def input_devices(
        self, stages: list[list[StageReplica]], mesh: DeviceMesh
    ) -> tuple[list[str], list[str]]:
        """The feed keeps each shard on the host: the strategy sends it to its replica."""
        host = [
            tf.DeviceSpec.from_string(mesh.device(0, 0))
            .replace(device_type="CPU", device_index=0)
            .to_string()
        ] * mesh.num_replicas
        return host, host

    def replica_weights(self, stages: list[list[StageReplica]], replica: int) -> list[list[Any]]:
        """Replica ``replica``'s weights, per stage: the strategy's component of each
        variable on that replica."""
        return [[_component(v, replica) for v in row[0].variables] for row in stages]

    def _distributed(self, parts: Shards) -> Any:
        """The shards as the strategy's per-replica value (replica r's is ``parts[r]``)."""
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: parts[context.replica_id_in_sync_group]
        )

    # -- the step every replica runs ---------------------------------------------------

    def train(
        self, step: MeshStep, parts: Shards, record: bool, apply: Apply, ordered: bool = False
    ) -> TrainOutputs:
        """Every replica's training step (see the module docstring); the loss of replica 0
        (every replica holds the global one) and every replica's predictions. (``ordered``
        does not apply: the strategy runs its replicas.)"""
        replica_step = functools.partial(self._replica_train, step, apply)
        loss, output_losses, predictions = self.strategy.run(
            replica_step, args=(self._distributed(parts),)
        )
        local = self.strategy.experimental_local_results
        joined = batches.joined([list(p) for p in local(predictions)])
        return TrainOutputs(local(loss)[0], local(output_losses)[0], joined, [])

    def _replica_train(
        self, step: MeshStep, apply: Apply, shard: batches.Shard
    ) -> tuple[Any, Any, list[tf.Tensor]]:
        """One replica's training step: the global batch's loss, each output's loss, and
        this replica's predictions (for metrics). Ops outside a stage's scope (the step
        counter, seeds) go on the first stage's device; the loss is reduced on the last
        stage's."""
        with tf.device(step.stages[0][0].device):
            return self._replica_train_on(step, apply, shard)

    def _replica_train_on(
        self, step: MeshStep, apply: Apply, shard: batches.Shard
    ) -> tuple[Any, Any, list[tf.Tensor]]:
        context = tf.distribute.get_replica_context()
        config, schedule, objective = step.steps.config, step.steps.schedule, step.objective
        stages = [row[0] for row in step.stages]
        K, M = len(stages), config.micro_batches
        rows = [schedule.device_of(k) for k in range(K)]
        xs = batches.micro_inputs(config, [shard], [stages[0].device])[0]
        labels = batches.micro_labels(config, [shard], [stages[-1].device])[0]
        last = step.groups[-1]
        divisors = reduction.loss_divisors(
            objective, stages[-1:], [labels], lambda t: last.all_reduce_sum([[t]])[0][0]
        )
        loss_scale = reduction.loss_scale(stages[-1])
        seed = objective.seed(divisors) * (1.0 if loss_scale is None else loss_scale)
        lowered = lowering.lower_training(
            schedule,
            step.steps.order,
            step.steps.fused,
            stages,
            xs,
            labels,
            step.seeds(context.replica_id_in_sync_group),
            lowering.remat_policy(step.remat, M),
            seed,
            codec=step.codec,
            order_by_data=self._by_data,
        )
        summed, stats, extra = [], [], []
        for k, stage in enumerate(stages):  # one all-reduce per stage, after its last action
            with tf.device(stage.device):
                bn = [tf.add_n(lowered.stats[k])] if lowered.stats[k] else []
                tail = [tf.add_n(lowered.losses)] if k == K - 1 else []
                tail += [tf.add_n(lowered.activity)] if k == K - 1 and lowered.activity else []
                with tf.control_dependencies(lowered.tails[rows[k]]):
                    out = step.groups[k].all_reduce_sum([lowered.grads[k] + bn + tail])[0]
            n = len(lowered.grads[k])
            summed.append(out[:n])
            stats.append(out[n : n + len(bn)])
            extra = out[n + len(bn) :]
        with tf.device(stages[-1].device):
            loss, divisors, output_losses = reduction.global_loss(objective, extra[:1], divisors)
            scale = objective.late_scale(divisors)
        grads, penalties = [], []
        for stage, stage_grads in zip(stages, summed, strict=True):
            [one], penalty = reduction.stage_gradients([stage], [stage_grads], scale, loss_scale)
            grads.append([one])
            penalties += [penalty] if penalty is not None else []
        with tf.device(stages[-1].device):
            penalties += [extra[1] * stages[0].activity_scale] if len(extra) > 1 else []
            loss = loss + tf.add_n(penalties) if penalties else loss
        # As on a mesh: tied gradients summed first, then the pipeline's update (global
        # finite check and clipping over every stage, the updates, the step counter).
        sum_tied([g[0] for g in grads], [s.device for s in stages], step.ties)
        apply(grads, [[found] if found else [] for found in stats], False)
        with tf.device(stages[-1].device):
            predictions = batches.joined([lowered.predictions[m] for m in range(M)]) or []
        return loss, output_losses, predictions

    # -- evaluation and prediction: the forward-only schedule, reduced on the host -----

    def forward(self, step: MeshStep, parts: Shards, ordered: bool = False) -> Any:
        """The forward-only schedule on every replica; every replica's outputs in order.
        (``ordered`` is never asked of a strategy's step: ``compile_cache.ordered``.)"""
        replica_forward = functools.partial(self._replica_forward, step)
        outs, activity = self.strategy.run(replica_forward, args=(self._distributed(parts),))
        local = self.strategy.experimental_local_results
        return [o for r in local(outs) for o in r], [a for r in local(activity) for a in r]

    def _replica_forward(self, step: MeshStep, shard: batches.Shard) -> Any:
        with tf.device(step.stages[0][0].device):
            context = tf.distribute.get_replica_context()
            config = step.steps.config
            stages = [row[0] for row in step.stages]
            xs = batches.micro_inputs(config, [shard], [stages[0].device])[0]
            labels = None
            if shard.ys is not None:
                labels = batches.micro_labels(config, [shard], [stages[-1].device])[0]
            seed = step.seeds(context.replica_id_in_sync_group)
            inference, order = step.steps.inference, step.steps.inference_order
            return lowering.lower_inference(inference, order, stages, xs, labels, seed)
