"""The layers' own behaviour the engine checks at build time: state a forward pass updates
(refused where the pipeline cannot honour it, naming the layer and the way around it),
losses added with ``add_loss``, and the random seed generators a stage copies."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from hybrid.engine import keras_private

__all__ = ["adds_loss", "check_layer", "layer_names", "seed_generators", "warn_added_losses"]


def seed_generators(layers: Sequence[keras.layers.Layer]) -> list[Any]:
    """The random seed generators of ``layers`` and the layers inside them."""
    found: list[Any] = []
    for layer in layers:
        for sub in keras_private.sublayers(layer):
            found += [g for g in getattr(sub, "_seed_generators", []) if g not in found]
    return found


def check_layer(layer: keras.layers.Layer, x: Any, y: Any) -> None:
    """Refuses a built layer whose Keras semantics the pipeline cannot honour yet.

    Args:
      layer: the template layer, after its first call.
      x, y: that call's input and output.

    Raises:
      NotImplementedError: non-trainable state updated in the forward pass other than
        BatchNormalization's; the message names the layer and the way around it.
    """
    if not isinstance(layer, keras.layers.Layer):
        return  # a keras.ops operation in a functional graph: no variables, no state
    name = f"layer {layer.name!r} ({type(layer).__name__})"
    batch_norm = isinstance(layer, keras.layers.BatchNormalization) and not layer.renorm
    if not batch_norm and _updates_state(layer, x):
        raise NotImplementedError(
            f"{name} updates its non-trainable state in the forward pass, which the pipeline "
            "cannot combine across micro-batches (BatchNormalization without renorm is "
            "supported); freeze the layer (trainable=False) or use one without state"
        )


def adds_loss(layer: Any) -> bool:
    """Whether the layer's last call added losses with ``add_loss`` (beyond its weights'
    and its activity regularizer's penalties)."""
    if not isinstance(layer, keras.layers.Layer):
        return False
    penalties = sum(1 for v in layer.trainable_weights if getattr(v, "regularizer", None))
    if layer.activity_regularizer is not None:
        penalties += 1
    return len(layer.losses) > penalties


def warn_added_losses(layers: Sequence[keras.layers.Layer], parts: int) -> None:
    """Warns how ``add_loss`` losses combine over ``parts`` micro-batches."""
    warnings.warn(
        f"layers {layer_names([layer.name for layer in layers])} add losses with add_loss; "
        "the pipeline "
        f"adds each micro-batch's value weighted 1/{parts} (their mean over the "
        "micro-batches), which is Keras's value on the whole batch when the added loss is a "
        "mean over the batch's examples (divide a sum by the batch size)",
        stacklevel=3,
    )


def _updates_state(layer: keras.layers.Layer, x: Any) -> bool:
    """Whether a training-mode call of ``layer`` on ``x`` changes a non-trainable variable
    other than a random seed."""
    seeds = {id(g.state) for g in seed_generators([layer])}
    state = layer.non_trainable_variables
    if all(id(v) in seeds for v in state):
        return False
    kwargs = {"training": True} if "training" in inspect.signature(layer.call).parameters else {}
    _, new = layer.stateless_call(layer.trainable_variables, state, x, **kwargs)
    return any(
        id(v) not in seeds and not np.array_equal(np.asarray(v.numpy()), np.asarray(n))
        for v, n in zip(state, new, strict=True)
    )


def layer_names(names: Sequence[str], shown: int = 3) -> str:
    """Layer names as a warning gives them: the first ``shown``, then how many more (a
    model of 34 BatchNormalization layers is not named on one line)."""
    listed = ", ".join(repr(name) for name in names[:shown])
    more = f", ... and {len(names) - shown} more" if len(names) > shown else ""
    return f"[{listed}{more}]"
