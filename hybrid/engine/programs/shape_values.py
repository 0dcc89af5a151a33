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

__all__ = ["SHAPE_OPS", "beyond_rows", "value"]

# Ops whose value is a static shape of their input (or its size or rank).
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def value(t: tf.Tensor) -> np.ndarray | None:
    """``t``'s value if the trace fixes it (constants and fully defined static shapes only,
    through the ops below), else None. Evaluated without recursion, inputs first."""
    known: dict[str, np.ndarray | None] = {}
    todo = [t]
    while todo:
        x = todo[-1]
        if x.name in known:
            todo.pop()
            continue
        if x.op.type in _LEAVES or x.op.type not in _KINDS:
            known[x.name] = _leaf(x)
            continue
        missing = [i for i in x.op.inputs if i.name not in known]
        failed = any(i.name in known and known[i.name] is None for i in x.op.inputs)
        if missing and not failed:
            todo += missing
            continue
        ins = [v for v in (known.get(i.name) for i in x.op.inputs) if v is not None]
        known[x.name] = _applied(x, ins) if len(ins) == len(x.op.inputs) else None
    return known[t.name]


def beyond_rows(
    full: tf.Tensor, micro: tf.Tensor, micro_batches: int, rows: bool, one_row_axes: bool = False
) -> str | None:
    """None if ``full`` (a tensor of the trace at ``micro_batches`` times the rows) has the
    value of its counterpart ``micro`` but where the rows show:

    - ``rows``: it is a shape whose first entry counts the rows, which may be
      ``micro_batches`` times larger;
    - ``one_row_axes``: it is a sum's axes, and the micro-batch has one row: the whole
      batch may also sum over axis 0 (its rows), which the micro-batch need not list
      (summing one row is keeping it);

    else what differs. A begin, size or axis computed from the batch size for another axis
    would pick other elements of each row in the two traces."""
    big, small = value(full), value(micro)
    shown = ["unknown" if v is None else str(v.tolist()) for v in (big, small)]
    if big is None or small is None:
        return (
            f"{full.name} ({shown[0]} for the whole batch, {shown[1]} for a micro-batch), "
            "a value the proof cannot compute"
        )
    if big.shape == small.shape and np.array_equal(big, small):
        return None
    if rows and big.shape == small.shape and big.ndim == 1 and big.size > 0:
        if big[0] == micro_batches * small[0] and np.array_equal(big[1:], small[1:]):
            return None
    axes = one_row_axes and big.ndim <= 1 and small.ndim <= 1
    if axes and min(big.min(initial=0), small.min(initial=0)) >= 0:
        if set(big.flat) == set(small.flat) | {0}:
            return None
    return (
        f"{full.name} ({shown[0]} for the whole batch, {shown[1]} for a micro-batch): "
        "the batch size reaches more than the rows"
    )


def _shape(t: tf.Tensor, out: tf.Tensor) -> np.ndarray | None:
    """``t``'s static shape as ``out``'s integers, if fully defined."""
    shape = t.shape
    if not shape.is_fully_defined():
        return None
    return np.array(shape.as_list(), out.dtype.as_numpy_dtype)


def _leaf(t: tf.Tensor) -> np.ndarray | None:
    """The value of a constant or of a static shape's op; None for an op not evaluated."""
    op = t.op
    if op.type == "Const":
        constant = tf.get_static_value(t)
        return None if constant is None else np.asarray(constant)
    if op.type in SHAPE_OPS:
        shape = _shape(op.inputs[t.value_index if op.type == "ShapeN" else 0], t)
        if shape is None or op.type in ("Shape", "ShapeN"):
            return shape
        return np.asarray(np.prod(shape) if op.type == "Size" else len(shape), shape.dtype)
    return None


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
_EAGER: dict[str, Callable[[tf.Operation, list[tf.Tensor]], Any]] = {
    "Slice": lambda op, v: tf.slice(*v),
    "StridedSlice": lambda op, v: tf.raw_ops.StridedSlice(
        input=v[0], begin=v[1], end=v[2], strides=v[3], **{m: op.get_attr(m) for m in _MASKS}
    ),
    "ConcatOffset": lambda op, v: tf.raw_ops.ConcatOffset(concat_dim=v[0], shape=v[1:]),
    "BroadcastGradientArgs": lambda op, v: tf.raw_ops.BroadcastGradientArgs(s0=v[0], s1=v[1]),
    "Range": lambda op, v: tf.raw_ops.Range(start=v[0], limit=v[1], delta=v[2]),
}
_PASS = frozenset({"Identity", "Snapshot", "StopGradient", "EnsureShape"})
_LEAVES = SHAPE_OPS | {"Const"}
_KINDS = _LEAVES | _PASS | set(_ARITHMETIC) | set(_EAGER)
_KINDS |= {"Cast", "Pack", "ConcatV2", "ExpandDims", "Reshape", "Prod", "Sum", "Fill"}


def _applied(t: tf.Tensor, ins: list[np.ndarray]) -> np.ndarray | None:
    """``t``'s value from its op's input values (None where the op fails on them)."""
    try:
        return _apply(t, ins)
    except (ValueError, TypeError, IndexError, ArithmeticError, tf.errors.OpError):
        return None


def _apply(t: tf.Tensor, ins: list[np.ndarray]) -> np.ndarray:
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
        keep = op.get_attr("keep_dims")
        return np.asarray(reduce(ins[0], axis=axes, keepdims=keep, dtype=ins[0].dtype))
    if kind == "Fill":
        return np.full(ins[0], ins[1])
    with tf.init_scope():  # TensorFlow's own kernel (_EAGER), run eagerly on the values
        # (as tensors of their own dtypes: a raw op would convert numpy to its default type)
        out = _EAGER[kind](op, [tf.constant(v) for v in ins])
    return np.asarray(out[t.value_index] if isinstance(out, list | tuple) else out)
