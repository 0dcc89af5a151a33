"""What is reduced across the mesh around the micro-batches: the loss's divisors before,
the loss of the global batch and the gradient norm over every stage after.

Conceptually, for one step on the global batch (``hybrid.engine.model.objective``)::

    divisor_i = Keras's divisor of output i's loss over the global batch  (labels only)
    backward from d loss / d numerator_i = w_i / divisor_i  -> gradients already scaled
    loss  = sum_i w_i · numerator_i / divisor_i, numerators summed over every micro-batch
    grads = sum over replicas of each stage's summed gradients
    loss += weight penalties (kernel/bias regularizers); grads += their gradients
    global_clipnorm: grads ·= clip · min(1 / norm, 1 / clip), norm over every stage's grads
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from hybrid.engine.model.objective import Objective
from hybrid.engine.model.optimizers import OptimizerCopies
from hybrid.engine.model.sparse import all_finite, scaled, square_sum
from hybrid.engine.step.collectives import ReplicaGroup
from hybrid.engine.step.lowering import ReplicaStep
from hybrid.engine.step.stage import Labels, StageReplica

__all__ = [
    "all_stages",
    "clip_by_global_norm",
    "global_loss",
    "loss_divisors",
    "loss_scale",
    "nan_unless_finite",
    "stage_gradients",
    "whole_model",
]


def whole_model(
    grads: list[list[list[tf.Tensor]]],
    stages: Sequence[Sequence[StageReplica]],
    optimizers: OptimizerCopies,
) -> None:
    """In place, on every replica: what the one logical optimizer does over the whole model
    before its update: the global finite check of loss scaling (:func:`nan_unless_finite`)
    and ``global_clipnorm`` (:func:`clip_by_global_norm`). ``grads[k][r]``: stage k's
    gradients on replica r (``stages[k][r]``)."""
    for r in range(len(stages[0])):
        copies = [row[r] for row in stages]
        replica = [g[r] for g in grads]
        if optimizers.loss_scaling:
            replica = nan_unless_finite(replica, copies)
        if optimizers.global_clipnorm:
            scale = loss_scale(copies[0]) if optimizers.loss_scaling else None
            replica = clip_by_global_norm(replica, copies, optimizers.global_clipnorm, scale)
        for k, stage_grads in enumerate(replica):
            grads[k][r] = stage_grads


def loss_scale(copy: StageReplica) -> tf.Tensor | None:
    """The dynamic loss scale of a LossScaleOptimizer copy (every copy holds the same one),
    or None without loss scaling."""
    optimizer = copy.optimizer
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return None
    with tf.device(copy.device):  # read where the variable lives
        return tf.convert_to_tensor(optimizer.dynamic_scale)


def nan_unless_finite(
    grads: list[list[tf.Tensor]], copies: Sequence[StageReplica]
) -> list[list[tf.Tensor]]:
    """One replica's gradients of every stage, all NaN unless all are finite: the finite
    check of a LossScaleOptimizer made global, so every stage's copy skips the same steps
    and moves its scale the same way (Keras checks the whole model's gradients at once)."""
    flags = []
    for stage_grads, copy in zip(grads, copies, strict=True):
        with tf.device(copy.device):
            flags.append(tf.reduce_all([all_finite(g) for g in stage_grads]))
    with tf.device(copies[0].device):
        factor = tf.where(tf.reduce_all(flags), 1.0, float("nan"))
    out = []
    for stage_grads, copy in zip(grads, copies, strict=True):
        with tf.device(copy.device):
            out.append([scaled(g, factor) for g in stage_grads])
    return out


def loss_divisors(
    objective: Objective,
    copies: Sequence[StageReplica],
    labels: Sequence[Sequence[Labels]],
    across: Callable[[tf.Tensor], tf.Tensor] | None = None,
) -> tf.Tensor | None:
    """Each output's divisor over the global batch (from labels and sample weights alone);
    None for a late (masked) output, whose divisor comes from the forward.

    Args:
      copies: the last stage's copy on each replica (where its labels go).
      labels: ``labels[r][m]``: micro-batch m's labels on replica r.
      across: sums the denominators over the replicas this program does not see (in a
        program every replica runs: its all-reduce), or None when it sees them all.
    """
    if objective.late:
        return None
    denominators = []
    for copy, row in zip(copies, labels, strict=True):
        with tf.device(copy.device):  # one call on the replica's M micro-batches: sums
            denominators.append(objective.denominators(*_joined(row)))
    with tf.device(copies[0].device):
        total = tf.add_n(denominators)
        return objective.divisors(total if across is None else across(total))


def _joined(row: Sequence[Labels]) -> Labels:
    """A replica's micro-batches' ``(y, sample_weight, valid)`` as one batch: each output's
    labels (and weights, and the real-example flags) concatenated along the batch axis."""

    def joined(parts: Sequence[Any]) -> Any:
        return None if parts[0] is None else tf.concat(list(parts), 0)

    ys, ws, valid = zip(*row, strict=True)
    weights = None if ws[0] is None else [joined(w) for w in zip(*ws, strict=True)]
    return [joined(y) for y in zip(*ys, strict=True)], weights, joined(valid)


def global_loss(
    objective: Objective, terms: Sequence[tf.Tensor], divisors: tf.Tensor | None
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The loss of the global batch from every micro-batch's terms (every replica's), the
    divisors (from the summed terms when not known before) and each output's own loss."""
    total = tf.add_n(list(terms))
    if divisors is None:
        divisors = objective.divisors(total[:, 1])
    return objective.value(total, divisors), divisors, objective.values(total, divisors)


def all_stages(
    steps: Sequence[ReplicaStep],
    stages: Sequence[Sequence[StageReplica]],
    groups: Sequence[ReplicaGroup],
    device_rows: Sequence[int],
    scale: tf.Tensor | None,
    loss_scale: tf.Tensor | None,
) -> tuple[list[list[list[tf.Tensor]]], list[Any], tf.Tensor | None]:
    """After every replica's schedule (``steps[r]``): each model stage's gradients summed
    over its replica group (once the stage's device row is done) with its weight penalty's
    added (:func:`stage_gradients`), its BatchNormalization statistics summed the same way,
    and the step's regularization (weight penalties and the activity penalties weighted as
    in the loss), or None without any.

    Returns:
      ``grads[k][r]``, ``stats[k][r]`` (empty for a stage without BN) and the penalty.
    """
    grads, stats, penalties = [], [], []
    for k, row in enumerate(stages):
        tails = [t for step in steps for t in step.tails[device_rows[k]]]
        with tf.control_dependencies(tails):
            summed = groups[k].all_reduce_sum([step.grads[k] for step in steps])
            norms = [[tf.add_n(step.stats[k])] for step in steps if step.stats[k]]
            stats.append(groups[k].all_reduce_sum(norms) if norms else [])
            if norms and row[0].synced:  # and each replica's own sum (batch_norm.update_copy)
                stats[-1] = [[(g[0], o[0])] for g, o in zip(stats[-1], norms, strict=True)]
        stage_grads, penalty = stage_gradients(row, summed, scale, loss_scale)
        grads.append(stage_grads)
        penalties += [penalty] if penalty is not None else []
    weight = stages[0][0].activity_scale
    penalties += [tf.add_n(step.activity) * weight for step in steps if step.activity]
    return grads, stats, tf.add_n(penalties) if penalties else None


def stage_gradients(
    copies: Sequence[StageReplica],
    summed: Sequence[Sequence[tf.Tensor]],
    scale: tf.Tensor | None = None,
    loss_scale: tf.Tensor | None = None,
) -> tuple[list[list[tf.Tensor]], tf.Tensor | None]:
    """One stage's gradients of the step's whole loss on every replica's copy.

    Args:
      copies: the stage's copy on each replica.
      summed: each copy's all-reduced (summed) data-loss gradients, already scaled unless
        ``scale`` (a late output's 1 / divisor) is given.
      loss_scale: the dynamic loss scale the data gradients carry; the penalty's gradient
        is scaled by it too.

    Returns:
      ``grads[r]`` = ``summed[r]`` + the gradient of the stage's weight penalty (kernel and
      bias regularizers, identical on every replica), and that penalty (replica 0's), or
      None when no variable of the stage is regularized.
    """
    grads, penalty = [], None
    for r, (stage, stage_grads) in enumerate(zip(copies, summed, strict=True)):
        with tf.device(stage.device):
            out = list(stage_grads) if scale is None else [scaled(g, scale) for g in stage_grads]
            regularization = stage.weight_penalty()
            if regularization is not None:
                extra = regularization[1]
                if loss_scale is not None:
                    extra = [p * loss_scale for p in extra]
                # (a sparse gradient's variable has no regularizer: its penalty is zero)
                out = [
                    g if sparse else g + p
                    for g, p, sparse in zip(out, extra, stage.sparse, strict=True)
                ]
                penalty = regularization[0] if r == 0 else penalty
        grads.append(out)
    return grads, penalty


def clip_by_global_norm(
    grads: Sequence[Sequence[tf.Tensor]],
    copies: Sequence[StageReplica],
    clip_norm: float,
    loss_scale: tf.Tensor | None = None,
) -> list[list[tf.Tensor]]:
    """``grads[k]`` (the gradients of stage copy ``copies[k]``) scaled as Keras's
    ``global_clipnorm`` scales a model's gradients: by ``clip · min(1/norm, 1/clip)`` with the
    norm over every model variable (a tied one counted once, by its owner), NaN when the norm
    is not finite (so the update is too); a sparse gradient's norm counts each slice, and
    the clipped gradient is dense, as Keras's are. Gradients that carry a dynamic ``loss_scale`` are
    scaled by the factor of their unscaled norm, as the inner optimizer of a
    LossScaleOptimizer clips after unscaling."""
    devices = [copy.device for copy in copies]
    squares = []
    for stage_grads, copy in zip(grads, copies, strict=True):
        with tf.device(copy.device):
            owned = [g for g, mine in zip(stage_grads, copy.owned, strict=True) if mine]
            squares += [tf.add_n([square_sum(g) for g in owned])] if owned else []
    with tf.device(devices[0]):
        norm = tf.sqrt(tf.add_n(squares))
        if loss_scale is not None:
            norm = norm / loss_scale
        scale = clip_norm * tf.minimum(1.0 / norm, 1.0 / clip_norm) + (norm - norm)
    clipped = []
    for stage_grads, device in zip(grads, devices, strict=True):
        with tf.device(device):
            # ``g * scale`` as Keras writes it: a sparse gradient becomes dense (its rows
            # summed), so the optimizer's dense path follows, as in Keras.
            clipped.append([tf.convert_to_tensor(g) * tf.cast(scale, g.dtype) for g in stage_grads])
    return clipped
