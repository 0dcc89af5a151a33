"""One pipeline stage on one device: its own copy of the layers, its programs, its optimizer.

A :class:`StageReplica` owns a copy of stage ``s``'s layers, created on its device, and the
XLA programs that run them there:

    forward(x)                 -> y                 (stage 0..S-2)
    forward(x, labels)         -> loss              (last stage: the mean loss of the micro-batch)
    backward(saved, dy)        -> dx, [dW]          (dx omitted on stage 0)
    apply_gradients([dW])      -> updates its variables with its own optimizer

``forward`` returns a :class:`Saved` record with what ``backward`` needs. Without remat it
holds the forward's activations (a gradient tape around the XLA forward program, whose
intermediate outputs TensorFlow keeps for the XLA backward program). With remat it holds only
the stage input, and ``backward`` runs one XLA program that recomputes the forward and
differentiates it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["Saved", "StageReplica", "TensorSpec"]

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape (without the batch dimension) and dtype of a tensor crossing a stage boundary."""

    shape: tuple[int | None, ...]
    dtype: str

    def zeros(self, batch: int = 1) -> np.ndarray:
        return np.zeros((batch,) + tuple(d or 1 for d in self.shape), dtype=self.dtype)


@dataclasses.dataclass
class Saved:
    """What one micro-batch's forward leaves for its backward on this stage.

    Attributes:
      inputs: the stage input (kept in every remat mode).
      output: the stage output, or the micro-batch loss on the last stage.
      labels: the micro-batch labels (last stage only).
      tape: the tape that recorded the forward (None when the backward recomputes).
    """

    inputs: tf.Tensor
    output: tf.Tensor
    labels: tf.Tensor | None = None
    tape: tf.GradientTape | None = None


def _watch(tape: tf.GradientTape, x: tf.Tensor) -> None:
    if x.dtype.is_floating:  # integer inputs (token ids) have no gradient
        tape.watch(x)


def clone_layer(layer: keras.layers.Layer) -> keras.layers.Layer:
    """A fresh, unbuilt layer with the same configuration (weights are copied separately)."""
    return layer.__class__.from_config(layer.get_config())


