"""From the user's model to the stages' layout: the cut, what crosses it, who holds what.

values  = the model traced once on a zero example (builds unbuilt layers)
check every layer call against what the pipeline can honour  (template.check_layer)
balance = explicit counts, or the cut balancing each call's parameters or measured time, or
          the one whose largest stage peak memory is smallest (core.memory)
segment k = calls [start_k, stop_k); its inputs are the tensors live at start_k
stage k holds every model variable its calls read (a tied variable: several stages)
sparse  = the variables whose gradient Keras hands its optimizer as IndexedSlices (sparse.py)
place: a StageReplica of stage k on device (device_of(k), r) for every replica r, or one on
       the logical device of row device_of(k) that a tf.distribute strategy replicates
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hybrid.core import memory, partition
from hybrid.core.mesh import DeviceMesh
from hybrid.core.schedule import Schedule
from hybrid.engine import keras_private
from hybrid.engine.devices import host_cpu
from hybrid.engine.model import batch_norm, layer_costs, sparse
from hybrid.engine.model.graph import Graph, Segment
from hybrid.engine.model.layer_checks import adds_loss, check_layer, warn_added_losses
from hybrid.engine.model.losses import per_element
from hybrid.engine.model.objective import Objective
from hybrid.engine.model.optimizers import OptimizerCopies
from hybrid.engine.model.variables import Placement
from hybrid.engine.step import mirrors, sharding
from hybrid.engine.step.stage import StageReplica, TensorSpec
from hybrid.engine.step.synced_norm import Member, NormGroup

__all__ = ["Layout", "LogicalDevices", "lay_out", "place", "spec_of"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The stages of one model on one schedule.

    Attributes:
      balance: layer calls per model stage.
      segments: each model stage's calls and the tensors crossing its cuts.
      input_specs: ``input_specs[k]``: shape and dtype of each of stage k's inputs.
      variables: ``variables[k]``: the model variables stage k reads, in model order.
      placement: where every model variable lives.
      output_shapes: each model output's shape without the batch dimension.
      masked: the keys of the tensors that carry a Keras mask (it crosses a cut with them).
      sparse: ids of the variables whose gradients are IndexedSlices (``sparse.py``).
      unused: ids of the trainable variables Keras would get no gradient for.
      bytes: each call's bytes estimated from shapes, activations per example
        (:func:`hybrid.engine.model.layer_costs.layer_bytes`).
    """

    balance: tuple[int, ...]
    segments: tuple[Segment, ...]
    input_specs: tuple[tuple[TensorSpec, ...], ...]
    variables: tuple[tuple[Any, ...], ...]
    placement: Placement
    output_shapes: tuple[tuple[int, ...], ...]
    masked: frozenset[int]
    sparse: frozenset[int] = frozenset()
    unused: frozenset[int] = frozenset()
    bytes: memory.LayerBytes | None = None


def spec_of(t: Any) -> TensorSpec:
    return TensorSpec(tuple(t.shape[1:]), t.dtype.name)


