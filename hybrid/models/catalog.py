"""What each reference model is, without building it (no TensorFlow).

The launcher validates flags against these facts before the TensorFlow runtime starts.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["MODEL_NAMES", "num_layers"]

# Layers in the list each model function returns, as a function of its depth.
_LAYERS: dict[str, Callable[[int], int]] = {
    "transformer": lambda depth: depth + 3,  # embedding, blocks, final norm, head
    "resnet": lambda depth: depth + 3,  # stem, blocks, pooling, head
    "mlp": lambda depth: 3 * depth + 1,  # (dense, norm, activation) per block, head
}
MODEL_NAMES = tuple(sorted(_LAYERS))


def num_layers(model: str, depth: int) -> int:
    """How many layers (cut points + 1) ``model`` has at ``depth`` blocks."""
    if model not in _LAYERS:
        raise ValueError(f"unknown model {model!r}; choose one of {list(MODEL_NAMES)}")
    return _LAYERS[model](depth)
