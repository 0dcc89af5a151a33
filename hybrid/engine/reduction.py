"""What is reduced across the mesh after the micro-batches ran: the loss over the global
batch, the gradients' scale, and the gradient norm over every stage.

Conceptually, for one step on the global batch::

    numerator, denominator = sums over replicas and micro-batches of each micro-batch's terms
    loss  = divide_no_nan(numerator, divisor)         # exactly Keras's reduction of the batch
    grads = (sum over replicas of each stage's summed gradients) · divide_no_nan(1, divisor)
    loss += weight penalties (kernel/bias regularizers); grads += their gradients
    global_clipnorm: grads ·= clip · min(1 / norm, 1 / clip), norm over every stage's grads
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from hybrid.engine.losses import divisor
from hybrid.engine.stage import StageReplica

__all__ = ["clip_by_global_norm", "global_loss", "stage_gradients"]


def global_loss(loss: keras.losses.Loss, terms: Sequence[tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
    """The loss of the global batch and the factor its gradients are scaled by.

    Args:
      loss: the Keras loss (its reduction decides the divisor).
      terms: every micro-batch's ``[numerator, denominator]``, from every replica.

    Returns:
      ``(loss, scale)``: the batch's loss, and ``d loss / d numerator``.
    """
    numerator, denominator = tf.unstack(tf.add_n(list(terms)))
    by = divisor(loss, denominator)
    return tf.math.divide_no_nan(numerator, by), tf.math.divide_no_nan(tf.ones_like(by), by)


def stage_gradients(
    copies: Sequence[StageReplica], summed: Sequence[Sequence[tf.Tensor]], scale: tf.Tensor
) -> tuple[list[list[tf.Tensor]], tf.Tensor | None]:
    """One stage's gradients of the step's whole loss on every replica's copy.

    Args:
      copies: the stage's copy on each replica.
      summed: each copy's all-reduced (summed) data-loss gradients.
      scale: ``d loss / d numerator`` (:func:`global_loss`).

    Returns:
      ``grads[r]`` = ``summed[r] · scale`` + the gradient of the stage's weight penalty
      (kernel and bias regularizers, identical on every replica), and that penalty (replica
      0's), or None when no variable of the stage is regularized.
    """
    grads, penalty = [], None
    for r, (stage, stage_grads) in enumerate(zip(copies, summed, strict=True)):
        with tf.device(stage.device):
            scaled = [g * scale for g in stage_grads]
            regularization = stage.weight_penalty()
            if regularization is not None:
                scaled = [g + p for g, p in zip(scaled, regularization[1], strict=True)]
                penalty = regularization[0] if r == 0 else penalty
        grads.append(scaled)
    return grads, penalty


def clip_by_global_norm(
    grads: Sequence[Sequence[tf.Tensor]], copies: Sequence[StageReplica], clip_norm: float
) -> list[list[tf.Tensor]]:
    """``grads[k]`` (the gradients of stage copy ``copies[k]``) scaled as Keras's
    ``global_clipnorm`` scales a model's gradients: by ``clip · min(1/norm, 1/clip)`` with the
    norm over every model variable (a tied one counted once, by its owner), NaN when the norm
    is not finite (so the update is too)."""
    devices = [copy.device for copy in copies]
    squares = []
    for stage_grads, copy in zip(grads, copies, strict=True):
        with tf.device(copy.device):
            owned = [g for g, mine in zip(stage_grads, copy.owned, strict=True) if mine]
            squares += [tf.add_n([tf.reduce_sum(tf.square(g)) for g in owned])] if owned else []
    with tf.device(devices[0]):
        norm = tf.sqrt(tf.add_n(squares))
        scale = clip_norm * tf.minimum(1.0 / norm, 1.0 / clip_norm) + (norm - norm)
    clipped = []
    for stage_grads, device in zip(grads, devices, strict=True):
        with tf.device(device):
            clipped.append([g * tf.cast(scale, g.dtype) for g in stage_grads])
    return clipped
