"""A stage copy's updates as programs, each traced once for all copies of a stage.

Conceptually, for each copy c of model stage k (one per replica)::

    c.optimizer.apply(grads_c, c.variables)        # Keras's update of c's own variables
    update_moving(c.norms, c.state, summed, count)  # its BN moving statistics

Every copy of a stage has the same optimizer (class, configuration, weight-decay exclusions)
and the same layers over variables of the same shapes, so the programs differ only in which
variables they read and write. A ``tf.Variable`` handed to a ``tf.function`` is an input of
its trace, not a capture: each program is traced once with the first copy's objects, taking
every variable it reads or writes as an argument (for the optimizer: the updated weights,
then every optimizer variable: moments, step count, learning rate, EMA averages, a
LossScaleOptimizer's scale), and every other copy runs that trace on its own variables. The
arithmetic is Keras's own, sparse scatters included; each device still compiles the program.

A trace that reads a variable it was not given (a learning-rate schedule holding a variable
of its own) is not shared: each copy then runs its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hybrid.engine import keras_private

__all__ = ["Update", "apply_all"]


class Update:
    """``fn(*args)``, which writes a copy's variables, as a program (``compile(fn)``: a
    ``tf.function``, or ``fn`` itself for ops inline in the caller's program).

    Args:
      kind: what two copies' updates must share for one to run the other's trace (the
        optimizer's class, say), besides variables of the same shapes and dtypes.
      fn: the update, on this copy's objects (what it returns is not used).
      variables: every variable ``fn`` reads or writes (``keras.Variable`` or
        ``tf.Variable``), in an order every copy's list shares.
      compile: makes a program of a Python function.
    """

    def __init__(
        self,
        kind: object,
        fn: Callable[..., Any],
        variables: Callable[[], Sequence[Any]],
        compile: Callable[[Callable[..., None]], Any],
    ) -> None:
        self.kind, self._fn, self._variables = kind, fn, variables
        self._program = compile(self._run)
        # A traced program (not ops inline in the caller's): it takes the variables.
        self._traced = hasattr(self._program, "get_concrete_function")

    def _run(self, args: tuple[Any, ...], state: list[tf.Variable]) -> None:
        """The traced update: ``state`` (:meth:`state`) holds what it reads and writes, as
        the trace's inputs; ``fn`` reaches them through this copy's objects."""
        del state
        self._fn(*args)

    def state(self) -> list[tf.Variable]:
        """The TensorFlow variables the update reads and writes."""
        return [keras_private.tf_variable(v) for v in self._variables()]

    def __call__(self, *args: Any, on: Update | None = None) -> None:
        """Runs the update with ``args`` on ``on``'s variables (default: this update's own)
        by this program, when its trace reads nothing of this copy but its arguments and
        ``on`` matches it; otherwise by ``on``'s own program."""
        target = self if on is None else on
        state = target.state() if self._traced else []
        if target is not self and not self._serves(target, args, state):
            target(*args)
            return
        self._program(args, state)

    def _serves(self, other: Update, args: tuple[Any, ...], state: list[tf.Variable]) -> bool:
        """Whether this program updates ``other`` as ``other``'s own would: the same kind
        over variables of the same shapes and dtypes, and a trace (for these arguments)
        that captures no variable."""
        if not self._traced or other.kind != self.kind:
            return False
        mine = self.state()
        if [(v.shape, v.dtype) for v in mine] != [(v.shape, v.dtype) for v in state]:
            return False
        return not self._program.get_concrete_function(args, mine).variables


def apply_all(
    stages: Sequence[Sequence[Any]],
    grads: Sequence[Sequence[Any]],
    stats: Sequence[Any],
    parts: int,
    ordered: bool = False,
) -> None:
    """Every stage copy ``stages[k][r]`` (a ``StageReplica``), on its device, applies
    ``grads[k][r]`` with its optimizer and updates its BatchNormalization moving statistics
    from ``stats[k][r]`` (summed over ``parts`` micro-batches). ``ordered``: each copy's
    updates after those of the replica before it, so that their programs compile once and
    load from a persistent XLA cache (``hybrid.engine.compile_cache``)."""
    graph = tf.compat.v1.get_default_graph()
    for k, row in enumerate(stages):
        previous: list[Any] = []
        for r, stage in enumerate(row):
            first = len(graph.get_operations()) if ordered else 0
            with tf.device(stage.device), tf.control_dependencies(previous):
                stage.apply_gradients(grads[k][r])
                if stats[k]:
                    stage.update_norms(stats[k][r][0], parts)
            previous = graph.get_operations()[first:] if ordered else []
