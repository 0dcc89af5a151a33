"""The loss Keras computes, split so that it can be summed over micro-batches and replicas.

Keras reduces a loss over the whole batch (``keras.losses.Loss.__call__``)::

    values = loss.call(y_true, y_pred)                    # per element
    values *= sample_weight                               # after squeezing/expanding ranks
    "sum":                     total = sum(values)
    "sum_over_batch_size":     total = sum(values) / size(values)
    "mean_with_sample_weight": total = sum(values) / sum(sample_weight)   (size without weights)
    None / "none":             values, whose gradient in ``train_step`` is that of their sum
                               and whose reported loss is their mean (Keras's loss tracker)

Each reduction is ``numerator / denominator`` with both sums over the batch, so a pipeline
computes ``(numerator, denominator)`` of every micro-batch on the last stage, adds them up over
micro-batches and replicas, and divides once (``divide_no_nan``, as Keras does): the loss and
its gradient are those of the whole global batch, not a mean of micro-batch means.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import keras
import tensorflow as tf

from hybrid.engine import keras_private

__all__ = [
    "REDUCTIONS",
    "LossLike",
    "as_keras_loss",
    "divisor",
    "loss_terms",
    "per_element",
    "value_count",
]

LossLike: TypeAlias = keras.losses.Loss | str | Callable[[Any, Any], Any]
# Reductions whose value is a sum divided by a count that adds up over micro-batches, and
# the per-element values of reduction None (summed for the gradient, as Keras does).
REDUCTIONS = ("sum", "sum_over_batch_size", "mean", "mean_with_sample_weight", None, "none")


def per_element(loss: keras.losses.Loss) -> bool:
    """The loss returns per-element values (reduction None): Keras's ``train_step`` takes
    the gradient of their sum and reports their mean."""
    return loss.reduction in (None, "none")


def as_keras_loss(loss: LossLike) -> keras.losses.Loss:
    """The ``keras.losses.Loss`` that ``model.compile(loss=loss)`` would use.

    A Loss is used as given; a name is looked up (``keras.losses.get``); a plain function of
    ``(y_true, y_pred)`` is wrapped with the ``sum_over_batch_size`` reduction, as
    ``compile`` wraps it.

    Raises:
      TypeError: ``loss`` is none of these.
      ValueError: a Loss subclass that overrides ``__call__`` (a reduction of its own,
        which cannot be split over micro-batches).
    """
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if not isinstance(loss, keras.losses.Loss):
        if not callable(loss):
            raise TypeError(
                f"loss must be a keras.losses.Loss, a loss name or callable(y_true, y_pred), got "
                f"{type(loss).__name__}"
            )
        loss = keras_private.loss_function(loss)
    if type(loss).__call__ is not keras.losses.Loss.__call__:
        raise ValueError(
            f"loss {loss.name!r} ({type(loss).__name__}) overrides __call__, a reduction of "
            "its own that the pipeline cannot split over micro-batches and replicas; compute "
            "per-element values in call() and choose a Keras reduction (reduction='sum' for "
            "a total you scale yourself, or one of "
            f"{[r for r in REDUCTIONS if r is not None]})"
        )
    if loss.reduction not in REDUCTIONS:  # Keras validates it; a subclass may not
        raise ValueError(
            f"loss {loss.name!r} has reduction={loss.reduction!r}; use one of {list(REDUCTIONS)}"
        )
    return loss


def loss_terms(
    loss: keras.losses.Loss,
    y_true: Any,
    y_pred: Any,
    sample_weight: Any = None,
    valid: Any = None,
) -> tuple[tf.Tensor, tf.Tensor]:
    """``(numerator, denominator)`` of ``loss`` on one micro-batch, in float32.

    ``loss(y_true, y_pred, sample_weight)`` on the whole batch equals
    ``divide_no_nan(sum of numerators, sum of denominators)`` over its micro-batches, except
    for ``"sum"`` and None, whose divisor is 1 (:func:`divisor`; None's denominator is the
    number of values, what its reported mean divides by). A mask on ``y_pred`` (a layer's
    ``compute_mask``) weighs the masked-out elements 0, and the mean is over the unmasked
    ones, as Keras's ``apply_mask`` defines it (None: over every value). ``valid`` (1 per
    real example, 0 per padding example of a partial batch) leaves the padding out of both
    sums: the terms are those of the real examples alone.
    """
    mask = keras_private.output_mask(y_pred)
    values = _values(loss, y_true, y_pred)
    weights = None if mask is None else tf.cast(mask, values.dtype)
    weighted = mask is not None or sample_weight is not None
    if sample_weight is not None:
        given = tf.cast(sample_weight, values.dtype)
        if weights is not None:
            weights, given = keras_private.same_rank(weights, given)
        weights = given if weights is None else weights * given
    if weights is not None:
        values, weights = keras_private.same_rank(values, weights)
        values = values * weights
    if valid is not None:  # per example, whatever the rank of the values (tokens)
        values = values * _per_example(valid, values)
    numerator = tf.reduce_sum(values)
    if loss.reduction == "mean_with_sample_weight" and weighted:
        assert weights is not None
        real = weights if valid is None else weights * _per_example(valid, weights)
        denominator = tf.reduce_sum(real)
    elif mask is not None and not per_element(loss):  # the unmasked elements
        denominator = _count(values, tf.cast(mask, values.dtype), valid)
    else:
        denominator = _count(values, tf.ones_like(values), valid)
    return tf.cast(numerator, tf.float32), tf.cast(denominator, tf.float32)


def _values(loss: keras.losses.Loss, y_true: Any, y_pred: Any) -> tf.Tensor:
    """The loss's per-element values (``loss.call``) in its dtype."""
    y_pred = keras.ops.convert_to_tensor(y_pred, dtype=loss.dtype)
    y_true = keras.ops.convert_to_tensor(y_true, dtype=loss.dtype)
    return keras.ops.convert_to_tensor(loss.call(y_true, y_pred), dtype=loss.dtype)