class StageReplica:
    """Stage ``index``'s layers copied onto ``device``, with their programs and optimizer.

    Args:
      index: the stage number s.
      layers: the template layers of this stage, built; their weights are copied.
      device: the device that owns the copy, its optimizer state and its programs.
      input_spec: the stage input's shape and dtype (without batch).
      optimizer_factory: returns a new Keras optimizer; called once, on ``device``.
      loss_fn: ``loss(y_true, y_pred)``, only on the last stage.
      jit_compile: compile forward, backward and update into XLA programs on ``device``.
    """

    def __init__(
        self,
        index: int,
        layers: Sequence[keras.layers.Layer],
        device: str,
        input_spec: TensorSpec,
        optimizer_factory: Callable[[], keras.optimizers.Optimizer] | None,
        loss_fn: LossFn | None,
        jit_compile: bool = True,
    ) -> None:
        self.index = index
        self.device = device
        self.loss_fn = loss_fn
        with tf.device(device):
            self.layers = [clone_layer(layer) for layer in layers]
            y = tf.convert_to_tensor(input_spec.zeros())
            for copy, template in zip(self.layers, layers, strict=True):
                y = copy(y)
                copy.set_weights(template.get_weights())
            self.optimizer = optimizer_factory() if optimizer_factory else None
            if self.optimizer is not None:
                self.optimizer.build(self.trainable_variables)
        self._forward = tf.function(self._run, jit_compile=jit_compile, autograph=False)
        self._forward_backward = tf.function(
            self._forward_and_backward, jit_compile=jit_compile, autograph=False
        )
        self._apply = tf.function(self._apply_gradients, jit_compile=jit_compile, autograph=False)

    @property
    def is_last(self) -> bool:
        return self.loss_fn is not None

    @property
    def trainable_variables(self) -> list[Any]:
        return [v for layer in self.layers for v in layer.trainable_variables]

    def get_weights(self) -> list[np.ndarray]:
        return [w for layer in self.layers for w in layer.get_weights()]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        start = 0
        for layer in self.layers:
            count = len(layer.weights)
            layer.set_weights(list(weights[start : start + count]))
            start += count

    def num_weights(self) -> int:
        return sum(len(layer.weights) for layer in self.layers)

    # -- the programs --------------------------------------------------------------------

    def _run(
        self, x: tf.Tensor, labels: tf.Tensor | None = None, training: bool = True
    ) -> tf.Tensor:
        """The stage's layers on ``x``; on the last stage, the mean loss against ``labels``."""
        for layer in self.layers:
            x = layer(x, training=training)
        if labels is None:
            return x
        assert self.loss_fn is not None
        return tf.reduce_mean(self.loss_fn(labels, x))

    def _forward_and_backward(
        self, x: tf.Tensor, dy: tf.Tensor, labels: tf.Tensor | None, need_dx: bool
    ) -> tuple[tf.Tensor, tf.Tensor | None, list[tf.Tensor]]:
        """One program: the forward, then its gradients against ``dy``; nothing kept between."""
        with tf.GradientTape() as tape:
            _watch(tape, x)
            y = self._run(x, labels)
        dx, dw = self._gradients(tape, x, y, dy, need_dx)
        return y, dx, dw

    def _gradients(
        self, tape: tf.GradientTape, x: tf.Tensor, y: tf.Tensor, dy: tf.Tensor, need_dx: bool
    ) -> tuple[tf.Tensor | None, list[tf.Tensor]]:
        variables = self.trainable_variables
        sources = ([x] if need_dx else []) + variables
        grads = tape.gradient(y, sources, output_gradients=dy)
        grads = [tf.zeros_like(s) if g is None else g for g, s in zip(grads, sources, strict=True)]
        if need_dx:
            return grads[0], grads[1:]
        return None, grads

    def _apply_gradients(self, grads: list[tf.Tensor]) -> None:
        assert self.optimizer is not None
        self.optimizer.apply(grads, self.trainable_variables)

    # -- what the engine calls, inside its step function, under tf.device(self.device) --

    def forward(self, x: tf.Tensor, labels: tf.Tensor | None, remat: bool) -> Saved:
        """Runs the forward program; keeps activations for the backward unless ``remat``."""
        if remat:
            return Saved(x, self._forward(x, labels), labels)
        with tf.GradientTape() as tape:
            _watch(tape, x)
            y = self._forward(x, labels)
        return Saved(x, y, labels, tape)

    def infer(self, x: tf.Tensor, labels: tf.Tensor | None = None) -> tf.Tensor:
        """Forward in inference mode (``training=False``), nothing kept for a backward."""
        return self._forward(x, labels, training=False)

    def backward(
        self, saved: Saved, dy: tf.Tensor, need_dx: bool
    ) -> tuple[tf.Tensor | None, list[tf.Tensor]]:
        """Input gradient (when ``need_dx``) and weight gradients of ``dy · ∂output``."""
        if saved.tape is None:
            _, dx, dw = self._forward_backward(saved.inputs, dy, saved.labels, need_dx)
            return dx, dw
        return self._gradients(saved.tape, saved.inputs, saved.output, dy, need_dx)

    def forward_backward(
        self, x: tf.Tensor, labels: tf.Tensor | None, dy: tf.Tensor, need_dx: bool
    ) -> tuple[tf.Tensor, tf.Tensor | None, list[tf.Tensor]]:
        """F immediately followed by its B, as one program: output, input and weight grads.

        Used when the schedule runs a micro-batch's backward right after its forward on the
        same device (the last stage, whose output gradient is known): no activation is
        stored and nothing is recomputed.
        """
        return self._forward_backward(x, dy, labels, need_dx)

    def apply_gradients(self, grads: list[tf.Tensor]) -> None:
        """Updates this copy's variables with its own optimizer."""
        self._apply(grads)
