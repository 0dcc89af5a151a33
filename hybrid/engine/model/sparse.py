"""Sparse weight gradients: the variables whose gradient Keras hands its optimizer as
``tf.IndexedSlices``, and how the pipeline carries such gradients to the optimizer.

On one device, Keras's TensorFlow backend differentiates a gather (an ``Embedding``'s
lookup) into ``IndexedSlices``: one row of values per id looked up, repeated ids repeated.
Keras's optimizers are sparse-aware: Adam squares each slice before the rows are added
(``ops.square`` keeps the slices), so for a batch that repeats a token its update differs
from the update of the densified gradient. Exactness therefore means handing every copy's
optimizer the very slices Keras would, in example order::

    per micro-batch m on replica r:   (values[r, m], ids[r, m])   # the gather's gradient
    stage gradient on every replica:  IndexedSlices(concat over r, then m, of values,
                                                    the same concat of ids, variable shape)

Inside a compiled stage program a sparse gradient is the pair ``(values, indices)``; the
programs' running sums hold only the dense gradients, and the slices of the micro-batches
are concatenated outside the programs (:func:`joined`). Across replicas they are gathered,
not summed (``collectives.ReplicaGroup``), as ``MirroredStrategy`` gathers ``IndexedSlices``.
A variable Keras would aggregate densely keeps the dense sum: one that a layer also reads
densely (a tied embedding read by the head), or one with a regularizer (its penalty's
gradient is dense).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

__all__ = [
    "Gradient",
    "concat",
    "empty",
    "flat_tensors",
    "gradient_kinds",
    "joined",
    "pairs",
    "all_finite",
    "program_outputs",
    "scaled",
    "slices",
    "square_sum",
    "structured",
]

Gradient = Any  # a dense tf.Tensor or a tf.IndexedSlices


def gradient_kinds(
    graph: Any, inputs: Sequence[Any], variables: Sequence[Any]
) -> tuple[set[int], set[int]]:
    """The ids of the trainable ``variables`` whose gradient Keras's one-device training step
    would hand its optimizer as ``IndexedSlices`` (sparse), and of those it would hand None
    (unused: nothing the loss depends on reads them, so Keras's optimizer leaves them alone,
    weight decay included).

    The model (``graph``, a ``hybrid.engine.model.graph.Graph``) runs once eagerly in training mode
    on the zero ``inputs`` under a tape, inside a ``keras.StatelessScope`` (so nothing it
    holds changes: moving statistics and random states are written to the scope, not to the
    variables), and the gradient of its float outputs' sum plus the losses its layers add
    (``add_loss``, activity regularizers) is taken with respect to every variable, aggregated
    over all its uses as Keras's tape aggregates it (0.2–0.6 s for MobileNetV2 or a small
    GPT-2; tracing a function of it took 3 s). A regularized variable is dense and used
    (Keras adds its penalty). Run it on the host's CPU: it holds every variable's gradient."""
    trainable = [v for v in variables if v.trainable and not getattr(v, "regularizer", None)]
    if not trainable:
        return set(), set()
    with tf.GradientTape() as tape, keras.StatelessScope(collect_losses=True) as scope:
        values = graph.trace([tf.zeros_like(t) for t in inputs], training=True)
        outputs = [values[k] for k in graph.outputs]
        terms = [tf.reduce_sum(tf.cast(y, tf.float32)) for y in outputs if y.dtype.is_floating]
        terms += [tf.reduce_sum(tf.cast(loss, tf.float32)) for loss in scope.losses]
        total = tf.add_n(terms + [tf.constant(0.0)])
    grads = tape.gradient(total, [v.value for v in trainable])
    found = list(zip(trainable, grads, strict=True))
    sparse = {id(v) for v, g in found if isinstance(g, tf.IndexedSlices)}
    return sparse, {id(v) for v, g in found if g is None}


def empty(variable: Any) -> tf.IndexedSlices:
    """No slices for ``variable`` (a sparse variable that a trace did not reach)."""
    shape = list(variable.shape)
    return tf.IndexedSlices(
        tf.zeros([0, *shape[1:]], variable.dtype), tf.zeros([0], tf.int64), tf.constant(shape)
    )


def pairs(grad: Any, variable: Any) -> list[tf.Tensor]:
    """A sparse gradient as the two tensors a program returns: values with one row per
    slice (``[n, *variable.shape[1:]]``) and their int64 row indices (``[n]``)."""
    if grad is None:
        grad = empty(variable)
    if not isinstance(grad, tf.IndexedSlices):
        raise TypeError(
            f"internal error: the gradient of {getattr(variable, 'path', variable)!r} was "
            f"expected as IndexedSlices (a gather's gradient), got a dense {type(grad)}"
        )
    row = list(variable.shape[1:])
    values = tf.reshape(grad.values, [-1, *row])
    return [values, tf.reshape(tf.cast(grad.indices, tf.int64), [-1])]


def slices(values: tf.Tensor, indices: tf.Tensor, variable: Any) -> tf.IndexedSlices:
    """``IndexedSlices`` of rows of ``variable``'s shape (values and their row indices)."""
    return tf.IndexedSlices(values, indices, tf.constant(list(variable.shape)))


