"""Where each variable of the one logical optimizer lives among the stage copies' optimizers.

A copy's optimizer holds two kinds of variables:

    scalars   its own step count, learning rate, a LossScaleOptimizer's dynamic scale:
              equal on every copy, found by name (``inner_<name>`` for a
              LossScaleOptimizer's inner optimizer; names, unlike paths, are equal on
              every copy)
    slots     one per (model variable, slot name) ("momentum", "velocity", "average"):
              Keras names a slot ``{variable.path with '/' -> '_'}_{slot}``, so the
              longest matching prefix identifies its model variable

The logical optimizer is the one Keras would build on ``model.trainable_variables``: its
:func:`logical_variables` are, in Keras's order, every copy holding each of its variables
(every replica, and every stage of a tied variable; with sharded optimizer states only
the replica that owns a slot). Checkpoints and ``pipe.optimizer`` both read this map.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras

from hybrid.engine.model.variables import Placement
from hybrid.engine.step.stage import StageReplica

__all__ = [
    "SlotKey",
    "global_indices",
    "is_scalar",
    "keras_order",
    "logical_variables",
    "row_slots",
    "scalars",
    "slots",
]

SlotKey = tuple[int, str]  # (model variable index, slot name)


def is_scalar(variable: Any) -> bool:
    return len(variable.shape) == 0


def optimizer_of(stage: StageReplica) -> keras.optimizers.Optimizer:
    """The copy's optimizer; ValueError for a stage without one."""
    if stage.optimizer is None:
        raise ValueError(f"stage {stage.index} on {stage.device} has no optimizer")
    return stage.optimizer


def global_indices(
    stages: Sequence[Sequence[StageReplica]], placement: Placement
) -> list[list[int]]:
    """``indices[k][j]``: the model variable index of stage k's variable j."""
    indices: list[list[int]] = [[0] * row[0].num_weights() for row in stages]
    for i, copies in enumerate(placement.holders):
        for k, j in copies:
            indices[k][j] = i
    return indices


def slots(stage: StageReplica, indices: Sequence[int]) -> dict[SlotKey, Any]:
    """(model variable index, slot name) -> that optimizer variable, for one stage copy
    (ties, from equal paths, are taken in order).

    Raises:
      ValueError: a non-scalar optimizer variable that belongs to no model weight.
    """
    prefixes: dict[str, list[int]] = {}
    for variable, index in zip(stage.variables, indices, strict=True):
        if variable.trainable:
            prefixes.setdefault(variable.path.replace("/", "_") + "_", []).append(index)
    taken: dict[tuple[str, str], int] = {}
    found = {}
    optimizer = optimizer_of(stage)
    for variable in optimizer.variables:
        matches = [p for p in prefixes if variable.name.startswith(p)]
        if not matches and is_scalar(variable):
            continue
        if not matches:
            raise ValueError(
                f"optimizer variable {variable.path!r} of stage {stage.index} belongs to no "
                f"model weight; {type(optimizer).__name__} keeps state that cannot be mapped "
                "per variable"
            )
        prefix = max(matches, key=len)
        slot = variable.name[len(prefix) :]
        count = taken.get((prefix, slot), 0)
        taken[(prefix, slot)] = count + 1
        found[(prefixes[prefix][count], slot)] = variable
    return found


def row_slots(row: Sequence[StageReplica], indices: Sequence[int]) -> dict[SlotKey, Any]:
    """(model variable index, slot name) -> its optimizer variable on the first replica
    that holds it: replica 0 for every variable, unless optimizer states are sharded over
    the replicas (each then holds its share's)."""
    found: dict[SlotKey, Any] = {}
    for copy in row:
        for key, variable in slots(copy, indices).items():
            found.setdefault(key, variable)
    return found