def lay_out(
    graph: Graph,
    input_specs: Sequence[TensorSpec],
    device: str,
    num_stages: int,
    balance: Sequence[int] | None,
    balance_mode: str,
    jit_compile: bool,
    memory_cut: Callable[[memory.LayerBytes], tuple[int, ...]] | None = None,
    timing_device: str | None = None,
) -> Layout:
    """Builds and checks the model on ``device`` and cuts it into ``num_stages`` segments.

    Args:
      graph: the model's layer calls.
      input_specs: the model inputs' shapes (without batch) and dtypes.
      device: where the user's model is built (the client's host: it is on no mesh device).
      num_stages: model stages (devices × virtual stages).
      balance: explicit calls per stage, or None to balance by ``balance_mode``.
      balance_mode: "compute", "params", "time" or "memory".
      memory_cut: for ``balance_mode="memory"``: the cut of the calls' bytes (per example).
      timing_device: where ``balance_mode="time"`` times each call (default ``device``).

    Raises:
      NotImplementedError: a layer whose Keras semantics the pipeline cannot honour.
    """
    with tf.device(device):
        zeros = [tf.convert_to_tensor(s.zeros()) for s in input_specs]
        graph.trace(zeros)  # builds the layers
    with tf.device(host_cpu(device)):
        slices, unused = sparse.gradient_kinds(graph, zeros, graph.variables())
    with tf.device(device):  # after the probe: the layers' losses of this call are kept
        values = graph.trace(zeros)
        arguments = []
        for call in graph.calls:
            args = [values[k] for k in call.inputs]
            arguments.append(args[0] if len(args) == 1 else args)
            check_layer(call.layer, arguments[-1], values[call.outputs[0]])
    layers = [call.layer for call in graph.calls]
    estimate = layer_costs.layer_bytes(graph.calls, values, graph.inputs)
    if balance is None and balance_mode == "memory":
        if memory_cut is None:
            raise ValueError('balance="memory" needs the run\'s memory use (memory_cut)')
        balance = memory_cut(estimate)
    if balance is None:
        if balance_mode == "time":
            timed_on = timing_device or device
            costs = layer_costs.time_costs(layers, arguments, timed_on, jit_compile=jit_compile)
        elif balance_mode == "params":
            costs = layer_costs.parameter_costs(layers)
        else:
            costs = layer_costs.compute_costs(graph.calls, values)
        balance = partition.balance_by_cost(costs, num_stages)
    segments = graph.segments(balance)
    variables = graph.variables()
    held = []
    for segment in segments:
        reads = {id(v) for layer in segment.layers for v in layer.weights}
        held.append(tuple(v for v in variables if id(v) in reads))
    return Layout(
        tuple(balance),
        tuple(segments),
        tuple(tuple(spec_of(values[k]) for k in s.inputs) for s in segments),
        tuple(held),
        Placement.of(variables, held),
        tuple(tuple(values[k].shape[1:]) for k in graph.outputs),
        _masked(graph, values),
        frozenset(slices),
        frozenset(unused),
        estimate,
    )


def _masked(graph: Graph, values: dict[int, Any]) -> frozenset[int]:
    """The tensors with a mask; refuses a BatchNormalization of a masked tensor."""
    masked = frozenset(k for k, v in values.items() if keras_private.output_mask(v) is not None)
    for call in graph.calls:
        if isinstance(call.layer, keras.layers.BatchNormalization) and call.inputs[0] in masked:
            raise NotImplementedError(
                f"layer {call.layer.name!r} (BatchNormalization) normalizes a masked tensor; "
                "its statistics over the masked positions are not combined across "
                "micro-batches yet: apply it before the masking layer or drop the mask"
            )
    return masked


def _refuse_per_element_with_penalties(loss: Objective, copies: Sequence[StageReplica]) -> None:
    """Keras cannot add a scalar penalty to a reduction-None loss's per-element values (it
    fails stacking them), so neither does the pipeline."""
    if not any(per_element(one) for one in loss.losses):
        return
    layers = [layer.name for copy in copies for layer in copy.regularized]
    layers += [v.path for copy in copies for v in copy.variables if getattr(v, "regularizer", None)]
    if layers:
        raise ValueError(
            f"the loss has reduction None and {layers} add regularization losses; Keras cannot "
            "add a scalar penalty to per-element loss values (it fails stacking them): use a "
            "reduction over the batch (e.g. 'sum') or drop the regularizers"
        )


@dataclasses.dataclass(frozen=True)
class LogicalDevices:
    """The devices of a program every replica runs (a ``tf.distribute`` strategy's ``run``).

    Attributes:
      names: ``names[d]``: the device string pipeline row d's ops are placed with inside the
        program (on a TPU ``/device:TPU_REPLICATED_CORE:d``, which the compiler maps to
        that core of each replica's pipeline).
      scope: ``scope(d)``: the context row d's variables are created in; the strategy makes
        one copy per replica (on a TPU, on core d of every replica).
    """

    names: tuple[str, ...]
    scope: Callable[[int], contextlib.AbstractContextManager[Any]]


