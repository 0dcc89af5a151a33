"""The gradients a stage's programs take: of its outputs against their output gradients
(input and weight gradients, from one tape) and the weight regularization Keras adds to the
loss once per step. A sparse weight gradient (a gather's) stays ``IndexedSlices``, as Keras
hands it to the optimizer; ``sparse.joined`` sums (or joins) them over micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hybrid.engine.model import sparse as sparse_grads
from hybrid.engine.programs.depthwise import cheap_filter_gradients

__all__ = ["Grads", "differentiable", "gradients", "weight_penalty"]

Tensors = list[tf.Tensor]
Grads = tuple[list[tf.Tensor | None] | None, list[tf.Tensor]]


def differentiable(t: Any) -> bool:
    """Whether ``t`` can carry a gradient (integer ids and masks have none)."""
    return t is not None and t.dtype.is_floating


def gradients(
    tape: tf.GradientTape,
    xs: Tensors,
    ys: Tensors,
    dys: Sequence[tf.Tensor | None],
    weights: Tensors,
    need_dx: bool,
    need_dw: bool,
    sparse: Sequence[bool] = (),
    xla_on_cpu: bool = False,
) -> Grads:
    """``dys · ∂ys/∂xs`` (when ``need_dx``: one per input, None for an input that is not
    a float) and ``dys · ∂ys/∂weights`` (when ``need_dw``), from the ``tape`` that watched
    the forward; an output whose ``dy`` is None contributes nothing. Dense tensors of the
    sources' static shapes (zeros where a source does not reach the outputs), except the
    weights marked ``sparse``, whose gradients stay IndexedSlices (no slices where the
    weight does not reach the outputs). ``xla_on_cpu``: they are computed inside an XLA
    program on a CPU, where depthwise convolutions' filter gradients take ``depthwise.py``'s
    form."""
    inputs = [x for x in xs if differentiable(x)] if need_dx else []
    sources = inputs + (list(weights) if need_dw else [])
    if not sources:
        return ([None] * len(xs) if need_dx else None), []
    targets = [
        (y, dy) for y, dy in zip(ys, dys, strict=True) if dy is not None and differentiable(y)
    ]
    with cheap_filter_gradients(xla_on_cpu):
        grads = tape.gradient(
            [y for y, _ in targets], sources, output_gradients=[dy for _, dy in targets]
        )
    kept = [False] * len(inputs)
    if need_dw:
        kept += list(sparse) or [False] * len(weights)
    grads = [
        _sparse(g, s)
        if keep
        else tf.zeros_like(s)
        if g is None
        else tf.ensure_shape(tf.convert_to_tensor(g), s.shape)
        for g, s, keep in zip(grads, sources, kept, strict=True)
    ]
    if not need_dx:
        return None, grads
    found = iter(grads[: len(inputs)])
    return [next(found) if differentiable(x) else None for x in xs], grads[len(inputs) :]


def _sparse(grad: Any, source: tf.Tensor) -> tf.IndexedSlices:
    """A sparse weight's gradient as IndexedSlices of rows of the weight's shape."""
    values, indices = sparse_grads.pairs(grad, source)
    return sparse_grads.slices(values, indices, source)


def weight_penalty(
    variables: Sequence[Any], owned: Sequence[bool], read: Callable[[], Tensors]
) -> tuple[tf.Tensor, Tensors] | None:
    """The weight regularization Keras adds to the loss once per step: the sum of
    ``variable.regularizer(variable)`` over the ``variables`` that have one (kernel and bias
    regularizers) and are ``owned`` (a variable shared with an earlier stage is counted
    there), and its gradient per variable, at the values ``read()`` returns; None when no
    variable is regularized."""
    regularizers = [
        getattr(v, "regularizer", None) if mine else None
        for v, mine in zip(variables, owned, strict=True)
    ]
    if not any(regularizers):
        return None
    weights = read()
    with tf.GradientTape() as tape:
        tape.watch(weights)
        penalty = tf.add_n(
            [
                tf.cast(tf.reduce_sum(regularize(w)), tf.float32)
                for regularize, w in zip(regularizers, weights, strict=True)
                if regularize
            ]
        )
    grads = tape.gradient(penalty, weights)
    zeros = [tf.zeros_like(w) if g is None else g for g, w in zip(grads, weights, strict=True)]
    return penalty, zeros
