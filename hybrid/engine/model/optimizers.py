"""The one logical optimizer over the whole model, as copies per stage device: every stage
device gets a copy with the same class, hyper-parameters and weight-decay exclusions (mapped
onto the stage's copies of the variables), and ``global_clipnorm`` is applied by the engine
to the norm over every stage's gradients, not by each copy to its own. An optimizer whose
copies would differ from it is refused, naming the settings and what to do instead.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import keras
import numpy as np

from hybrid.engine import keras_private

__all__ = ["OptimizerCopies", "OptimizerLike", "optimizer_copies", "slots_per_weight"]

OptimizerLike: TypeAlias = Any  # a keras.optimizers.Optimizer, a name, or a zero-argument factory


@dataclasses.dataclass(frozen=True)
class OptimizerCopies:
    """Makes each stage device's copy of the one logical optimizer.

    Attributes:
      make: a new optimizer equal to the user's (its class and configuration, or the user's
        factory).
      source: the user's optimizer instance, whose weight-decay exclusions every copy gets;
        None for a factory (each of its optimizers configures itself).
      global_clipnorm: the clip norm over every stage's gradients (the engine clips; the
        copies never clip by their own stage's norm), or None.
      loss_scaling: the copies are ``LossScaleOptimizer``s: the engine scales the loss by
        their (equal) dynamic scale and makes the finite check global (a non-finite gradient
        on any stage is one on every stage).
    """

    make: Callable[[], keras.optimizers.Optimizer]
    source: keras.optimizers.Optimizer | None
    global_clipnorm: float | None
    loss_scaling: bool = False

    def __call__(
        self, source_variables: Sequence[Any], stage_variables: Sequence[Any]
    ) -> keras.optimizers.Optimizer:
        """A copy for the stage variables ``stage_variables`` (copies of ``source_variables``)."""
        copy = self.make()
        inner, source = _inner(copy), _inner(self.source) if self.source else None
        inner.global_clipnorm = None
        if source is not None:
            keras_private.copy_weight_decay_exclusions(
                source, inner, source_variables, stage_variables
            )
        return copy


def slots_per_weight(copies: OptimizerCopies) -> int:
    """The optimizer state one weight gets, in weights of its size (Adam 2, Adam with
    ``use_ema`` 3, SGD with momentum 1, SGD 0): counted on a fresh copy built for a probe
    variable, so every optimizer (and LossScaleOptimizer, EMA, AMSGrad) counts itself."""
    shape = (3, 7)
    probe = keras.Variable(np.zeros(shape, np.float32), trainable=True, name="probe")
    optimizer = copies.make()
    optimizer.build([probe])
    return sum(1 for v in optimizer.variables if tuple(v.shape) == shape)


def _inner(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that updates the variables (a LossScaleOptimizer's inner one)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


_PLAIN = (bool, int, float, str, type(None))


def _settings(optimizer: Any) -> dict[str, Any]:
    """The optimizer's attributes that are plain values (hyper-parameters, flags), its inner
    optimizer's under ``inner.``."""
    found = {
        name: value
        for name, value in vars(optimizer).items()
        if isinstance(value, _PLAIN) and name != "built"
    }
    inner = vars(optimizer).get("inner_optimizer")
    if isinstance(inner, keras.optimizers.Optimizer):
        found.update({f"inner.{k}": v for k, v in _settings(inner).items()})
    return found


def _check_copy(optimizer: keras.optimizers.Optimizer, made: keras.optimizers.Optimizer) -> None:
    """Refuses an optimizer whose copies (``from_config(get_config())``) would differ from
    it: a subclass holding a setting its ``get_config`` leaves out."""
    given, copied = _settings(optimizer), _settings(made)
    differ = {k: (v, copied.get(k)) for k, v in given.items() if copied.get(k, v) != v}
    if differ or type(made) is not type(optimizer):
        raise ValueError(
            f"{type(optimizer).__name__}.from_config(get_config()) does not reproduce the "
            f"optimizer (attribute: (given, copy) = {differ}); every stage device needs its "
            "own copy: return those settings from get_config(), or pass a zero-argument "
            "factory that builds the optimizer"
        )


def optimizer_copies(optimizer: OptimizerLike, scale_loss: bool = False) -> OptimizerCopies:
    """The copies of ``optimizer``: an instance (used as the template), a name (as
    ``compile`` takes it) or a factory.

    Args:
      scale_loss: wrap the optimizer in a ``LossScaleOptimizer`` unless it is one, as
        ``compile`` does for a model whose dtype policy is ``mixed_float16``.

    Raises:
      TypeError: neither an optimizer nor a zero-argument factory.
      ValueError: an optimizer whose copies differ from it (a subclass that keeps
        settings outside ``get_config``).
    """
    if isinstance(optimizer, str):  # a name, as compile takes it: "adam", "sgd", ...
        optimizer = keras.optimizers.get(optimizer)
    if scale_loss and isinstance(optimizer, keras.optimizers.Optimizer):
        if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    if isinstance(optimizer, keras.optimizers.Optimizer):
        cls, config = optimizer.__class__, optimizer.get_config()
        probe, source = optimizer, optimizer

        def make() -> keras.optimizers.Optimizer:
            return cls.from_config(copy.deepcopy(config))  # from_config may consume it

        _check_copy(optimizer, make())

    elif callable(optimizer):
        probe, source, make = optimizer(), None, optimizer
    else:
        raise TypeError(
            "optimizer must be a keras.optimizers.Optimizer, a name or a zero-argument "
            f"factory, got {type(optimizer).__name__}"
        )
    scaling = isinstance(probe, keras.optimizers.LossScaleOptimizer)
    return OptimizerCopies(make, source, _inner(probe).global_clipnorm, scaling)
