"""``BatchNormalization(synchronized=True)``: moments all-reduced over a stage's replicas.

Keras honours ``synchronized=True`` under a ``tf.distribute`` strategy: each replica sums
its batch's ``x``, ``x²`` and example count, the sums are all-reduced over the replicas
(``ReplicaContext.all_reduce``, whose gradient is again an all-reduce of the output
gradients), and every replica normalizes with the moments of the whole global batch. On a
mesh the same happens per micro-batch, inside stage k's programs on device (k, r)::

    for micro-batch m, on every replica r of stage k, at each synchronized BN call j:
        local = [sum(x), sum(x²), count]                  of replica r's micro-batch m
        total = sum over r of local                       (one CollectiveReduceV2)
        mean  = total[0] / total[2];   variance = max(total[1] / total[2] - mean², 0)
    backward: d local = sum over r of d total             (one CollectiveReduceV2)

so a stage normalizes micro-batch m over R × (examples per micro-batch) examples: the R
replicas' micro-batch m together. With one micro-batch per step that is the whole global
batch, as Keras's ``MirroredStrategy`` over R replicas normalizes.

The collectives run inside the stage's programs, which XLA cannot compile (XLA on CPU has no
collectives): such a stage's programs are plain ``tf.function``s. Each call of a program
gets its own block of instance keys (``seed[2]``, the call's key), the same on every replica
of the stage: a forward, its recomputation (remat) and their backwards all-reduce under
different keys, and every replica issues them in the same order (its schedule's), each
device's in the order of its ordering token. The moving statistics are updated once per step
from the replica's own micro-batches' synchronized moments (``batch_norm.update_copy``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf
from tensorflow.python.ops import collective_ops

from hybrid.engine import keras_private
from hybrid.engine.step.collectives import new_collective_key, new_collective_keys

__all__ = ["KEYS_PER_CALL", "RECOMPUTE", "Member", "NormGroup", "bound", "keyed", "with_backward"]

# Instance keys of one program call per synchronized BN call j, from the call's key c:
# c + 4j: the forward's all-reduce, c + 4j + 1: its gradient's. A forward traced with its
# backward runs with c + RECOMPUTE: c + 4j + 2 and c + 4j + 3 (``with_backward``).
KEYS_PER_CALL = 4
RECOMPUTE = 2


class NormGroup:
    """The replica group of one stage that calls synchronized BatchNormalizations.

    Args:
      devices: the stage's device on every replica, in replica order.
      calls: the layer of each synchronized BatchNormalization call one forward of the stage
        makes, in call order.
    """

    def __init__(
        self, devices: Sequence[str], calls: Sequence[keras.layers.BatchNormalization]
    ) -> None:
        self.devices = tuple(devices)
        self.calls = len(calls)
        self.layers = list({id(layer): layer for layer in calls}.values())
        self.group_key = new_collective_key()
        self._tokens = []
        for device in self.devices:  # see collectives.py: one ordering token per device
            with tf.device(device):
                self._tokens.append(tf.Variable(0, dtype=tf.int32, trainable=False))
        self._bases: dict[int, int] = {}

    @property
    def size(self) -> int:
        return len(self.devices)

    def key(self, microbatch: int, micro_batches: int) -> int:
        """The key of micro-batch ``microbatch``'s forward when a step has
        ``micro_batches``: unique in the step, the same on every replica."""
        block = KEYS_PER_CALL * self.calls
        if micro_batches not in self._bases:
            self._bases[micro_batches] = new_collective_keys(block * micro_batches)
        return self._bases[micro_batches] + microbatch * block

    def moments(
        self, replica: int, x: tf.Tensor, axes: Sequence[int], key: tf.Tensor
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """The mean and variance over ``axes`` of ``x`` on every replica of the group
        (``x`` is replica ``replica``'s), as Keras's synchronized moments compute them."""
        axes = list(axes)
        local = [
            tf.reduce_sum(x, axis=axes, keepdims=True),
            tf.reduce_sum(tf.square(x), axis=axes, keepdims=True),
            tf.reduce_sum(tf.ones_like(x), axis=axes, keepdims=True),
        ]
        flat = tf.concat([tf.reshape(t, [-1]) for t in local], axis=0)
        total, squares, count = tf.split(self._all_reduce(replica, flat, key), 3)
        shape = tf.shape(local[0])
        total, squares, count = (tf.reshape(t, shape) for t in (total, squares, count))
        mean = tf.math.divide_no_nan(total, count)
        variance = tf.maximum(tf.math.divide_no_nan(squares, count) - tf.square(mean), 0.0)
        return tf.squeeze(mean, axes), tf.squeeze(variance, axes)

    def _all_reduce(self, replica: int, flat: tf.Tensor, key: tf.Tensor) -> tf.Tensor:
        """``flat`` summed over the group; its gradient: the output gradient summed over
        the group (under key + 1)."""

        @tf.custom_gradient
        def summed(t: tf.Tensor) -> Any:
            def gradient(dy: tf.Tensor) -> tf.Tensor:
                return self._collective(replica, dy, key + 1)

            return self._collective(replica, t, key), gradient

        return summed(flat)

    def _collective(self, replica: int, t: tf.Tensor, key: tf.Tensor) -> tf.Tensor:
        return collective_ops.all_reduce_v2(
            t,
            group_size=self.size,
            group_key=self.group_key,
            instance_key=tf.cast(key, tf.int32),
            merge_op="Add",
            final_op="Id",
            ordering_token=self._tokens[replica].handle,
        )


class Member:
    """One stage copy's place in its :class:`NormGroup`: the group, and the copy's position
    in it (its replica)."""

    def __init__(self, group: NormGroup, replica: int) -> None:
        self.group, self.replica = group, replica


def keyed(member: Member | None, seed: tf.Tensor, microbatch: int, micro_batches: int) -> tf.Tensor:
    """The seed of micro-batch ``microbatch``'s forward on a stage copy: ``seed`` and, when
    it all-reduces (``member``), the call's key."""
    if member is None:
        return seed
    key = member.group.key(microbatch, micro_batches)
    return tf.concat([seed, tf.constant([key], seed.dtype)], axis=0)


def with_backward(member: Member | None, seed: tf.Tensor) -> tf.Tensor:
    """The seed of a forward traced with its backward (a recomputation under remat, a fused
    or a cut program): the same random draws; its all-reduces take the call's keys +
    :data:`RECOMPUTE`, so a forward alone (remat) and its recomputation never share keys."""
    if member is None:
        return seed
    return seed + tf.constant([0, 0, RECOMPUTE], seed.dtype)


@contextlib.contextmanager
def bound(
    member: Member | None, training: bool, seed: tf.Tensor
) -> Iterator[list[tuple[tf.Tensor, tf.Tensor]] | None]:
    """Inside (while a stage program is traced): the synchronized BN calls of ``member``'s
    copy normalize with the group's moments, the n-th under keys ``seed[2] + 4n`` (its
    gradient's ``+ 1``). Yields the list their moments are appended to, in call order
    (None when nothing all-reduces)."""
    if member is None or not training:
        yield None
        return
    moments: list[tuple[tf.Tensor, tf.Tensor]] = []

    def synced(x: tf.Tensor, axes: Sequence[int]) -> tuple[tf.Tensor, tf.Tensor]:
        key = seed[2] + KEYS_PER_CALL * len(moments)
        moments.append(member.group.moments(member.replica, x, axes, key))
        return moments[-1]

    with keras_private.batch_norm_moments_from(member.group.layers, synced):
        yield moments
