"""BatchNormalization under micro-batching: defined as GPipe and torchgpipe define it.

Training normalizes each micro-batch with its own statistics (what each BN call computes on
the examples it sees). The moving statistics are updated once per step, from the moments of
the layer's inputs over the whole global batch, combined from every micro-batch and replica
(torchgpipe's deferred batch norm)::

    per micro-batch m of n examples:   mean_m, var_m = moments of the BN input (Keras's own)
    over the R·M micro-batches:        mean = avg(mean_m)
                                       var  = avg(var_m) + avg(mean_m²) - mean²
    once per step, as Keras updates:   moving_mean = moving_mean·μ + mean·(1 - μ)
                                       moving_var  = moving_var·μ  + var·(1 - μ)

For a BN whose input does not itself depend on another BN in training mode, these are the
moving statistics Keras computes on the whole batch; every replica holds the same ones; with
R·M = 1 the whole step is exactly Keras's. The layer's own assignments inside the stage
program (per micro-batch) are discarded. A ``synchronized=True`` layer on R > 1 replicas
normalizes each micro-batch over the R replicas' together (``synced_norm``); its moments
are the same on every replica, so each combines its own M micro-batches' (used as they are
when M = 1: Keras's under ``MirroredStrategy``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from hybrid.core.config import BATCH_NORM_MIN_EXAMPLES
from hybrid.engine import keras_private
from hybrid.engine.model.graph import Segment
from hybrid.engine.model.layer_checks import layer_names

__all__ = [
    "Norm",
    "norms_of",
    "statistics",
    "synchronized",
    "update_copy",
    "update_moving",
    "warn_micro_batches",
]

Norm = tuple[keras.layers.BatchNormalization, int]  # a BN layer and the key of its input


def synchronized(layer: Any) -> bool:
    """Whether ``layer`` is a ``BatchNormalization(synchronized=True)``."""
    return isinstance(layer, keras.layers.BatchNormalization) and bool(layer.synchronized)


def norms_of(segment: Segment) -> list[Norm]:
    """The BatchNormalization calls of ``segment``, with their input keys."""
    return [
        (call.layer, call.inputs[0])
        for call in segment.calls
        if isinstance(call.layer, keras.layers.BatchNormalization) and call.layer.trainable
    ]


def statistics(
    norms: Sequence[Norm],
    values: dict[int, Any],
    synced: Sequence[tuple[tf.Tensor, tf.Tensor]] | None = None,
) -> tf.Tensor:
    """One micro-batch's ``[mean, var, mean²]`` of every BN input, concatenated (float32).

    Args:
      synced: the moments each synchronized BN call normalized with (all-reduced over the
        stage's replicas, ``synced_norm``), in call order; None: no call is synchronized.
    """
    parts = []
    found = iter(synced or [])
    for layer, key in norms:
        if synced is not None and synchronized(layer):
            mean, variance = next(found)
        else:
            x = tf.cast(values[key], tf.float32)  # Keras upcasts before its moments too
            mean, variance = keras_private.batch_norm_moments(layer, x)
        parts += [tf.reshape(mean, [-1]), tf.reshape(variance, [-1]), tf.reshape(mean * mean, [-1])]
    return tf.concat(parts, axis=0)


def update_moving(
    norms: Sequence[Norm],
    state: dict[int, Any],
    summed: tf.Tensor,
    count: int,
    own: tf.Tensor | None = None,
    own_count: int = 1,
) -> list[Any]:
    """Assigns every BN's moving statistics; returns the assignments.

    Args:
      state: id(template variable) -> this copy's variable.
      summed: the sum of :func:`statistics` over ``count`` micro-batches (every replica's).
      own: the sum over this replica's ``own_count`` micro-batches alone, from which the
        synchronized BN calls (whose statistics every replica shares) take theirs; None:
        every call takes its statistics from ``summed``.
    """
    updates, start = [], 0
    for layer, _ in norms:
        size = int(layer.moving_mean.shape.num_elements())
        source, parts = summed, count
        if own is not None and synchronized(layer):  # the same on every replica: its own
            source, parts = own, own_count
        average = source[start : start + 3 * size] / parts
        mean, var, square = (
            tf.reshape(average[i * size : (i + 1) * size], layer.moving_mean.shape)
            for i in range(3)
        )
        start += 3 * size
        # One set of moments is Keras's own: taken as they are.
        variance = var if parts == 1 else var + square - mean * mean
        momentum = layer.momentum
        for template, value in ((layer.moving_mean, mean), (layer.moving_variance, variance)):
            copy = state[id(template)]
            updates.append(copy.assign(copy * momentum + value * (1.0 - momentum)))
    return updates


def update_copy(copy: Any, summed: Any, count: int) -> list[Any]:
    """Updates a stage copy's (a ``StageReplica``'s) moving statistics once for the step,
    from its :func:`statistics` summed over the step's ``count`` micro-batches of every
    replica; when its synchronized BN calls all-reduce (``copy.synced``), ``summed`` is
    that sum and the sum over the copy's own micro-batches, from which they take theirs."""
    state = dict(zip(map(id, copy.templates), copy.variables, strict=True))
    if not copy.synced:
        return update_moving(copy.norms, state, summed, count)
    group, own = summed
    micro_batches = count // copy.synced.group.size
    return update_moving(copy.norms, state, group, count, own, micro_batches)


def warn_micro_batches(
    layers: Sequence[keras.layers.Layer], replicas: int, micro_batches: int, batch: int | None
) -> None:
    """Warns that training-mode BatchNormalization normalizes over part of the global batch
    of ``batch`` examples (None: not known yet), with the examples it sees and the remedies:
    each micro-batch alone (B / (R·M) examples), or a synchronized one the R replicas'
    micro-batches together (B / M); silent where that is the whole batch."""
    M = micro_batches
    alone = [n.name for n in layers if not synchronized(n) and replicas * M > 1]
    together = [n.name for n in layers if synchronized(n) and micro_batches > 1]
    if not (alone or together):
        return

    def share(parts: int, how: str) -> str:
        if batch is None:
            return f"1/{parts} of the global batch (1 / {how})"
        return f"{-(-batch // parts)} examples (the global batch of {batch} / {how})"

    said = []
    if alone:
        said.append(
            f"BatchNormalization layers {layer_names(alone)} normalize each micro-batch alone "
            "in training: "
            + share(replicas * micro_batches, f"(replicas {replicas} × micro_batches {M})")
        )
    if together:
        said.append(
            f"synchronized BatchNormalization layers {layer_names(together)} normalize each "
            "micro-batch of "
            f"the {replicas} replicas together: "
            + share(micro_batches, f"micro_batches {micro_batches}")
        )
    remedies = f"more examples per micro-batch (at least {BATCH_NORM_MIN_EXAMPLES})"
    if alone and replicas > 1:
        remedies += ", synchronized=True"
    warnings.warn(
        "; ".join(said) + ", where Keras normalizes over the whole batch (the moving "
        f"statistics here do too); few examples make it noisy. Remedies: {remedies}, or "
        "Group/LayerNormalization (docs/guide/exactness.md, 'BatchNormalization')",
        stacklevel=3,
    )