def value_count(
    loss: keras.losses.Loss, y_true: tf.TensorSpec, y_pred: tf.TensorSpec
) -> int | None:
    """The denominator :func:`loss_terms` computes for a batch of these shapes when nothing
    weighs its values (no sample weight, no mask on ``y_pred``, no padding flags): the number
    of values ``loss.call`` returns, which their shapes alone decide. Found by calling the
    loss in a graph of its own, so a step that knows it adds no op for it; None when the
    shapes are not all known (or the loss cannot be called apart from a step)."""
    if not (y_true.shape.is_fully_defined() and y_pred.shape.is_fully_defined()):
        return None
    with tf.Graph().as_default():
        try:
            values = _values(loss, tf.zeros(y_true.shape, y_true.dtype), tf.zeros(y_pred.shape))
        except Exception:  # noqa: BLE001 - the user's loss: counted by the step's ops instead
            return None
    return values.shape.num_elements()


def _count(values: tf.Tensor, counted: tf.Tensor, valid: Any) -> tf.Tensor:
    """How many elements of ``values`` are ``counted`` (1) among the real examples."""
    if valid is None:
        return tf.reduce_sum(counted)
    return tf.reduce_sum(tf.broadcast_to(counted * _per_example(valid, counted), tf.shape(values)))


def _per_example(valid: Any, like: tf.Tensor) -> tf.Tensor:
    """The per-example flags ``valid`` ([batch]) shaped to multiply ``like`` along its
    batch axis ([batch, 1, ...]): a token's value counts when its example is real."""
    flags = tf.cast(valid, like.dtype)
    return tf.reshape(flags, [-1] + [1] * (like.shape.rank - 1))


def divisor(loss: keras.losses.Loss, denominators: tf.Tensor) -> tf.Tensor:
    """What the summed numerators are divided by: 1 for ``"sum"`` and None, else the summed
    denominators."""
    if loss.reduction == "sum" or per_element(loss):
        return tf.ones_like(denominators)
    return denominators
