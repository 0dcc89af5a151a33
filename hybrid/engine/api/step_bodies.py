"""The bodies of a :class:`~hybrid.engine.api.pipeline.Pipeline`'s traced steps, each a
function of the pipeline (``micro_batching.steps_for`` traces them, one per kind and M):

    train      the step over the mesh (``mesh_step.py``) or a strategy, then every device's
               update (:func:`apply`) and the metrics on the global batch
    gradients  the batch's loss and replica 0's gradients, in the model's variable order
    evaluate   the forwards, the loss as Keras reduces it (penalties added) and the metrics
    predict    the forwards' outputs, the padding cut off
    train_many, evaluate_many
               ``train``, ``evaluate`` on each of several batches, in one function
               (``executions.py``: ``compile(steps_per_execution=N)``)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from hybrid.engine.api import batches, executions
from hybrid.engine.api.batches import Flat, Shards
from hybrid.engine.api.mesh_step import MeshStep
from hybrid.engine.model.sparse import flat_tensors
from hybrid.engine.step import lowering, reduction, sharding, update

__all__ = [
    "apply",
    "evaluate",
    "evaluate_many",
    "gradients",
    "mesh_step",
    "predict",
    "train",
    "train_many",
]


def train(pipe: Any, parts: Shards, record: bool = False, ordered: bool = False) -> Any:
    """One training step on ``parts``: the timestamp pairs of its actions (kept in
    ``pipe._event_keys`` when ``record``) and the logs after it (``StepMetrics.tensors``)."""
    return _train(pipe, parts, record, ordered), pipe._metrics.tensors()


def _train(pipe: Any, parts: Shards, record: bool = False, ordered: bool = False) -> Any:
    """:func:`train` without reading the logs: the timestamp pairs of its actions."""
    updates = functools.partial(apply, pipe)
    step = pipe._executor.train(mesh_step(pipe), parts, record, updates, ordered)
    y, w = batches.whole_labels(parts)
    examples = batches.examples(parts)
    pipe._metrics.update(examples, step.loss, step.output_losses, y, step.predictions, w)
    if record:  # (device, action) of each timestamp pair: the same in every trace
        pipe._event_keys = [(device, action) for device, action, _, _ in step.events]
    return [[start, end] for _, _, start, end in step.events]


def train_many(pipe: Any, many: list[Shards]) -> Any:
    """:func:`train` on each of ``many`` batches in turn (``executions.run_steps``); the
    logs after the last (read once, not after every step)."""
    executions.run_steps(functools.partial(_train, pipe), many)
    return pipe._metrics.tensors()


def apply(pipe: Any, grads: list[list[list[Any]]], stats: list[Any], ordered: bool) -> None:
    """Every device's update (``update.apply_all``), its gradients clipped by the global
    norm when the optimizer asks; then the step counter moves."""
    reduction.whole_model(grads, pipe._stages, pipe._optimizers)
    R, M = pipe.config.replicas, pipe.micro_batches
    update.apply_all(pipe._stages, grads, stats, R * M, ordered)
    for row in pipe._stages:  # sharded optimizer states: owners send their updates
        sharding.broadcast(row)
    done = [g for row in grads for per in row for g in flat_tensors(per)]
    with tf.control_dependencies(done):
        pipe._step.assign_add(1)


def gradients(pipe: Any, parts: Shards, ordered: bool = False) -> tuple[Any, list[Any]]:
    """The batch's loss and replica 0's gradients, in ``model.trainable_variables``' order."""
    step = mesh_step(pipe).gradients(parts, record=False, ordered=ordered)
    return step.loss, [step.grads[k][0][j] for k, j in pipe.placement.gradient_order()]


def _seeds(pipe: Any) -> Callable[[int], Callable[[int], tf.Tensor]]:
    """Replica -> (micro-batch -> its random layers' seed) at the current step."""
    return lambda replica: lowering.seeds(pipe._step.read_value(), replica, pipe.micro_batches)


def mesh_step(pipe: Any) -> MeshStep:
    """The step over the mesh's devices as the pipeline stands (``mesh_step.py``)."""
    return MeshStep(
        stages=pipe._stages,
        groups=pipe._groups,
        ties=pipe._ties,
        objective=pipe._loss,
        steps=pipe._steps,
        mesh=pipe.mesh,
        codec=pipe._codec,
        remat=pipe.remat,
        defer=pipe._defer,
        seeds=_seeds(pipe),
        clocks=pipe._clocks,
        devices=pipe._shard_devices(),
    )


def evaluate(pipe: Any, parts: Shards, ordered: bool = False) -> Any:
    """The forwards on ``parts`` and the metrics of their loss as Keras reduces it; the
    logs after them."""
    _evaluate(pipe, parts, ordered)
    return pipe._metrics.tensors()


def _evaluate(pipe: Any, parts: Shards, ordered: bool = False) -> None:
    """:func:`evaluate` without reading the logs."""
    outs, activity = pipe._executor.forward(mesh_step(pipe), parts, ordered)
    loss, _, output_losses = reduction.global_loss(pipe._loss, [o[0] for o in outs], None)
    penalties = [p[0] for p in (row[0].weight_penalty() for row in pipe._stages) if p]
    loss = loss + tf.add_n(penalties + activity) if penalties + activity else loss
    predictions = batches.joined([out[1:] for out in outs])
    y, w = batches.whole_labels(parts)
    pipe._metrics.update(batches.examples(parts), loss, output_losses, y, predictions, w)


def evaluate_many(pipe: Any, many: list[Shards]) -> Any:
    """:func:`evaluate` on each of ``many`` batches in turn (``executions.run_steps``); the
    logs after the last (read once, not after every step)."""
    executions.run_steps(functools.partial(_evaluate, pipe), many)
    return pipe._metrics.tensors()


def predict(pipe: Any, parts: Shards, ordered: bool = False) -> Flat:
    """The model's outputs on ``parts``, without the padding's rows."""
    outs, _ = pipe._executor.forward(mesh_step(pipe), parts, ordered)
    return [t[: batches.examples(parts)] for t in batches.joined(outs) or []]
