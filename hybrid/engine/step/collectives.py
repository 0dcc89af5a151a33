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
- ``"cross_replica"``, a program every replica runs (a ``tf.distribute`` strategy's
  ``run``; ``strategy_step.py``): the group is one logical device (on a TPU, one core
  of every replica's pipeline), each replica passes its own tensors, and they are packed
  into one vector summed by the replica context's ``all_reduce``: on a TPU one
  ``CrossReplicaSum`` inside the step's XLA program, on that core.

Either way every device ends with the same values, bit for bit: the replicas stay equal.

A sparse gradient (``tf.IndexedSlices``, ``sparse.py``) is gathered, not summed, as
``MirroredStrategy`` gathers one: every device gets the group's slices concatenated in
replica order (values and indices; the group's first device concatenates them, or one
``CollectiveGatherV2`` per tensor, or the replica context's ``all_gather``).

Several ``CollectiveReduceV2`` ops on different devices of one ``tf.function`` deadlock
unless each carries an ordering token: a resource living on its device. Automatic control
dependencies otherwise chain the group members one after another, and each would wait
forever for the others.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import collective_ops

__all__ = ["METHODS", "ReplicaGroup", "method_for", "new_collective_key", "new_collective_keys"]

METHODS = ("sum", "collective", "cross_replica")

# TensorFlow identifies collective groups and instances by process-wide integer keys, so
# they are drawn from one process-wide counter.
_KEYS = itertools.count(1)


def new_collective_key() -> int:
    """A collective group or instance key not used before in this process."""
    return next(_KEYS)


def new_collective_keys(count: int) -> int:
    """The first of ``count`` consecutive keys not used before in this process."""
    first = next(_KEYS)
    for _ in range(count - 1):
        next(_KEYS)
    return first


def method_for(devices: Sequence[str]) -> str:
    """``"sum"`` for CPU devices of one process (one task), ``"cross_replica"`` for a TPU's
    logical core in a replicated program, else ``"collective"``."""
    if len(devices) == 1 and "TPU_REPLICATED_CORE" in devices[0]:
        return "cross_replica"
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
        if self.method == "cross_replica" and len(self.devices) != 1:
            raise ValueError(
                f"a cross_replica group is one logical device of a program every replica "
                f"runs, got {len(self.devices)} devices {self.devices}; use 'sum' or "
                "'collective' for devices named one by one"
            )
        self.group_key = new_collective_key()
        self._tokens = []
        for device in self.devices if self.method == "collective" else ():
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

    def _all_reduce(self, per_device: Sequence[Sequence[Any]], final_op: str) -> list[list[Any]]:
        """Reduces over the group with ``merge_op="Add"`` then ``final_op``; IndexedSlices
        are gathered (:meth:`_gather`) and, for a mean, their values divided.

        Must be called while tracing a ``tf.function``. One collective per call for the
        dense tensors: the tensors of each device are flattened into one vector first.
        """
        if len(per_device) != self.size:
            raise ValueError(f"expected tensors from {self.size} devices, got {len(per_device)}")
        at = [j for j, t in enumerate(per_device[0]) if isinstance(t, tf.IndexedSlices)]
        if not at:
            return self._all_reduce_dense(per_device, final_op)
        dense = [[t for j, t in enumerate(ts) if j not in at] for ts in per_device]
        out = self._all_reduce_dense(dense, final_op)
        for j in at:
            gathered = self._gather([ts[j] for ts in per_device])
            for i, (tensors, one) in enumerate(zip(out, gathered, strict=True)):
                if final_op != "Id":
                    with tf.device(self.devices[i]):
                        one = tf.IndexedSlices(one.values / self.size, one.indices, one.dense_shape)
                tensors.insert(j, one)
        return out

    def _gather(self, per_device: Sequence[tf.IndexedSlices]) -> list[tf.IndexedSlices]:
        """Every device's slices concatenated in replica order, returned on every device."""
        if self.size == 1 and self.method != "cross_replica":
            return list(per_device)
        shape = per_device[0].dense_shape
        if self.method == "cross_replica":
            context = tf.distribute.get_replica_context()
            if context is None:
                raise RuntimeError("a cross_replica gather runs inside a strategy's run()")
            one = per_device[0]
            with tf.device(self.devices[0]):
                values = context.all_gather(one.values, axis=0)
                indices = context.all_gather(one.indices, axis=0)
            return [tf.IndexedSlices(values, indices, shape)]
        if self.method == "sum":
            with tf.device(self.devices[0]):
                values = tf.concat([g.values for g in per_device], 0)
                indices = tf.concat([g.indices for g in per_device], 0)
            out = []
            for device in self.devices:
                with tf.device(device):
                    copy = [tf.identity(values), tf.identity(indices)]
                    out.append(tf.IndexedSlices(copy[0], copy[1], shape))
            return out
        keys = [new_collective_key(), new_collective_key()]
        out = []
        for device, one, token in zip(self.devices, per_device, self._tokens, strict=True):
            with tf.device(device):
                parts = [
                    collective_ops.all_gather_v2(
                        t,
                        group_size=self.size,
                        group_key=self.group_key,
                        instance_key=key,
                        ordering_token=token.handle,
                    )
                    for t, key in zip([one.values, one.indices], keys, strict=True)
                ]
                out.append(tf.IndexedSlices(parts[0], parts[1], shape))
        return out

    def _all_reduce_dense(
        self, per_device: Sequence[Sequence[tf.Tensor]], final_op: str
    ) -> list[list[tf.Tensor]]:
        """:meth:`_all_reduce` of dense tensors."""
        if self.method == "cross_replica" and per_device[0]:
            return [self._across_replicas(per_device[0], final_op)]
        if self.size == 1 or not per_device[0]:
            return [list(tensors) for tensors in per_device]
        if self.method == "sum":
            return self._sum_once(per_device, final_op)
        instance_key = new_collective_key()
        out = []
        for device, tensors, token in zip(self.devices, per_device, self._tokens, strict=True):
            with tf.device(device):
                flat = _packed(tensors)
                mean = collective_ops.all_reduce_v2(
                    flat,
                    group_size=self.size,
                    group_key=self.group_key,
                    instance_key=instance_key,
                    merge_op="Add",
                    final_op=final_op,
                    ordering_token=token.handle,
                )
                out.append(_unpacked(mean, tensors))
        return out

    def _across_replicas(self, tensors: Sequence[tf.Tensor], final_op: str) -> list[tf.Tensor]:
        """This replica's ``tensors`` summed (or averaged) with every other replica's copies
        of them, in one all-reduce of the replica context per dtype, on the group's logical
        device."""
        context = tf.distribute.get_replica_context()
        if context is None:
            raise RuntimeError("a cross_replica all-reduce runs inside a strategy's run()")
        op = tf.distribute.ReduceOp.SUM if final_op == "Id" else tf.distribute.ReduceOp.MEAN
        out: list[tf.Tensor | None] = [None] * len(tensors)
        with tf.device(self.devices[0]):
            for dtype in dict.fromkeys(t.dtype for t in tensors):
                which = [i for i, t in enumerate(tensors) if t.dtype == dtype]
                same = [tensors[i] for i in which]
                summed = _unpacked(context.all_reduce(op, _packed(same)), same)
                for i, t in zip(which, summed, strict=True):
                    out[i] = t
        return out  # type: ignore[return-value]

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


def _packed(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """The tensors flattened into one vector (one all-reduce for all of them)."""
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def _unpacked(flat: tf.Tensor, like: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """``flat`` cut back into tensors of the shapes of ``like``."""
    shapes = [t.shape for t in like]
    parts = tf.split(flat, [int(np.prod(s)) for s in shapes])
    return [tf.reshape(p, s) for p, s in zip(parts, shapes, strict=True)]
