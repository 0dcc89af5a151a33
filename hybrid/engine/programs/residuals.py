"""What one micro-batch's forward leaves for its backward: the residuals of a program cut
from its backward (``Kept``), and everything a stage saves (``Saved``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

__all__ = ["Kept", "Labels", "Saved"]

# ([y_true per output], [sample_weight per output] or None, valid or None): ``valid`` is 1
# per real example and 0 per padding example of a partial batch (None: all are real).
Labels = tuple[Any, Any, Any]
Tensors = list[tf.Tensor]


@dataclasses.dataclass
class Kept:
    """A forward's residuals for its backward program, when the stage runs the two as the
    halves of one traced computation (``split_programs``).

    Attributes:
      programs: the ``SplitPrograms`` the forward ran.
      args: the forward program's arguments, which its backward program reads again.
      residuals: what the forward program returned for its backward, after its outputs.
      need_dx: whether the backward program computes the input gradients.
      split: whether the backward comes as two calls, B then W (a split backward).
      carried: what a split backward's B computed for its W (None until B ran).
    """

    programs: Any
    args: Tensors
    residuals: Tensors
    need_dx: bool
    split: bool = False
    carried: Tensors | None = None

    def backward(
        self, more: Tensors, wanted: list[bool], need_dx: bool, need_dw: bool
    ) -> tuple[list[tf.Tensor | None] | None, Tensors]:
        """(input gradients, weight gradients) from the backward program, given its
        arguments beyond the forward's (``more``: output gradients, running sums) and which
        inputs have a gradient (``wanted``); a split backward's B (need_dx only) keeps what
        its W (need_dw only) carries on from."""
        run = (self.args, self.residuals, more)
        if self.split and self.programs.cut_backward and need_dx != need_dw:
            if need_dx:
                dx, self.carried = self.programs.input_backward(*run)
                return _placed(dx, wanted), []
            if self.carried is None:
                raise ValueError("a split backward's W ran before its B")
            return None, self.programs.weight_backward(*run, self.carried)
        out = self.programs.backward(*run)
        if not self.need_dx:
            return None, out
        count = sum(wanted)  # the program returns the input gradients first
        return (_placed(out[:count], wanted) if need_dx else None), out[count:]


def _placed(grads: Tensors, wanted: list[bool]) -> list[tf.Tensor | None]:
    """``grads`` in the places ``wanted`` marks, None elsewhere."""
    found = iter(grads)
    return [next(found) if w else None for w in wanted]


@dataclasses.dataclass
class Saved:
    """What one micro-batch's forward leaves for its backward on this stage.

    Attributes:
      inputs: the stage inputs (kept in every remat mode).
      output: the stage outputs; on the last stage ``[[numerator, denominator]]``.
      labels: the micro-batch's (labels, sample weights) (last stage only).
      seed: the random seed the forward used, for an exact recomputation.
      tape: the tape that recorded the forward (None when the backward recomputes).
      weights: the weight values the taped forward read (its gradient sources).
      stats: the micro-batch's BatchNormalization statistics (``batch_norm.statistics``),
        when the stage has BatchNormalization layers.
      activity: the micro-batch's activity-regularization penalty, when the stage has
        layers with an ``activity_regularizer``.
      kept: the residuals of a forward program cut from its backward (then ``tape`` is
        None and the backward program uses them).
    """

    inputs: Tensors
    output: Tensors
    labels: Labels | None
    seed: tf.Tensor
    tape: tf.GradientTape | None = None
    weights: list[tf.Tensor] = dataclasses.field(default_factory=list)
    stats: list[tf.Tensor] = dataclasses.field(default_factory=list)
    activity: list[tf.Tensor] = dataclasses.field(default_factory=list)
    kept: Kept | None = None
