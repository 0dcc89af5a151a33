"""What a layer costs, for balancing stages: its estimated compute, its parameter count,
its measured time, or the bytes it holds.

``Pipeline(balance="compute")`` (the default) cuts the model where the estimated work of
each layer call (:func:`compute_costs`, from shapes, no run) balances;
``balance="params"`` where parameter counts balance;
``balance="time"`` where the measured forward+backward seconds of each layer balance;
``balance="memory"`` where the largest stage's peak bytes (:mod:`hybrid.core.memory`, from
the estimate of :func:`layer_bytes`) is smallest.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hybrid.core import memory
from hybrid.engine import keras_private

__all__ = [
    "block",
    "call_work",
    "compute_costs",
    "layer_bytes",
    "parameter_costs",
    "time_costs",
    "weight_bytes",
]


def call_work(layer: Any, inputs: Sequence[Any], output: Any) -> float:
    """The estimated work of one call of ``layer`` per example, in multiply-adds, from the
    shapes of its input and (first) output tensors, batch axis first; no run::

        weights × positions    every weight the call reads applied at each position of its
                               output (the shape without batch and last axis): a Dense's
                               or a convolution's multiply-adds, exactly (a depthwise one's
                               too); a normalization's few operations per element
        + attention scores     each MultiHeadAttention in it (itself or a block holding
                               one): heads × (key_dim + value_dim) × T² over its T
                               positions (self-attention)
        + output elements      the elementwise work every call does (an activation, an
                               addition, a pooling)

    A call whose inputs are all integers (an embedding's token ids) looks rows up: it counts
    its output elements alone (the same embedding called on floats as a tied output head
    multiplies). Parameters sit at the end of a CNN and its compute at the start, which is
    why this, not the parameter count, is what the default cut balances.
    """
    dims = [int(d or 1) for d in output.shape[1:]]
    positions = math.prod(dims[:-1]) if dims else 1
    elements = float(math.prod(dims)) if dims else 1.0
    if inputs and all(_is_integer(t) for t in inputs):
        return elements
    weights = sum(math.prod(v.shape) for v in _distinct(getattr(layer, "weights", [])))
    scores = sum(
        a.num_heads * (a.key_dim + (a.value_dim or a.key_dim)) * positions**2
        for a in keras_private.sublayers(layer)
        if isinstance(a, keras.layers.MultiHeadAttention)
    )
    return float(weights * positions + scores) + elements


def compute_costs(calls: Sequence[Any], values: dict[int, Any]) -> list[float]:
    """:func:`call_work` of each call of the flattened graph, ``values`` its traced tensors
    (at any batch size, concrete or symbolic)."""
    return [
        call_work(call.layer, [values[k] for k in call.inputs], values[call.outputs[0]])
        for call in calls
    ]


def _is_integer(t: Any) -> bool:
    dtype = tf.as_dtype(getattr(t.dtype, "name", t.dtype))
    return bool(dtype.is_integer or dtype.is_bool)


def _distinct(variables: Sequence[Any]) -> list[Any]:
    return list({id(v): v for v in variables}.values())


def parameter_costs(layers: Sequence[keras.layers.Layer]) -> list[float]:
    """The number of weights of each (built) layer."""
    return [
        float(layer.count_params()) if isinstance(layer, keras.layers.Layer) else 0.0
        for layer in layers
    ]


def time_costs(
    layers: Sequence[keras.layers.Layer],
    inputs: Sequence[Any],
    device: str,
    repeats: int = 5,
    jit_compile: bool = True,
) -> list[float]:
    """Median seconds of one forward + backward of each layer on ``device``.

    Args:
      layers: the built layers, in model order.
      inputs: a sample input batch for each layer (the micro-batch the pipeline will run;
        a list for a layer taking several tensors).
      device: where to measure (the first device of the mesh).
      repeats: timed runs per layer after one warm-up (which also compiles).
    """
    costs = []
    for layer, x in zip(layers, inputs, strict=True):

        def step(x: Any, layer: keras.layers.Layer = layer) -> list[tf.Tensor]:
            floats = [t for t in tf.nest.flatten(x) if t.dtype.is_floating]
            with tf.GradientTape() as tape:
                tape.watch(floats)
                y = keras_private.with_training(layer, True)(x)  # only where call takes it
                target = tf.add_n(
                    [tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(y)]
                )
            sources = floats + list(getattr(layer, "trainable_variables", []))
            grads = tape.gradient(target, sources) if sources else []
            return [target] + [g for g in grads if g is not None]

        with tf.device(device):
            program = tf.function(step, jit_compile=jit_compile)
            x = tf.nest.map_structure(tf.identity, x)
            block(program(x))
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                block(program(x))
                times.append(time.perf_counter() - start)
        costs.append(sorted(times)[len(times) // 2])
    return costs


def block(tensors: Sequence[tf.Tensor]) -> None:
    """Waits until every tensor is computed (copying it to the host)."""
    for t in tensors:
        t.numpy()


def layer_bytes(
    calls: Sequence[Any], values: dict[int, Any], inputs: Sequence[int]
) -> memory.LayerBytes:
    """Each call's bytes estimated from shapes, activations per example (scale them with
    :func:`hybrid.core.memory.scaled` to a micro-batch)::

        params   its layer's weights (a layer called twice counts on each call)
        output   its outputs, per example (``values``: every tensor, traced at any batch)
        stored   = output (what its backward reads: the next call's input, or its own)
        working  = 2 · output (the output's gradient and the one it passes back, beside
                   the output)

    ``hybrid.plan`` measures what each layer holds instead; this needs no measurement.
    """
    output = [sum(_example_bytes(values[k]) for k in call.outputs) for call in calls]
    return memory.LayerBytes(
        params=[weight_bytes(getattr(c.layer, "weights", [])) for c in calls],
        stored=output,
        working=[2 * x for x in output],
        output=output,
        model_input=float(sum(_example_bytes(values[k]) for k in inputs)),
    )


def weight_bytes(variables: Sequence[Any]) -> float:
    """Bytes of ``variables`` (each once)."""
    return float(sum(_bytes(v) for v in _distinct(variables)))


def _bytes(v: Any) -> int:
    return int(np.prod(v.shape)) * _itemsize(v.dtype)


def _itemsize(dtype: Any) -> int:
    return int(tf.as_dtype(getattr(dtype, "name", dtype)).size)


def _example_bytes(t: Any) -> float:
    """Bytes of one example of tensor ``t`` (its shape without the batch axis)."""
    return float(np.prod([d or 1 for d in t.shape[1:]])) * _itemsize(t.dtype)
