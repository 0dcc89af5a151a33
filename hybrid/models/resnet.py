"""A small ResNet-style CNN as a list of layers that cuts into stages.

    images (B, H, W, C) ─ Conv 3×3 (width) ─ N × residual block ─ global average ─ Dense(classes)

    residual block:  y = relu(x + LN(conv(relu(LN(conv(x))))))      (two 3×3 convolutions)

LayerNormalization over channels stands in for BatchNormalization, whose moving statistics
are state a recomputed forward would update twice (see docs/limits.md). Each
residual block is one layer, so the model is a plain sequence of N + 3 layers.
"""

from __future__ import annotations

from typing import Any

import keras

__all__ = ["ResidualBlock", "resnet"]


@keras.saving.register_keras_serializable(package="hybrid")
class ResidualBlock(keras.layers.Layer):
    """Two 3×3 convolutions with LayerNorm and a skip connection; keeps the shape."""

    def __init__(self, channels: int, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.channels, self.seed = channels, seed
        init = keras.initializers.HeNormal(seed=seed)
        self.conv1 = keras.layers.Conv2D(
            channels, 3, padding="same", kernel_initializer=init, name="conv1"
        )
        self.norm1 = keras.layers.LayerNormalization(name="norm1")
        self.conv2 = keras.layers.Conv2D(
            channels, 3, padding="same", kernel_initializer=init, name="conv2"
        )
        self.norm2 = keras.layers.LayerNormalization(name="norm2")

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        if input_shape[-1] != self.channels:
            raise ValueError(
                f"ResidualBlock({self.channels}) got {input_shape[-1]} input channels; "
                "the skip connection needs equal channel counts"
            )
        for layer in (self.conv1, self.norm1, self.conv2, self.norm2):
            layer.build(input_shape)

    def call(self, x: Any) -> Any:
        h = keras.ops.relu(self.norm1(self.conv1(x)))
        return keras.ops.relu(x + self.norm2(self.conv2(h)))

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return input_shape

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "channels": self.channels, "seed": self.seed}


def resnet(
    num_classes: int = 10, width: int = 16, num_blocks: int = 4, seed: int = 0
) -> list[keras.layers.Layer]:
    """A 3×3 stem convolution to ``width`` channels, ``num_blocks`` residual blocks, global
    average pooling and a linear head: images (B, H, W, C) -> logits (B, num_classes)."""
    init = keras.initializers.HeNormal(seed=seed)
    layers: list[keras.layers.Layer] = [
        keras.layers.Conv2D(
            width, 3, padding="same", activation="relu", kernel_initializer=init, name="stem"
        )
    ]
    layers += [ResidualBlock(width, seed=seed + 10 + i, name=f"res_{i}") for i in range(num_blocks)]
    layers += [
        keras.layers.GlobalAveragePooling2D(name="pool"),
        keras.layers.Dense(
            num_classes,
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1),
            name="head",
        ),
    ]
    return layers
