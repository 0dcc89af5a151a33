"""The objective of a step: each model output's Keras loss, weighted as ``compile`` weighs it.

Keras's compiled loss reduces each output's loss over the whole batch on its own, then adds
them with the ``loss_weights``::

    loss = sum over outputs i of  w_i · numerator_i / divisor_i
    numerator_i, denominator_i = sums over the global batch of each micro-batch's terms
    divisor_i = denominator_i  (1 for reductions "sum" and None) (hybrid.engine.model.losses)

A divisor depends only on the labels, the sample weights and the shape of the output (never
on the predicted values), so the step computes the divisors first, from the labels and zero
predictions of each output's shape, and starts the backward from ``d loss / d numerator_i =
w_i / divisor_i``: the gradients come out of the pipeline already scaled as the loss is.

A masked output (``Embedding(mask_zero=True)``...) is the exception: its divisor counts the
unmasked elements, known only after the forward. The model's single output is then "late":
the backward starts from ``w``, and the summed gradients are divided by the divisor once
every micro-batch has run (:meth:`Objective.late_scale`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from hybrid.engine.model.losses import (
    as_keras_loss,
    divisor,
    loss_terms,
    per_element,
    value_count,
)
from hybrid.engine.model.zeros import fresh_zeros

__all__ = ["Objective"]


def _per_output(value: Any, names: tuple[str, ...] | None, count: int, what: str) -> list[Any]:
    """``value`` given per output (a list, or a dict by output name) or once for all."""
    if isinstance(value, dict):
        if names is None or sorted(value) != list(names):
            expected = list(names) if names else f"{count} outputs (a list)"
            raise ValueError(
                f"{what} is a dict with keys {sorted(value)}; the model has {expected}"
            )
        return [value[name] for name in names]
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{what} has {len(value)} entries; the model has {count} outputs")
        return list(value)
    return [value] * count


@dataclasses.dataclass(frozen=True)
class Objective:
    """The Keras losses of a model's outputs and their weights.

    Attributes:
      losses: one Keras loss per output (in ``model.outputs`` order).
      weights: the ``loss_weights`` of each output (1 by default).
      shapes: each output's shape without the batch dimension (known once built).
      late: the output carries a mask, so its divisor is known only after the forward.
    """

    losses: tuple[keras.losses.Loss, ...]
    weights: tuple[float, ...]
    shapes: tuple[tuple[int | None, ...], ...] = ()
    late: bool = False

    @classmethod
    def of(
        cls, loss: Any, loss_weights: Any, names: tuple[str, ...] | None, count: int
    ) -> Objective:
        """The objective ``compile(loss=loss, loss_weights=loss_weights)`` gives a model
        with ``count`` outputs (named ``names`` when the model returns a dict).

        Raises:
          ValueError: a list or dict of losses or weights that does not match the outputs.
        """
        losses = tuple(as_keras_loss(one) for one in _per_output(loss, names, count, "loss"))
        if count > 1 and any(per_element(one) for one in losses):
            raise ValueError(
                f"losses {[one.name for one in losses if per_element(one)]} have reduction "
                f"None on a model with {count} outputs; Keras adds the outputs' per-element "
                "values together, which needs them in one shape: give every output a loss "
                "that reduces over the batch (e.g. 'sum')"
            )
        weights = _per_output(
            1.0 if loss_weights is None else loss_weights, names, count, "loss_weights"
        )
        return cls(losses, tuple(float(w) for w in weights))

    def bind(self, shapes: Sequence[tuple[int | None, ...]], masked: Sequence[bool]) -> Objective:
        """This objective for outputs of the given shapes, some carrying masks.

        Raises:
          NotImplementedError: a masked output among several.
        """
        if any(masked) and len(masked) > 1:
            raise NotImplementedError(
                f"outputs {[i for i, m in enumerate(masked) if m]} of the model's "
                f"{len(masked)} carry masks; a masked loss is supported on a model with one "
                "output (its divisor counts the unmasked elements, known after the forward)"
            )
        late = any(m and not per_element(loss) for m, loss in zip(masked, self.losses, strict=True))
        return dataclasses.replace(self, shapes=tuple(tuple(s) for s in shapes), late=late)

    def terms(
        self, y_true: Sequence[Any], y_pred: Sequence[Any], weights: Any, valid: Any = None
    ) -> tf.Tensor:
        """``[[numerator_i, denominator_i]]`` of one micro-batch, one row per output (of its
        ``valid`` examples: the real ones of a padded batch)."""
        weights = [None] * len(self.losses) if weights is None else list(weights)
        parts = zip(self.losses, y_true, y_pred, weights, strict=True)
        return tf.stack([tf.stack(loss_terms(loss, t, p, w, valid)) for loss, t, p, w in parts])

    def denominators(self, y_true: Sequence[Any], weights: Any, valid: Any = None) -> tf.Tensor:
        """Each output's denominator on a batch (a micro-batch, or a replica's joined), from its
        labels and weights alone: a constant when no sample weights or padding flags weigh
        the values and the shapes are known (:func:`losses.value_count`), else computed by
        the loss on zero predictions."""
        dims = [[d or 1 for d in shape] for shape in self.shapes]  # of a prediction, no batch
        if weights is None and valid is None:
            counts = [
                value_count(
                    loss,
                    tf.TensorSpec(t.shape, t.dtype),
                    tf.TensorSpec([t.shape[0], *d], tf.float32),
                )
                for loss, t, d in zip(self.losses, y_true, dims, strict=True)
            ]
            if None not in counts:
                return tf.constant(counts, tf.float32)
        preds = [
            fresh_zeros(tf.concat([tf.shape(t)[:1], d], 0))
            for t, d in zip(y_true, dims, strict=True)
        ]
        return self.terms(y_true, preds, weights, valid)[:, 1]

    def divisors(self, denominators: tf.Tensor) -> tf.Tensor:
        """What each output's summed numerator is divided by (:func:`losses.divisor`)."""
        return tf.stack(
            [
                divisor(loss, d)
                for loss, d in zip(self.losses, tf.unstack(denominators), strict=True)
            ]
        )

    def seed(self, divisors: tf.Tensor | None) -> tf.Tensor:
        """``d loss / d terms``: ``[[w_i / divisor_i, 0]]`` (0 where a divisor is 0); for a
        late output (``divisors`` None) ``[[w, 0]]``."""
        scale = tf.constant(self.weights, tf.float32)
        if divisors is not None:
            scale = tf.math.divide_no_nan(scale, divisors)
        return tf.stack([scale, tf.zeros_like(scale)], axis=1)

    def late_scale(self, divisors: tf.Tensor) -> tf.Tensor | None:
        """What a late output's summed gradients are multiplied by (1 / divisor), else None."""
        return tf.math.divide_no_nan(1.0, divisors[0]) if self.late else None

    def values(self, terms: tf.Tensor, divisors: tf.Tensor) -> tf.Tensor:
        """Each output's own loss (before its ``loss_weights``) from the summed ``terms`` of
        the global batch and its divisors, as Keras reports it (a reduction-None loss: the
        mean of its values, whose gradient is that of their sum)."""
        means = tf.constant([per_element(loss) for loss in self.losses])
        return tf.math.divide_no_nan(terms[:, 0], tf.where(means, terms[:, 1], divisors))

    def value(self, terms: tf.Tensor, divisors: tf.Tensor) -> tf.Tensor:
        """The loss: the outputs' losses weighted by their ``loss_weights``."""
        weights = tf.constant(self.weights, tf.float32)
        return tf.reduce_sum(weights * self.values(terms, divisors))
