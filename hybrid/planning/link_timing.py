"""Measured seconds of moving bytes between devices: the engine's all-reduce inside a
replica group, and handing a tensor from one device to another (what :meth:`Link.fit
<hybrid.planning.hardware.Link.fit>` turns into a bandwidth and a latency)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hybrid.engine.traced import traced
from hybrid.planning.stopwatch import net_seconds

__all__ = ["measure_all_reduce", "measure_transfer"]


def measure_all_reduce(
    devices: Sequence[str], sizes_bytes: Sequence[int], repeats: int = 7
) -> list[float]:
    """Median seconds of one mean all-reduce of a float32 vector over ``devices``, per size,
    beyond launching the graph function that runs it.

    Runs the engine's own collective
    (:class:`hybrid.engine.step.collectives.ReplicaGroup`), one vector
    per device, inside a graph function, timed in alternation with the same function without
    the collective (its launch cost is subtracted).
    """
    from hybrid.engine.step.collectives import ReplicaGroup

    group = ReplicaGroup(devices)

    def reduce(*tensors: tf.Tensor) -> list[tf.Tensor]:
        return [t for row in group.all_reduce_mean([[t] for t in tensors]) for t in row]

    def nothing(*tensors: tf.Tensor) -> list[tf.Tensor]:
        return [tf.identity(t) for t in tensors]

    out = []
    for size in sizes_bytes:
        values = []
        for device in devices:
            with tf.device(device):
                values.append(tf.ones([max(1, int(size) // 4)]))
        out.append(
            net_seconds(
                traced(reduce),
                traced(nothing),
                tuple(values),
                repeats,
            )
        )
    return out


def measure_transfer(
    source: str, target: str, sizes_bytes: Sequence[int], repeats: int = 7
) -> list[float]:
    """Median seconds to hand a float32 tensor made on ``source`` to an op on ``target``, per
    size, beyond the same graph function with both ops on ``source``."""

    def hand_over(where: str, n: int) -> Any:
        def run() -> list[tf.Tensor]:
            with tf.device(source):
                t = tf.fill([n], 1.0)
            with tf.device(where):
                return [tf.reduce_sum(t)]

        return traced(run)

    out = []
    for size in sizes_bytes:
        n = max(1, int(size) // 4)
        out.append(net_seconds(hand_over(target, n), hand_over(source, n), (), repeats))
    return out
