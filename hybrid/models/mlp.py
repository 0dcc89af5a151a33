"""A multi-layer perceptron: Dense → LayerNorm → activation blocks and a linear head."""

from __future__ import annotations

import keras

__all__ = ["mlp"]


def mlp(
    num_classes: int = 10,
    width: int = 256,
    depth: int = 8,
    activation: str = "gelu",
    seed: int = 0,
) -> list[keras.layers.Layer]:
    """``depth`` blocks of Dense(width) → LayerNorm → activation, then Dense(num_classes).

    Each block is three layers, so balancing can cut between any of them.
    """
    initializer = keras.initializers.GlorotUniform(seed=seed)
    layers: list[keras.layers.Layer] = []
    for i in range(depth):
        layers += [
            keras.layers.Dense(width, kernel_initializer=initializer, name=f"dense_{i}"),
            keras.layers.LayerNormalization(name=f"norm_{i}"),
            keras.layers.Activation(activation, name=f"act_{i}"),
        ]
    layers.append(keras.layers.Dense(num_classes, kernel_initializer=initializer, name="head"))
    return layers
