"""All-reduce of a stage's gradients inside its replica group, with TensorFlow collectives.

Each stage has one collective group: the devices that hold copies of that stage. Every
device packs its gradients into one flat vector, the group averages the vectors with one
``CollectiveReduceV2``, and every device unpacks the mean. The ops run outside XLA (XLA on
CPU has no collectives).

Several ``CollectiveReduceV2`` ops on different devices of one ``tf.function`` deadlock
unless each carries an ordering token: a resource living on its device. Automatic control
dependencies otherwise chain the group members one after another, and each would wait
forever for the others.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops

__all__ = ["ReplicaGroup", "new_collective_key"]

# TensorFlow identifies collective groups and instances by process-wide integer keys, so
# they are drawn from one process-wide counter.
_KEYS = itertools.count(1)


def new_collective_key() -> int:
    """A collective group or instance key not used before in this process."""
    return next(_KEYS)


class ReplicaGroup:
    """The devices holding copies of one stage, and the collective that averages over them."""

    def __init__(self, devices: Sequence[str]) -> None:
        self.devices = tuple(devices)
        self.group_key = new_collective_key()
        self._tokens = []
        for device in self.devices:
            with tf.device(device):
                self._tokens.append(tf.Variable(0, dtype=tf.int32, trainable=False))

    @property
    def size(self) -> int:
        return len(self.devices)

    def all_reduce_mean(self, per_device: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        """Element-wise mean of ``per_device[i]`` over the group, returned on every device."""
        return self._all_reduce(per_device, "Div")

    def all_reduce_sum(self, per_device: Sequence[Sequence[tf.Tensor]]) -> list[list[tf.Tensor]]:
        """Element-wise sum of ``per_device[i]`` over the group, returned on every device."""
        return self._all_reduce(per_device, "Id")

    def _all_reduce(
        self, per_device: Sequence[Sequence[tf.Tensor]], final_op: str
    ) -> list[list[tf.Tensor]]:
        """Reduces over the group with ``merge_op="Add"`` then ``final_op``.

        Must be called while tracing a ``tf.function``. One collective per call: the tensors
        of each device are flattened into one vector first.
        """
        if len(per_device) != self.size:
            raise ValueError(f"expected tensors from {self.size} devices, got {len(per_device)}")
        if self.size == 1 or not per_device[0]:
            return [list(tensors) for tensors in per_device]
        instance_key = new_collective_key()
        shapes = [t.shape for t in per_device[0]]
        sizes = [int(np.prod(s)) for s in shapes]
        out = []
        for device, tensors, token in zip(self.devices, per_device, self._tokens, strict=True):
            with tf.device(device):
                flat = tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)
                mean = collective_ops.all_reduce_v2(
                    flat,
                    group_size=self.size,
                    group_key=self.group_key,
                    instance_key=instance_key,
                    merge_op="Add",
                    final_op=final_op,
                    ordering_token=token.handle,
                )
                parts = tf.split(mean, sizes)
                out.append([tf.reshape(p, s) for p, s in zip(parts, shapes, strict=True)])
        return out
