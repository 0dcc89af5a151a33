"""What a layer costs, for balancing stages: its parameter count or its measured time.

``Pipeline(balance="params")`` cuts the model where parameter counts balance;
``balance="time"`` where the measured forward+backward seconds of each layer balance.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import keras
import tensorflow as tf

__all__ = ["block", "parameter_costs", "time_costs"]


def parameter_costs(layers: Sequence[keras.layers.Layer]) -> list[float]:
    """The number of weights of each (built) layer."""
    return [float(layer.count_params()) for layer in layers]


def time_costs(
    layers: Sequence[keras.layers.Layer],
    inputs: Sequence[tf.Tensor],
    device: str,
    repeats: int = 5,
    jit_compile: bool = True,
) -> list[float]:
    """Median seconds of one forward + backward of each layer on ``device``.

    Args:
      layers: the built layers, in model order.
      inputs: a sample input batch for each layer (the micro-batch the pipeline will run).
      device: where to measure (the first device of the mesh).
      repeats: timed runs per layer after one warm-up (which also compiles).
    """
    costs = []
    for layer, x in zip(layers, inputs, strict=True):

        def step(x: tf.Tensor, layer: keras.layers.Layer = layer) -> list[tf.Tensor]:
            with tf.GradientTape() as tape:
                if x.dtype.is_floating:
                    tape.watch(x)
                y = layer(x, training=True)
                target = tf.reduce_sum(tf.cast(y, tf.float32))
            sources = ([x] if x.dtype.is_floating else []) + list(layer.trainable_variables)
            grads = tape.gradient(target, sources) if sources else []
            return [target] + [g for g in grads if g is not None]

        with tf.device(device):
            program = tf.function(step, jit_compile=jit_compile)
            x = tf.identity(x)
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