def concat(parts: Sequence[tf.IndexedSlices]) -> tf.IndexedSlices:
    """The slices of ``parts`` one after another (the gradient of their sum, every slice
    kept: Keras's aggregation of several gathers' gradients)."""
    if len(parts) == 1:
        return parts[0]
    return tf.IndexedSlices(
        tf.concat([p.values for p in parts], 0),
        tf.concat([p.indices for p in parts], 0),
        parts[0].dense_shape,
    )


def structured(
    flat: Sequence[tf.Tensor], sparse: Sequence[bool], variables: Sequence[Any]
) -> list[Gradient]:
    """A program's weight-gradient outputs (the dense gradients in variable order, then a
    (values, indices) pair per sparse variable) as one gradient per variable."""
    dense = iter(flat[: len(sparse) - sum(sparse)])
    rest = iter(flat[len(sparse) - sum(sparse) :])
    out: list[Gradient] = []
    for is_sparse, v in zip(sparse, variables, strict=True):
        if is_sparse:
            out.append(slices(next(rest), next(rest), v))
        else:
            out.append(next(dense))
    return out


def program_outputs(
    grads: Sequence[Any], sparse: Sequence[bool], variables: Sequence[Any]
) -> list[tf.Tensor]:
    """One gradient per variable (a sparse one as IndexedSlices) as a program returns them:
    the dense ones in order, then each sparse one's (values, indices)."""
    dense = [g for g, s in zip(grads, sparse, strict=True) if not s]
    for g, s, v in zip(grads, sparse, variables, strict=True):
        dense += pairs(g, v) if s else []
    return dense


def joined(acc: Sequence[Gradient] | None, grads: Sequence[Gradient]) -> list[Gradient]:
    """``acc`` and ``grads`` combined per variable: dense ones added, sparse ones
    concatenated (``acc``'s slices first); ``grads`` when there is nothing before."""
    if not acc or not grads:
        return list(grads)
    return [
        concat([a, g]) if isinstance(g, tf.IndexedSlices) else a + g
        for a, g in zip(acc, grads, strict=True)
    ]


def flat_tensors(grads: Sequence[Gradient]) -> list[tf.Tensor]:
    """The tensors of ``grads`` (a sparse one's values and indices): what a control
    dependency on them waits for."""
    out: list[tf.Tensor] = []
    for g in grads:
        out += [g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g]
    return out


def scaled(grad: Gradient, factor: tf.Tensor) -> Gradient:
    """``grad · factor`` (a sparse gradient's values scaled, its indices kept)."""
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values * tf.cast(factor, grad.values.dtype)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def square_sum(grad: Gradient) -> tf.Tensor:
    """The sum of ``grad``'s squared entries as Keras's ``global_clipnorm`` counts them: a
    sparse gradient's slices squared one by one (a repeated row counted per slice)."""
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    return tf.reduce_sum(tf.square(values))


def all_finite(grad: Gradient) -> tf.Tensor:
    """Whether every entry of ``grad`` (a sparse gradient's values) is finite."""
    values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
    return tf.reduce_all(tf.math.is_finite(values))
