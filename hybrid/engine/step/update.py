"""A stage copy's optimizer update as one program, traced once for all copies of a stage.

Conceptually, for each copy c of model stage k (one per replica)::

    c.optimizer.apply(grads_c, c.variables)        # Keras's update of c's own variables

Every copy of a stage has the same optimizer (class, configuration, weight-decay exclusions)
over variables of the same shapes, so the programs differ only in which variables they read
and write. A ``tf.Variable`` handed to a ``tf.function`` is an input of its trace, not a
capture: the program is traced once with the first copy's optimizer and variables, taking
all of them (the updated weights, then every optimizer variable: moments, step count,
learning rate, EMA averages, a LossScaleOptimizer's scale) as arguments, and every other
copy runs that trace on its own variables. The arithmetic is Keras's own, sparse scatters
included; each device still compiles the program.

A trace that reads a variable it was not given (a learning-rate schedule holding a variable
of its own) is not shared: each copy then runs its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from hybrid.engine import keras_private

__all__ = ["Update"]


class Update:
    """``optimizer.apply(grads, variables)`` as a program (``compile(fn)``: a
    ``tf.function``, or ``fn`` itself for ops inline in the caller's program).

    Args:
      optimizer: the copy's optimizer, built for ``variables``.
      variables: the trainable variables it updates (``keras.Variable``s).
      compile: makes a program of a Python function.
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        variables: Sequence[Any],
        compile: Callable[[Callable[..., None]], Any],
    ) -> None:
        self.optimizer, self.variables = optimizer, list(variables)
        self._program = compile(self._apply)

    def _apply(self, grads: list[Any], state: list[tf.Variable]) -> None:
        """The traced update: ``state`` (:meth:`state`) holds what it reads and writes, as
        the trace's inputs; the optimizer's own code reaches them through its objects."""
        del state
        self.optimizer.apply(grads, self.variables)

    def state(self) -> list[tf.Variable]:
        """The TensorFlow variables the update reads and writes: the updated variables, then
        the optimizer's (``optimizer.variables``, a LossScaleOptimizer's inner ones
        included)."""
        found = [*self.variables, *self.optimizer.variables]
        return [keras_private.tf_variable(v) for v in found]

    def __call__(self, grads: list[Any], on: Update | None = None) -> None:
        """Applies ``grads`` to ``on``'s variables with ``on``'s optimizer (default: this
        update's own) by this program, when its trace reads nothing of this copy but its
        arguments and ``on``'s state matches; otherwise by ``on``'s own program."""
        target = self if on is None else on
        state = target.state()
        if target is not self:
            if not self._serves(target, grads, state):
                target(grads)
                return
        self._program(grads, state)

    def _serves(self, other: Update, grads: list[Any], state: list[tf.Variable]) -> bool:
        """Whether this program updates ``other`` as ``other``'s own would: the same
        optimizer class over variables of the same shapes and dtypes, and a trace (for these
        arguments) that captures no variable."""
        find = getattr(self._program, "get_concrete_function", None)
        if find is None or type(other.optimizer) is not type(self.optimizer):
            return False
        mine = self.state()
        if [(v.shape, v.dtype) for v in mine] != [(v.shape, v.dtype) for v in state]:
            return False
        return not find(grads, mine).variables
