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
device's in the order of its ordering token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.ops import collective_ops

from hybrid.engine.collectives import new_collective_key, new_collective_keys

__all__ = ["KEYS_PER_CALL", "RECOMPUTE", "NormGroup"]

# Instance keys of one program call per synchronized BN call j, from the call's key c:
# c + 4j: the forward's all-reduce, c + 4j + 1: its gradient's. A recomputation (remat)
# runs with c + RECOMPUTE: c + 4j + 2 and c + 4j + 3.
KEYS_PER_CALL = 4
RECOMPUTE = 2


class NormGroup:
    """The replica group of one stage that calls synchronized BatchNormalizations.

    Args:
      devices: the stage's device on every replica, in replica order.
      calls: how many synchronized BN calls one forward of the stage makes.
    """

    def __init__(self, devices: Sequence[str], calls: int) -> None:
        self.devices = tuple(devices)
        self.calls = calls
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
