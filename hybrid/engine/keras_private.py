"""The Keras internals the engine relies on, in one place (``tests/test_keras_private.py``
pins each behaviour, so a Keras upgrade that changes one fails there first).

- ``same_rank``: how ``Loss.__call__`` lines up per-element loss values and sample weights
  (``keras.src.losses.loss.squeeze_or_expand_to_same_rank``).
- ``loss_function``: the ``keras.losses.Loss`` that ``compile`` makes of a plain loss
  function (``keras.src.losses.losses.LossFunctionWrapper``, mean over the batch).
- ``output_mask``: the mask a layer attaches to its output (``keras.src.backend``).
- ``copy_weight_decay_exclusions``: ``Optimizer.exclude_from_weight_decay`` keeps the
  excluded variables by identity and the name patterns as a regex in private attributes, which
  ``get_config`` does not carry; a copy of the optimizer for a stage's variables gets the
  same exclusions, mapped onto the stage's copies of the variables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
from keras.src.backend import get_keras_mask
from keras.src.losses.loss import squeeze_or_expand_to_same_rank
from keras.src.losses.losses import LossFunctionWrapper

__all__ = ["copy_weight_decay_exclusions", "loss_function", "output_mask", "same_rank"]


def same_rank(values: Any, weights: Any) -> tuple[Any, Any]:
    """``values`` and ``weights`` with the rank Keras gives them before multiplying."""
    return squeeze_or_expand_to_same_rank(values, weights)


def copy_weight_decay_exclusions(
    source: keras.optimizers.Optimizer,
    target: keras.optimizers.Optimizer,
    source_variables: Sequence[Any],
    target_variables: Sequence[Any],
) -> None:
    """Gives ``target`` (not built yet) the exclusions of ``source``, where
    ``target_variables[i]`` is the copy of ``source_variables[i]``."""
    excluded: set[int] = getattr(source, "_exclude_from_weight_decay", None) or set()
    target._exclude_from_weight_decay = {
        target._var_key(copy)
        for original, copy in zip(source_variables, target_variables, strict=True)
        if source._var_key(original) in excluded
    }
    target._exclude_from_weight_decay_pattern = getattr(
        source, "_exclude_from_weight_decay_pattern", None
    )
    target._exclude_from_weight_decay_cache = {}


def output_mask(tensor: Any) -> Any:
    """The Keras mask a layer attached to its output, or None."""
    return get_keras_mask(tensor)


def loss_function(fn: Callable[[Any, Any], Any]) -> keras.losses.Loss:
    """``fn(y_true, y_pred)`` (per-example values) as the Loss ``compile`` would use."""
    return LossFunctionWrapper(fn, reduction="sum_over_batch_size")
