"""One pipeline stage on one device: its own copy of the layers, its programs, its optimizer.

A :class:`StageReplica` owns a copy of model stage ``k``'s layers, created on its device,
and the XLA programs that run them there:

    forward(x, seed)                -> y            (the last stage: [numerator, denominator]
                                                     of the micro-batch's loss)
    backward(saved, dy, dx?, dW?)   -> dx, [dW]     (B, W, or both: the schedule decides)
    forward_backward(x, dy, seed)   -> y, dx, [dW]  (one program, nothing stored in between)
    apply_gradients([dW])           -> updates the copy with its own optimizer

``forward`` returns a :class:`Saved` record with what the backward needs. Without remat it
holds the forward's activations (a gradient tape around the XLA forward program, whose
intermediate outputs TensorFlow keeps for the XLA backward program). With remat it holds only
the stage input, and the backward runs one XLA program that recomputes the forward and
differentiates it.

Layers run with Keras ``stateless_call``: weight values and non-trainable state come in as
tensors. Random layers (Dropout) get their seed-generator state from ``seed``, a (step,
micro-batch) pair the engine passes in, so a recomputation draws the same numbers as the
forward it repeats.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hybrid.engine.losses import loss_terms
from hybrid.engine.template import seed_generators

__all__ = ["Saved", "StageReplica", "TensorSpec"]

Labels = tuple[Any, Any]  # (y_true, sample_weight or None) of one micro-batch
Grads = tuple[tf.Tensor | None, list[tf.Tensor]]


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
      output: the stage output; on the last stage its loss's [numerator, denominator].
      labels: the micro-batch's (labels, sample weights) (last stage only).
      seed: the random seed the forward used, for an exact recomputation.
      tape: the tape that recorded the forward (None when the backward recomputes).
      weights: the weight values the taped forward read (its gradient sources).
    """

    inputs: tf.Tensor
    output: tf.Tensor
    labels: Labels | None
    seed: tf.Tensor
    tape: tf.GradientTape | None = None
    weights: list[tf.Tensor] = dataclasses.field(default_factory=list)


def _watch(tape: tf.GradientTape, x: tf.Tensor) -> None:
    if x.dtype.is_floating:  # integer inputs (token ids) have no gradient
        tape.watch(x)


def _takes_training(layer: keras.layers.Layer) -> bool:
    return "training" in inspect.signature(layer.call).parameters


def clone_layer(layer: keras.layers.Layer) -> keras.layers.Layer:
    """A fresh, unbuilt layer with the same configuration (weights are copied separately)."""
    return layer.__class__.from_config(layer.get_config())


