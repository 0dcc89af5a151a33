"""What the user hands the engine: the model's layers in order and the optimizer to copy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import keras

__all__ = ["OptimizerLike", "layers_of", "optimizer_factory"]

OptimizerLike: TypeAlias = Any  # a keras.optimizers.Optimizer or a zero-argument factory


def optimizer_factory(optimizer: OptimizerLike) -> Callable[[], keras.optimizers.Optimizer]:
    """A factory making fresh optimizers equal to ``optimizer`` (one per device)."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        cls, config = optimizer.__class__, optimizer.get_config()
        return lambda: cls.from_config(config)
    if callable(optimizer):
        return optimizer
    raise TypeError(
        f"optimizer must be a keras.optimizers.Optimizer or a zero-argument factory, got "
        f"{type(optimizer).__name__}"
    )


def layers_of(model: keras.Model | Sequence[keras.layers.Layer]) -> list[keras.layers.Layer]:
    """The layers the model applies in order (a Sequential's, or the list given)."""
    if isinstance(model, keras.Sequential):
        layers = list(model.layers)
    elif isinstance(model, Sequence) and not isinstance(model, str):
        layers = list(model)
    else:
        raise TypeError(
            f"model must be a keras.Sequential or a list of Keras layers, got "
            f"{type(model).__name__}; cut functional models into a list of layers first"
        )
    for i, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(f"model layer {i} is {type(layer).__name__}, not a Keras layer")
    if not layers:
        raise ValueError("the model has no layers")
    return layers