def place(
    layout: Layout,
    schedule: Schedule,
    mesh: DeviceMesh,
    optimizers: OptimizerCopies,
    loss: Objective,
    jit_compile: bool,
    logical: LogicalDevices | None = None,
    defer: bool = False,
    batch: int | None = None,
    shard: bool = False,
) -> list[list[StageReplica]]:
    """``stages[k][r]``: model stage k's copy on replica r's device of its pipeline row; with
    ``logical``, ``stages[k] == [copy]``: one copy on row ``device_of(k)``'s logical device
    (its ops inline in the replicated program), which the strategy replicates.

    Warns when BatchNormalization or ``add_loss`` layers see part of the global batch (of
    ``batch`` examples, when known). With ``shard``, each replica's copy updates its share
    of the stage's variables (``sharding.py``). From then on, eager writes to the model's
    variables (the templates) reach every copy (``mirrors.mirror_model``).
    """
    K = schedule.num_model_stages
    stages = []
    for k in range(K):
        d = schedule.device_of(k)
        devices = [mesh.device(d, r) for r in range(mesh.num_replicas)]
        group = _synced_group(layout.segments[k], k, devices, logical, jit_compile)
        where = contextlib.nullcontext() if logical is None else logical.scope(d)
        updates = _shares(layout.variables[k], len(devices), k) if shard else None
        with where:
            row = [
                StageReplica(
                    k,
                    layout.segments[k],
                    device,
                    layout.input_specs[k],
                    optimizers,
                    loss if k == K - 1 else None,
                    jit_compile and group is None,
                    layout.variables[k],
                    layout.masked,
                    synced=None if group is None else Member(group, r),
                    inline=logical is not None,
                    sparse=layout.sparse,
                    unused=layout.unused,
                    updates=None if updates is None else updates[r],
                )
                for r, device in enumerate(devices if logical is None else [logical.names[d]])
            ]
        if group is None and logical is None:  # one trace of the stage's programs for all
            for copy in row:
                copy.share_programs(row[0])
        for copy in row:  # and of its updates (the optimizer's, the BN moving statistics')
            copy.share_update(row[0])
        for copy in row:
            copy.owned = layout.placement.owned(k)
            if copy.regularized and loss.late:
                raise NotImplementedError(
                    f"layers {[layer.name for layer in copy.regularized]} have activity "
                    "regularizers and the model's output a masked loss; the pipeline does not "
                    "combine the two yet: drop the activity regularizer or the mask"
                )
        stages.append(row)
    _refuse_per_element_with_penalties(loss, [row[0] for row in stages])
    for row in stages:
        for copy in row:
            copy.split_batch(mesh.num_replicas, schedule.num_microbatches, defer)
    warn_parts(stages, mesh.num_replicas, schedule.num_microbatches, batch)
    mirrors.mirror_model(stages, layout.placement)  # the user's model now writes through
    return stages


def _shares(variables: Sequence[Any], replicas: int, stage: int) -> list[frozenset[int]] | None:
    """Each replica's share of the stage's trainable variables (ids), or None with one
    replica (nothing to share)."""
    if replicas == 1:
        return None
    trainable = [v for v in variables if v.trainable]
    found = sharding.owners([int(np.prod(v.shape)) for v in trainable], replicas, stage)
    return [
        frozenset(id(v) for v, o in zip(trainable, found, strict=True) if o == r)
        for r in range(replicas)
    ]


def _synced_group(
    segment: Segment,
    k: int,
    devices: Sequence[str],
    logical: LogicalDevices | None,
    jit_compile: bool,
) -> NormGroup | None:
    """The group that all-reduces stage k's ``BatchNormalization(synchronized=True)``
    moments over its replicas (``synced_norm``): None with one replica or none of them, or
    in a program a ``tf.distribute`` strategy replicates (``logical``), where Keras's own
    synchronized moments all-reduce through the strategy's replica context."""
    calls = [layer for layer, _ in batch_norm.norms_of(segment) if batch_norm.synchronized(layer)]
    if not calls or logical is not None or len(devices) == 1:
        return None
    names = sorted({layer.name for layer in calls})
    if jit_compile:
        warnings.warn(
            f"stage {k} all-reduces the moments of its synchronized BatchNormalization layers "
            f"{names} over its {len(devices)} replicas inside its programs, which XLA cannot "
            "compile (XLA on CPU has no collectives): that stage runs without XLA "
            "(jit_compile=False for it)",
            stacklevel=4,
        )
    return NormGroup(devices, calls)


def warn_parts(
    stages: list[list[StageReplica]], replicas: int, micro_batches: int, batch: int | None = None
) -> None:
    """Warns when BatchNormalization or ``add_loss`` layers see part of the global batch of
    ``batch`` examples (None: unknown): 1/(R·M) of it, a synchronized BN 1/M."""
    norms = list({id(n): n for row in stages for n, _ in row[0].norms}.values())
    added = [layer for row in stages for layer in row[0].regularized if adds_loss(layer)]
    parts = replicas * micro_batches
    if norms:
        batch_norm.warn_micro_batches(norms, replicas, micro_batches, batch)
    if added and parts > 1:
        warn_added_losses(added, parts)
