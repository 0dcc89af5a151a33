"""The one optimizer over the whole model, as a user and Keras's callbacks see it.

Every stage device holds its own copy of the optimizer (``hybrid.engine.model.optimizers``);
``pipe.optimizer`` is the optimizer Keras would have built on the model's trainable
variables, over those copies:

    read an attribute            every copy holds the same value: the first copy's
    optimizer.variables          Keras's order (``optimizer_state.logical_variables``): for
                                 each, the copy of the stage that owns its model variable
    write a variable             (``learning_rate.assign(x)``, ``iterations.assign_add(1)``,
                                 ``set_weights``, ``load_own_variables``, ...) every copy
                                 holding it is written: each variable of the list above
                                 mirrors its eager writes to the others
    set a hyper-parameter        (``optimizer.learning_rate = x``, ``optimizer.beta_1 = x``)
                                 set on every copy
    anything that would act      (``apply_gradients``, ``build``, private state such as the
    on one copy                  EMA averages ``SwapEMAWeights`` swaps) refused, naming
                                 what to do instead

Writes traced into a function (the engine's own update programs) are not mirrored: each
copy's program updates its own variables, and they stay equal because every copy takes the
same update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

__all__ = ["LogicalOptimizer"]

_PLAIN = (bool, int, float, str, type(None))
# Methods that only read: allowed on the first copy.
_READS = frozenset({"get_config", "from_config"})
# Settings a copy must not take after it was built: the engine owns global_clipnorm (it
# clips by the norm over every stage), the others decide which variables exist.
_STRUCTURAL = {
    "global_clipnorm": "the engine clips by the norm over every stage's gradients; pass "
    "global_clipnorm to the optimizer given to compile()",
    "use_ema": "it decides which variables the optimizer holds; set it on the optimizer "
    "given to compile()",
    "amsgrad": "it decides which variables the optimizer holds; set it on the optimizer "
    "given to compile()",
    "gradient_accumulation_steps": "it decides which variables the optimizer holds; set it "
    "on the optimizer given to compile()",
    "name": "every copy's variables are named after it",
}


class LogicalOptimizer:
    """The one optimizer over every stage device's copy (see the module docstring).

    Args:
      copies: every stage device's copy (stage by stage, replica by replica), or their
        inner optimizers (``inner_optimizer`` of a ``LossScaleOptimizer``).
      variables: the variables of the optimizer Keras would build, in its order, each as
        the copies holding it (the first mirrored to the others); None for an inner
        optimizer's view (whose state is read and written through the outer one).
    """

    def __init__(
        self,
        copies: Sequence[keras.optimizers.Optimizer],
        variables: Sequence[Sequence[Any]] | None,
    ) -> None:
        object.__setattr__(self, "_copies", list(copies))
        object.__setattr__(self, "_variables", variables)

    @property
    def copies(self) -> list[keras.optimizers.Optimizer]:
        """Every stage device's copy (each one device's own: a write to one of them, but
        through ``variables``' first copies, reaches that device alone)."""
        return list(self._copies)

    def __repr__(self) -> str:
        first = self._copies[0]
        return f"<LogicalOptimizer {type(first).__name__} over {len(self._copies)} copies>"

    # -- reads ----------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        first = self._copies[0]
        if name.startswith("_"):
            raise AttributeError(
                f"pipe.optimizer.{name} is one device's private state of "
                f"{type(first).__name__} (Keras's SwapEMAWeights reads such state): the "
                "pipeline cannot hand it out as the whole model's; read the optimizer's "
                "variables through pipe.optimizer.variables, or each device's through "
                "pipe.optimizer.copies"
            )
        value = getattr(first, name)
        if isinstance(value, keras.optimizers.Optimizer):  # a LossScaleOptimizer's inner
            return LogicalOptimizer([getattr(c, name) for c in self._copies], None)
        if callable(value) and not isinstance(value, keras.Variable) and name not in _READS:
            raise AttributeError(
                f"pipe.optimizer.{name}() would act on one device's copy of the optimizer: "
                "the pipeline's step applies the gradients on every device; change the "
                "optimizer through its variables (pipe.optimizer.learning_rate.assign(x), "
                "set_weights, load_own_variables) or its settings "
                "(pipe.optimizer.learning_rate = x), which reach every copy"
            )
        return value

    @property
    def variables(self) -> list[Any]:
        """The optimizer's variables in Keras's order (``keras.Optimizer.variables`` of the
        same optimizer built on the model): the owning stage's copy of each, whose writes
        reach every copy."""
        return [copies[0] for copies in self._logical("variables")]

    def _logical(self, what: str) -> Sequence[Sequence[Any]]:
        if self._variables is None:
            raise AttributeError(
                f"pipe.optimizer.inner_optimizer.{what}: read and write the optimizer's "
                f"state through pipe.optimizer.{what}"
            )
        return self._variables

    # -- writes ---------------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        first = self._copies[0]
        if name in _STRUCTURAL:
            raise AttributeError(
                f"cannot set {name!r} on the pipeline's optimizer: {_STRUCTURAL[name]}"
            )
        settable = name == "learning_rate" or (
            not name.startswith("_") and isinstance(getattr(first, name, object()), _PLAIN)
        )
        if not settable:
            raise AttributeError(
                f"cannot set {name!r} on the pipeline's optimizer: only its hyper-parameters "
                "(learning_rate, beta_1, weight_decay, ...) are set on every device's copy; "
                "write its variables through pipe.optimizer.variables"
            )
        for optimizer in self._copies:
            setattr(optimizer, name, value)

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Sets every variable (order as :attr:`variables`) on every copy holding it, as
        ``keras.Optimizer.set_weights``.

        Raises:
          ValueError: a count or a shape that differs from the variables'.
        """
        variables = self.variables
        if len(weights) != len(variables):
            raise ValueError(
                f"the optimizer has {len(variables)} variables, got {len(weights)} weights; "
                "pass one array per variable of pipe.optimizer.variables"
            )
        for variable, weight in zip(variables, weights, strict=True):
            if tuple(variable.shape) != tuple(np.shape(weight)):
                raise ValueError(
                    f"optimizer variable {variable.name!r} has shape {tuple(variable.shape)}, "
                    f"got {tuple(np.shape(weight))}"
                )
        for variable, weight in zip(variables, weights, strict=True):
            variable.assign(weight)

    def save_own_variables(self, store: dict[str, Any]) -> None:
        """``keras.Optimizer.save_own_variables``: ``store[str(i)]`` for variable i."""
        for i, variable in enumerate(self.variables):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store: Mapping[str, Any]) -> None:
        """``keras.Optimizer.load_own_variables`` onto every copy.

        Raises:
          ValueError: a store of another optimizer (its count of variables differs; Keras
            warns and skips the load, which here would leave the state unloaded silently).
        """
        variables = self.variables
        if len(store.keys()) != len(variables):
            raise ValueError(
                f"the store holds {len(store.keys())} optimizer variables, the pipeline's "
                f"{type(self._copies[0]).__name__} has {len(variables)}; load a store saved "
                "from the same optimizer on the same model"
            )
        self.set_weights([store[str(i)] for i in range(len(variables))])