def scalars(stage: StageReplica) -> dict[str, Any]:
    """The copy's optimizer scalars (variables of no model weight), by name."""
    optimizer = optimizer_of(stage)
    mapped = {id(v) for v in slots(stage, [0] * len(stage.variables)).values()}
    return _named_scalars(optimizer, mapped)


def _named_scalars(
    optimizer: Any, exclude: frozenset[int] | set[int] = frozenset()
) -> dict[str, Any]:
    inner = getattr(optimizer, "inner_optimizer", None)
    nested = {id(v) for v in inner.variables} if inner is not None else set()
    return {
        ("inner_" if id(v) in nested else "") + v.name: v
        for v in optimizer.variables
        if id(v) not in exclude and is_scalar(v)
    }


# An entry of Keras's order: a scalar by name, or a slot kind of the i-th trainable variable.
OrderEntry = tuple[str, Any]


def keras_order(make: Callable[[], keras.optimizers.Optimizer], trainable: int) -> list[OrderEntry]:
    """The order of ``optimizer.variables`` that ``make()`` has once built on ``trainable``
    variables: ``("scalar", name)`` or ``("slot", (t, slot name))`` for trainable variable t.

    Read off a fresh optimizer built on two probe variables: an optimizer's ``build`` makes
    its slots in loops over the variables (Adam: every ``average`` when ``use_ema``, then
    ``momentum`` and ``velocity`` variable by variable), and two variables show each loop's
    slots per variable and where the next loop starts.

    Raises:
      ValueError: an optimizer whose slots follow no such loops.
    """
    probes = [keras.Variable([[0.0] * 3] * 2, name=f"hybrid_probe{t}") for t in range(2)]
    optimizer = make()
    optimizer.build(probes)
    names = _named_scalars(optimizer)
    scalar_ids = {id(v): name for name, v in names.items()}
    order: list[OrderEntry] = []
    loop: list[tuple[int, str]] = []  # the slots of the loop being read: (probe, slot)

    def close_loop() -> None:
        kinds = [kind for t, kind in loop if t == 0]
        if [kind for t, kind in loop] != kinds + kinds or [t for t, _ in loop] != [0] * len(
            kinds
        ) + [1] * len(kinds):
            raise ValueError(
                f"{type(optimizer).__name__} builds its slots in an order the pipeline cannot "
                f"map onto a model's variables: {[name for _, name in loop]}"
            )
        order.extend(("slot", (t, kind)) for t in range(trainable) for kind in kinds)
        loop.clear()

    for variable in optimizer.variables:
        if id(variable) in scalar_ids:
            if loop:
                close_loop()
            order.append(("scalar", scalar_ids[id(variable)]))
            continue
        t = 0 if variable.name.startswith("hybrid_probe0_") else 1
        kind = variable.name[len("hybrid_probe0_") :]
        if loop and t == 0 and loop[-1][0] == 1:
            close_loop()
        loop.append((t, kind))
    if loop:
        close_loop()
    return order


def logical_variables(
    stages: Sequence[Sequence[StageReplica]],
    placement: Placement,
    make: Callable[[], keras.optimizers.Optimizer],
) -> list[list[Any]]:
    """Each variable of the optimizer Keras would build on the model's trainable variables,
    in its order, as the list of every copy's variable that holds it (the owner stage's
    replica-0 copy first)."""
    indices = global_indices(stages, placement)
    trainable = [i for i, v in enumerate(placement.variables) if v.trainable]
    named = [scalars(copy) for row in stages for copy in row]
    held = [[slots(copy, indices[k]) for copy in row] for k, row in enumerate(stages)]
    logical: list[list[Any]] = []
    for kind, what in keras_order(make, len(trainable)):
        if kind == "scalar":
            logical.append([n[what] for n in named if what in n])
            continue
        t, slot = what
        key = (trainable[t], slot)
        logical.append(
            [
                copy_slots[key]
                for k, _ in placement.holders[trainable[t]]
                for copy_slots in held[k]
                if key in copy_slots
            ]
        )
    return logical