class StageReplica:
    """Model stage ``index``'s layers copied onto ``device``, with programs and optimizer.

    Args:
      index: the model stage number k.
      layers: the template layers of this stage, built; their weights are copied.
      device: the device that owns the copy, its optimizer state and its programs.
      input_spec: the stage input's shape and dtype (without batch).
      make_optimizer: ``make_optimizer(template variables, this copy's variables)`` returns
        this copy's optimizer (the engine's copy of the one logical optimizer); called once,
        on ``device``.
      loss: the Keras loss, only on the last stage: its forward returns the micro-batch's
        ``[numerator, denominator]`` (``hybrid.engine.losses``).
      jit_compile: compile forward, backward and update into XLA programs on ``device``.
    """

    def __init__(
        self,
        index: int,
        layers: Sequence[keras.layers.Layer],
        device: str,
        input_spec: TensorSpec,
        make_optimizer: Callable[[Sequence[Any], Sequence[Any]], keras.optimizers.Optimizer] | None,
        loss: keras.losses.Loss | None,
        jit_compile: bool = True,
    ) -> None:
        self.index = index
        self.device = device
        self.loss = loss
        with tf.device(device):
            self.layers = [clone_layer(layer) for layer in layers]
            y = tf.convert_to_tensor(input_spec.zeros())
            for copy, template in zip(self.layers, layers, strict=True):
                y = copy(y)
                copy.set_weights(template.get_weights())
            sources = [v for layer in layers for v in layer.trainable_variables]
            self.optimizer = (
                make_optimizer(sources, self.trainable_variables) if make_optimizer else None
            )
            if self.optimizer is not None:
                self.optimizer.build(self.trainable_variables)
        # Seed-generator state variable -> its initial seed: each program sets the state
        # from (this base, step, micro-batch), so a recomputation draws the same numbers.
        self._seed_bases = {
            id(g.state): int(g.state.numpy()[0]) for g in seed_generators(self.layers)
        }

        def program(fn: Callable[..., Any]) -> Any:
            return tf.function(fn, jit_compile=jit_compile, autograph=False)

        self._forward = program(self._run)
        self._forward_backward = program(self._forward_and_backward)
        self._apply = program(self._apply_gradients)

    @property
    def is_last(self) -> bool:
        return self.loss is not None

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

    def _read_weights(self) -> list[tf.Tensor]:
        return [tf.convert_to_tensor(v) for v in self.trainable_variables]

    def _run(
        self,
        x: tf.Tensor,
        labels: Labels | None,
        seed: tf.Tensor,
        weights: list[tf.Tensor],
        training: bool = True,
    ) -> tf.Tensor:
        """The stage's layers on ``x`` with the given weight values; on the last stage, the
        ``[numerator, denominator]`` of the loss against ``labels`` (labels, sample weights).

        The weights come in as tensors (Keras ``stateless_call``) rather than being read
        inside: a taped forward program then hands only activations to its backward
        program, not a copy of every weight it read.
        """
        start = 0
        for layer in self.layers:
            count = len(layer.trainable_variables)
            state = [self._state_value(v, seed) for v in layer.non_trainable_variables]
            kwargs = {"training": training} if _takes_training(layer) else {}
            x, _ = layer.stateless_call(weights[start : start + count], state, x, **kwargs)
            start += count
        if labels is None:
            return x
        assert self.loss is not None
        y_true, sample_weight = labels
        return tf.stack(loss_terms(self.loss, y_true, x, sample_weight))

    def _state_value(self, variable: Any, seed: tf.Tensor) -> tf.Tensor:
        base = self._seed_bases.get(id(variable))
        if base is None:
            return tf.convert_to_tensor(variable)
        return tf.cast(tf.stack([base + seed[0], seed[1]]), variable.dtype)

    def _forward_and_backward(
        self,
        x: tf.Tensor,
        dy: tf.Tensor,
        labels: Labels | None,
        seed: tf.Tensor,
        need_dx: bool,
        need_dw: bool,
    ) -> tuple[tf.Tensor, tf.Tensor | None, list[tf.Tensor]]:
        """One program: the forward, then its gradients against ``dy``; nothing kept between."""
        weights = self._read_weights()
        with tf.GradientTape() as tape:
            _watch(tape, x)
            tape.watch(weights)
            y = self._run(x, labels, seed, weights)
        dx, dw = self._gradients(tape, x, y, dy, weights, need_dx, need_dw)
        return y, dx, dw

    @staticmethod
    def _gradients(
        tape: tf.GradientTape,
        x: tf.Tensor,
        y: tf.Tensor,
        dy: tf.Tensor,
        weights: list[tf.Tensor],
        need_dx: bool,
        need_dw: bool,
    ) -> Grads:
        sources = ([x] if need_dx else []) + (list(weights) if need_dw else [])
        if not sources:
            return None, []
        grads = tape.gradient(y, sources, output_gradients=dy)
        # Embedding lookups give IndexedSlices; accumulation and the all-reduce want dense.
        grads = [
            tf.zeros_like(s) if g is None else tf.convert_to_tensor(g)
            for g, s in zip(grads, sources, strict=True)
        ]
        if need_dx:
            return grads[0], grads[1:]
        return None, grads

    def _apply_gradients(self, grads: list[tf.Tensor]) -> None:
        assert self.optimizer is not None
        self.optimizer.apply(grads, self.trainable_variables)

    # -- what the engine calls, inside its step function, under tf.device(self.device) --

    def forward(
        self, x: tf.Tensor, labels: Labels | None, seed: tf.Tensor, remat: bool, split: bool
    ) -> Saved:
        """Runs the forward program; keeps activations for the backward unless ``remat``.

        Args:
          split: the backward will come as two calls (B then W), so the tape must persist.
        """
        weights = self._read_weights()
        if remat:
            return Saved(x, self._forward(x, labels, seed, weights), labels, seed)
        with tf.GradientTape(persistent=split) as tape:
            _watch(tape, x)
            tape.watch(weights)
            y = self._forward(x, labels, seed, weights)
        return Saved(x, y, labels, seed, tape, weights)

    def infer(self, x: tf.Tensor, labels: Labels | None, seed: tf.Tensor) -> tf.Tensor:
        """Forward in inference mode (``training=False``), nothing kept for a backward."""
        return self._forward(x, labels, seed, self._read_weights(), training=False)

    def backward(self, saved: Saved, dy: tf.Tensor, need_dx: bool, need_dw: bool) -> Grads:
        """Input gradient (when ``need_dx``) and weight gradients (when ``need_dw``) of
        ``dy · ∂output``; recomputes the forward first if the forward kept no tape."""
        if not (need_dx or need_dw):
            return None, []
        if saved.tape is None:
            _, dx, dw = self._forward_backward(
                saved.inputs, dy, saved.labels, saved.seed, need_dx, need_dw
            )
            return dx, dw
        return self._gradients(
            saved.tape, saved.inputs, saved.output, dy, saved.weights, need_dx, need_dw
        )

    def forward_backward(
        self, x: tf.Tensor, labels: Labels | None, seed: tf.Tensor, dy: tf.Tensor, need_dx: bool
    ) -> tuple[tf.Tensor, tf.Tensor | None, list[tf.Tensor]]:
        """F immediately followed by its whole backward, as one program.

        Used when the schedule runs a micro-batch's backward right after its forward on the
        same device (the last stage, whose output gradient is known): no activation is
        stored and nothing is recomputed.
        """
        return self._forward_backward(x, dy, labels, seed, need_dx, True)

    def apply_gradients(self, grads: list[tf.Tensor]) -> None:
        """Updates this copy's variables with its own optimizer."""
        self._apply(grads)

    def weight_penalty(self) -> tuple[tf.Tensor, list[tf.Tensor]] | None:
        """This stage's weight regularization, as Keras adds it to the loss once per step:
        the sum of ``variable.regularizer(variable)`` over its trainable variables that have
        one (kernel and bias regularizers), and its gradient per trainable variable; None
        when no variable is regularized."""
        variables = self.trainable_variables
        if not any(getattr(v, "regularizer", None) for v in variables):
            return None
        weights = self._read_weights()
        with tf.GradientTape() as tape:
            tape.watch(weights)
            penalty = tf.add_n(
                [
                    tf.cast(tf.reduce_sum(v.regularizer(w)), tf.float32)
                    for v, w in zip(variables, weights, strict=True)
                    if getattr(v, "regularizer", None)
                ]
            )
        grads = tape.gradient(penalty, weights)
        return penalty, [
            tf.zeros_like(w) if g is None else g for g, w in zip(grads, weights, strict=True)
        ]
