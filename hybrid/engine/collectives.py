"""All-reduce of a stage's gradients inside its replica group: the devices that hold copies
of that stage. How it is done is chosen by where the devices are (one rule, ``method_for``):

- ``"sum"``, CPU devices of one process (the simulated mesh): the group's first device adds
  the group's tensors in replica order and every device reads the sums. The devices share
  the host's memory, so reading another device's tensor moves no data; a ring collective
  would pack every gradient into one vector, run the ring on the collective executor's own
  threads (competing with the devices' for the cores) and unpack it. Measured on 2
  simulated devices (``benchmarks/engine_overhead.py``, 4 × Dense(1024), batch 256): the
  1×2 step 140 -> 78 ms.
- ``"collective"``, anything else (GPUs, devices on other hosts): every device packs its
  gradients into one flat vector, the group sums the vectors with one ``CollectiveReduceV2``
  (a ring: each device sends and receives 2(R-1)/R of the vector), and every device unpacks
  the result. The ops run outside XLA (XLA on CPU has no collectives).

Either way every device ends with the same values, bit for bit: the replicas stay equal.

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

__all__ = ["METHODS", "ReplicaGroup", "method_for", "new_collective_key"]

METHODS = ("sum", "collective")

# TensorFlow identifies collective groups and instances by process-wide integer keys, so
# they are drawn from one process-wide counter.
_KEYS = itertools.count(1)


def new_collective_key() -> int:
    """A collective group or instance key not used before in this process."""
    return next(_KEYS)


def method_for(devices: Sequence[str]) -> str:
    """``"sum"`` for CPU devices of one process (one task), else ``"collective"``."""
    specs = [tf.DeviceSpec.from_string(d) for d in devices]
    one_task = len({(s.job, s.replica or 0, s.task or 0) for s in specs}) == 1
    return "sum" if one_task and all(s.device_type == "CPU" for s in specs) else "collective"


class ReplicaGroup:
    """The devices holding copies of one stage, and the all-reduce over them.

    Args:
      devices: the group's devices, in replica order.
      method: "sum" or "collective" (see the module docstring); None chooses by the devices.
    """

    def __init__(self, devices: Sequence[str], method: str | None = None) -> None:
        self.devices = tuple(devices)
        self.method = method_for(self.devices) if method is None else method
        if self.method not in METHODS:
            raise ValueError(f"all-reduce method {method!r}: choose one of {METHODS}")
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
        if self.method == "sum":
            return self._sum_once(per_device, final_op)
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

    def _sum_once(
        self, per_device: Sequence[Sequence[tf.Tensor]], final_op: str
    ) -> list[list[tf.Tensor]]:
        """The group's first device adds the group's tensors in replica order; every other
        device reads the sums. (Each device adding them itself gave sums that differed in
        the last bit between devices once the graph optimizer had rewritten the adds: the
        replicas drifted apart.)"""
        with tf.device(self.devices[0]):
            sums = [tf.add_n(list(each)) for each in zip(*per_device, strict=True)]
            if final_op != "Id":
                sums = [t / self.size for t in sums]
        out = []
        for device in self.devices:
            with tf.device(device):
                out.append([tf.identity(t) for t in sums])
        return out
