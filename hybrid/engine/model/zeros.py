"""Zeros made when a traced step runs, and freed after their last use.

``tf.zeros`` (or ``tf.zeros_like``) of a known shape in a traced step is folded by
TensorFlow's graph optimizer into a constant, which the step's graph then holds for as long
as the step exists: on each device, one tensor per distinct shape, for good (measured by
``benchmarks/memory.py``: a stage's first gradient accumulators, 4 MiB per 1024 × 1024
weight). ``Empty(init=True)`` is not folded: its zeros are allocated when the op runs.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["fresh_zeros"]


def fresh_zeros(shape: Any, dtype: Any = tf.float32) -> tf.Tensor:
    """Zeros of ``shape`` (a static shape, a list, or an int32 shape tensor) and ``dtype``,
    allocated when the op runs (also inside an XLA program)."""
    if isinstance(shape, tf.TensorShape):
        shape = shape.as_list()
    return tf.raw_ops.Empty(shape=tf.cast(shape, tf.int32), dtype=dtype, init=True)
