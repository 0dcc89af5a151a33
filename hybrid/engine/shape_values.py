"""The value of a traced integer tensor computed only from constants and static shapes (a
reshape's target, a slice's begin, a sum's axes), evaluated with numpy: what ``row_sums``
compares between the traces of one stage at two batch sizes.

TensorFlow's own ``tf.get_static_value`` folds only a few op types (not ``StridedSlice``,
``ShapeN``, ``ConcatOffset`` or ``BroadcastGradientArgs``, which gradients use to rebuild
shapes), so the ops such a subgraph is made of are evaluated here (the slicing and gradient
shape ops by their TensorFlow kernels, eagerly); a tensor that reads anything else has no
value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["beyond_rows", "value"]


def value(t: tf.Tensor) -> np.ndarray | None:
    """``t``'s value if the trace fixes it (constants and fully defined static shapes only,
    through the ops below), else None."""
    return _Evaluator().value(t)


def beyond_rows(full: tf.Tensor, micro: tf.Tensor, micro_batches: int, rows: bool) -> str | None:
    """None if ``full`` (a tensor of the trace at ``micro_batches`` times the rows) has the
    value of its counterpart ``micro`` but, when ``rows`` (it is a shape whose first entry
    counts the rows), in that first entry, which may be ``micro_batches`` times larger;
    else what differs. A begin, size or axis computed from the batch size for another axis
    would pick other elements of each row in the two traces."""
    big, small = value(full), value(micro)
    if big is not None and small is not None and big.shape == small.shape:
        if np.array_equal(big, small):
            return None
        first = rows and big.ndim == 1 and big.size > 0
        if first and big[0] == micro_batches * small[0] and np.array_equal(big[1:], small[1:]):
            return None
    shown = ["unknown" if v is None else str(v.tolist()) for v in (big, small)]
    return (
        f"{full.name} ({shown[0]} for the whole batch, {shown[1]} for a micro-batch): "
        "the batch size reaches more than the rows"
    )


_ARITHMETIC: dict[str, Callable[..., np.ndarray]] = {
    "Add": np.add,
    "AddV2": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "FloorDiv": np.floor_divide,
    "FloorMod": np.mod,
    "Maximum": np.maximum,
    "Minimum": np.minimum,
    "Neg": np.negative,
    "Equal": np.equal,
    "NotEqual": np.not_equal,
}
_MASKS = ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")
_EAGER: dict[str, Callable[[tf.Operation, list[np.ndarray]], Any]] = {
    "Slice": lambda op, v: tf.slice(*v),
    "StridedSlice": lambda op, v: tf.raw_ops.StridedSlice(
        input=v[0], begin=v[1], end=v[2], strides=v[3], **{m: op.get_attr(m) for m in _MASKS}
    ),
    "ConcatOffset": lambda op, v: tf.raw_ops.ConcatOffset(concat_dim=v[0], shape=v[1:]),
    "BroadcastGradientArgs": lambda op, v: tf.raw_ops.BroadcastGradientArgs(s0=v[0], s1=v[1]),
}
_PASS = frozenset({"Identity", "Snapshot", "StopGradient", "EnsureShape"})


class _Evaluator:
    """Evaluates one tensor, remembering the values of the tensors it reads."""

    def __init__(self) -> None:
        self.known: dict[str, np.ndarray | None] = {}

    def value(self, t: tf.Tensor) -> np.ndarray | None:
        if t.name not in self.known:
            try:
                self.known[t.name] = self._evaluate(t)
            except (ValueError, TypeError, IndexError, tf.errors.OpError):
                self.known[t.name] = None
        return self.known[t.name]

    def _shape(self, t: tf.Tensor, out: tf.Tensor) -> np.ndarray | None:
        """``t``'s static shape as ``out``'s integers, if fully defined."""
        shape = t.shape
        dtype = out.dtype.as_numpy_dtype
        return np.array(shape.as_list(), dtype) if shape.is_fully_defined() else None

    def _evaluate(self, t: tf.Tensor) -> np.ndarray | None:
        op = t.op
        kind = op.type
        if kind == "Const":
            return np.asarray(tf.get_static_value(t))
        if kind == "Shape":
            return self._shape(op.inputs[0], t)
        if kind == "ShapeN":
            return self._shape(op.inputs[t.value_index], t)
        if kind in ("Size", "Rank"):
            shape = self._shape(op.inputs[0], t)
            if shape is None:
                return None
            return np.asarray(np.prod(shape) if kind == "Size" else len(shape), shape.dtype)
        ins = [v for v in (self.value(i) for i in op.inputs) if v is not None]
        return self._apply(t, ins) if len(ins) == len(op.inputs) else None

    def _apply(self, t: tf.Tensor, ins: list[np.ndarray]) -> np.ndarray | None:
        """``t``'s value from its op's input values."""
        op = t.op
        kind = op.type
        if kind in _PASS:
            return ins[0]
        if kind in _ARITHMETIC:
            return np.asarray(_ARITHMETIC[kind](*ins))
        if kind == "Cast":
            return ins[0].astype(tf.as_dtype(op.get_attr("DstT")).as_numpy_dtype)
        if kind == "Pack":
            return np.stack(ins, axis=op.get_attr("axis"))
        if kind == "ConcatV2":
            return np.concatenate(ins[:-1], axis=int(ins[-1]))
        if kind == "ExpandDims":
            return np.expand_dims(ins[0], int(ins[1]))
        if kind == "Reshape":
            return np.reshape(ins[0], ins[1])
        if kind in ("Prod", "Sum"):
            reduce = np.prod if kind == "Prod" else np.sum
            axes = tuple(int(a) for a in np.reshape(ins[1], -1))
            return np.asarray(reduce(ins[0], axis=axes, keepdims=op.get_attr("keep_dims")))
        if kind == "Fill":
            return np.full(ins[0], ins[1])
        if kind == "Range":
            return np.arange(int(ins[0]), int(ins[1]), int(ins[2]))
        if kind in _EAGER:  # TensorFlow's own kernel, run eagerly on the values
            with tf.init_scope():
                out = _EAGER[kind](op, ins)
            return np.asarray(out[t.value_index] if isinstance(out, list | tuple) else out)
        return None
