"""What a layer costs, for balancing stages: its parameter count or its measured time.

``Pipeline(balance="params")`` cuts the model where parameter counts balance;
``balance="time"`` where the measured forward+backward seconds of each layer balance.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

__all__ = ["block", "parameter_costs", "time_costs"]


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
                y = layer(x, training=True)
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
