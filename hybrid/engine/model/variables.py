"""Where each of the model's variables lives on the pipeline, and how copies stay one.

A variable is held by every stage whose layer calls read it; most by one stage, a tied
embedding/head or a layer called on two stages by several::

    model.weights:   v0  v1  v2  v3(tied)  v4
    stage 0 holds:   v0  v1      v3
    stage 1 holds:           v2  v3        v4

The first stage that holds a variable owns it: its value is the one read back
(``get_weights``, checkpoints), its regularization is counted there, and the gradient norm
counts it once. Every holder applies the same update: the gradients of all copies are summed
(the tie group's reduction, after the replica all-reduce) and every copy's optimizer gets that
sum, so the copies stay equal step after step.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hybrid.engine import keras_private
from hybrid.engine.model.sparse import concat

__all__ = ["Placement", "TracedReads", "device_copy", "next_step_reads", "sum_tied"]

Location = tuple[int, int]  # (model stage, index in that stage's variables or trainables)


@dataclasses.dataclass(frozen=True)
class Placement:
    """The stages holding each model variable.

    Attributes:
      variables: the model's variables, in ``model.weights`` order.
      holders: ``holders[i]``: the (stage, index into its ``templates``) of every copy of
        variable i, the owner first.
      trainable: ``trainable[k]``: for each trainable variable of stage k, the
        (stage, index into its trainables) of every copy, the owner first.
      trained: the same for each trainable variable of the model, in model order.
    """

    variables: tuple[Any, ...]
    holders: tuple[tuple[Location, ...], ...]
    trainable: tuple[tuple[tuple[Location, ...], ...], ...]
    trained: tuple[tuple[Location, ...], ...]

    @classmethod
    def of(cls, variables: Sequence[Any], stages: Sequence[Sequence[Any]]) -> Placement:
        """The placement of ``variables`` when stage k holds the variables ``stages[k]``."""
        where: dict[int, list[Location]] = {id(v): [] for v in variables}
        trained: dict[int, list[Location]] = {id(v): [] for v in variables}
        for k, held in enumerate(stages):
            for j, v in enumerate(held):
                where[id(v)].append((k, j))
            for j, v in enumerate(u for u in held if u.trainable):
                trained[id(v)].append((k, j))
        trainable = tuple(
            tuple(tuple(trained[id(v)]) for v in held if v.trainable) for held in stages
        )
        return cls(
            tuple(variables),
            tuple(tuple(where[id(v)]) for v in variables),
            trainable,
            tuple(tuple(trained[id(v)]) for v in variables if v.trainable),
        )

    def owned(self, k: int) -> list[bool]:
        """For each trainable variable of stage k: whether stage k owns it."""
        return [copies[0][0] == k for copies in self.trainable[k]]

    def ties(self) -> list[tuple[Location, ...]]:
        """The trainable variables held by more than one stage: their copies' locations."""
        groups = {copies for row in self.trainable for copies in row if len(copies) > 1}
        return sorted(groups)

    def gradient_order(self) -> list[Location]:
        """The owner's (stage, trainable index) of each trainable variable, in model order."""
        return [trained[0] for trained in self.trained]

    def read(self, row_values: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
        """The model's weights from ``row_values[k]`` (stage k's values), owners' copies."""
        return [row_values[k][j] for k, j in (copies[0] for copies in self.holders)]

    def spread(self, weights: Sequence[np.ndarray], counts: Sequence[int]) -> list[list[Any]]:
        """Each stage's values (``counts[k]`` of them) from the model's weights.

        Raises:
          ValueError: not one array per model variable, or an array of another shape.
        """
        if len(weights) != len(self.variables):
            raise ValueError(
                f"expected {len(self.variables)} weight arrays, got {len(weights)}: one per "
                "model variable, in the order of model.get_weights()"
            )
        rows: list[list[Any]] = [[None] * n for n in counts]
        for v, value, copies in zip(self.variables, weights, self.holders, strict=True):
            if tuple(np.shape(value)) != tuple(v.shape):
                raise ValueError(
                    f"weight {v.path!r} has shape {tuple(v.shape)}, got an array of shape "
                    f"{tuple(np.shape(value))}"
                )
            for k, j in copies:
                rows[k][j] = value
        return rows


def sum_tied(
    grads: list[list[tf.Tensor]], devices: Sequence[str], ties: Sequence[tuple[Location, ...]]
) -> None:
    """Replaces each tied variable's gradient on every holder by the sum over its holders
    (sparse gradients: their slices concatenated in stage order, as Keras's tape joins the
    slices of several lookups).

    Args:
      grads: ``grads[k]``: stage k's gradients on one replica (changed in place).
      devices: ``devices[k]``: where stage k's copy lives.
      ties: the tie groups (``Placement.ties``).
    """
    for group in ties:
        (owner, _), *_ = group
        parts = [grads[k][j] for k, j in group]
        with tf.device(devices[owner]):
            total = concat(parts) if isinstance(parts[0], tf.IndexedSlices) else tf.add_n(parts)
        for k, j in group:
            grads[k][j] = total


def device_copy(template: Any) -> keras.Variable:
    """A variable on the current device equal to ``template``, with its name, path,
    trainability, regularizer and constraint (what the optimizer and the engine read)."""
    copy = keras.Variable(
        template.numpy(), dtype=template.dtype, trainable=template.trainable, name=template.name
    )
    keras_private.set_variable_path(copy, template.path)
    copy.regularizer = template.regularizer
    copy.constraint = template.constraint
    return copy


_steps_traced = 0  # bumped between the steps of one traced function (next_step_reads)


def next_step_reads() -> None:
    """Makes every :class:`TracedReads` read afresh in the function being traced: the next
    step traced into it reads what the previous one wrote (several steps in one function,
    ``compile(steps_per_execution=N)``)."""
    global _steps_traced
    _steps_traced += 1


class TracedReads:
    """The values of ``variables``, read once per step traced into a function and shared by
    every caller in that step (eager callers read afresh).

    Every action of a training step reads a stage's weights before the step updates them,
    so the M forwards and backwards of a traced step can share one read of each variable
    instead of a read each: fewer ops to trace, order and run, the same values. A function
    of several steps calls :func:`next_step_reads` between them.
    """

    def __init__(self, variables: Sequence[Any]) -> None:
        self.variables = list(variables)
        self._graph: Any = None  # a weak reference to the graph the reads were made in
        self._step = -1  # the _steps_traced they were made at
        self._values: list[tf.Tensor] = []

    def __call__(self) -> list[tf.Tensor]:
        if tf.executing_eagerly():
            return [tf.convert_to_tensor(v) for v in self.variables]
        graph = tf.compat.v1.get_default_graph()
        if self._graph is None or self._graph() is not graph or self._step != _steps_traced:
            self._graph, self._step = weakref.ref(graph), _steps_traced
            self._values = [tf.convert_to_tensor(v) for v in self.variables]
        return list(self._values)
