"""Optimizer states sharded across a stage's replicas (ZeRO-1,
``Pipeline(shard_optimizer_states=True)``).

Conceptually, for each model stage k with copies on R replicas::

    owner[j] = the replica that updates stage k's variable j (whole variables, balanced by
               size: largest first, onto the replica with the fewest elements so far)
    every replica r: the all-reduced, clipped gradients as without sharding
    replica owner[j]: its optimizer (slots of its own variables only) updates variable j
    every other replica: copies variable j's new value from replica owner[j]

The update is the same arithmetic on the same gradients, done once instead of R times, so
the weights equal those of the unsharded step exactly; each device holds the optimizer
state of about 1/R of its stage's parameters. Whole variables are the unit, so a stage needs
at least R trainable variables (checked at build).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

__all__ = ["broadcast", "owners"]


def owners(sizes: Sequence[int], replicas: int, stage: int = 0) -> list[int]:
    """The replica that updates each variable of a stage, given their element counts.

    Raises:
      ValueError: fewer variables than replicas (a replica would update nothing).
    """
    if len(sizes) < replicas:
        raise ValueError(
            f"shard_optimizer_states=True: stage {stage} has {len(sizes)} trainable "
            f"variable(s) for {replicas} replicas; each replica updates whole variables, so "
            "a stage needs at least one per replica: use fewer replicas or stages with more "
            "layers, or shard_optimizer_states=False"
        )
    load = [0] * replicas
    found = [0] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        r = min(range(replicas), key=lambda r: (load[r], r))
        found[j] = r
        load[r] += sizes[j]
    return found


def broadcast(row: Sequence[Any]) -> None:
    """Every copy of one model stage (``row[r]``) takes, for each trainable variable, the
    value of the copy that updated it (``copy.updates[j]``); reads follow the update."""
    if len(row) < 2 or all(all(copy.updates) for copy in row):
        return
    for j in range(len(row[0].trainable_variables)):
        source = next(copy for copy in row if copy.updates[j])
        for copy in row:
            if copy is not source:
                with tf.device(copy.device):
                    copy.trainable_variables[j].assign(source.trainable_variables[j].value)
