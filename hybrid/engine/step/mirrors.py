"""Writes that reach every copy: each device holds its own copy of the model's variables
and of the optimizer's, so a variable handed to the user (an optimizer variable of
``pipe.optimizer``, a weight of the user's own model) mirrors its eager writes to the copies
it stands for::

    first.assign(x)      # also: for other in others: other.assign(x)

Writes traced into a function (the engine's programs, which write each copy themselves) are
not mirrored. The mirror holds the other copies weakly: a pipeline that is gone stops
receiving the writes of the model it was built from.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from hybrid.engine import keras_private
from hybrid.engine.model.variables import Placement
from hybrid.engine.step.stage import StageReplica

__all__ = ["mirror", "mirror_model"]


def mirror(groups: Sequence[Sequence[Any]]) -> None:
    """Makes the first variable of each group write its eager writes to the others."""
    for first, *others in groups:
        if others:
            keras_private.mirror_writes(first, _writer(others))


def mirror_model(stages: Sequence[Sequence[StageReplica]], placement: Placement) -> None:
    """Makes each variable of the user's model (the template the stages were copied from)
    write its eager writes to every device's copy of it: ``model.set_weights``,
    ``load_weights`` or ``layer.kernel.assign`` after the pipeline is built train on."""
    mirror(
        [
            [template, *(copy.variables[j] for k, j in holders for copy in stages[k])]
            for template, holders in zip(placement.variables, placement.holders, strict=True)
        ]
    )


def _writer(others: Sequence[Any]) -> Callable[[Any], None]:
    refs = [weakref.ref(other) for other in others]

    def write(value: Any) -> None:
        for ref in refs:
            other = ref()
            if other is not None:
                other.assign(value)

    return write
