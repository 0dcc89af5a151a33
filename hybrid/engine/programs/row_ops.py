"""TensorFlow ops by what they do to the rows of a batch: the tables ``row_sums`` reads.

Each table lists op types (``tf.Operation.type``) a proof of "W is a sum over rows" may
rely on; an op in none of them stops the proof.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = [
    "CONVS",
    "ELEMENTWISE",
    "FILTER_GRADS",
    "LINEAR",
    "LINEAR_FIRST",
    "PRODUCTS",
    "ROW_SHAPES",
    "SCALING",
    "SHAPE_ARGS",
    "UNIFORM",
    "first_row",
    "shape_args",
    "widening",
]

# Ops that apply to each element (with broadcasting): per row when their inputs are.
ELEMENTWISE = frozenset(
    "Abs Add AddN AddV2 Atan2 BiasAdd Cast Ceil ClipByValue Cos Div DivNoNan Elu EluGrad "
    "EnsureShape Equal Erf Erfc Exp Expm1 Floor FloorDiv FloorMod Greater GreaterEqual "
    "Identity IsFinite LeakyRelu LeakyReluGrad Less LessEqual Log Log1p LogicalAnd LogicalNot "
    "LogicalOr Maximum Minimum Mul MulNoNan Neg NotEqual OnesLike Pow PreventGradient "
    "Reciprocal ReciprocalGrad RealDiv Relu Relu6 Relu6Grad ReluGrad Round Rsqrt RsqrtGrad "
    "Select SelectV2 Selu SeluGrad Sigmoid SigmoidGrad Sign Sin Snapshot Softplus SoftplusGrad "
    "Softsign SoftsignGrad Sqrt SqrtGrad Square SquaredDifference StopGradient Sub Tanh "
    "TanhGrad Xdivy Xlogy ZerosLike".split()
)
# Ops linear in their one summed input (the others fixed): a sum stays a sum.
LINEAR = frozenset("AddN AddV2 Add ConcatV2 Sub".split())  # of sums only
LINEAR_FIRST = frozenset(  # in their first input, the others fixed
    "BroadcastTo Cast EnsureShape ExpandDims Gather GatherV2 Identity Neg Pad Reshape Slice "
    "Snapshot Squeeze StopGradient StridedSlice Sum Tile Transpose UnsortedSegmentSum".split()
)
SCALING = frozenset({"Mul", "RealDiv", "Div", "DivNoNan"})  # sum × or ÷ a fixed value
PRODUCTS = frozenset({"MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})
# Ops that make every row the same value (from a fixed input).
UNIFORM = frozenset({"Fill", "BroadcastTo", "ZerosLike", "OnesLike", "Tile"})
# Inputs that only give a shape (may depend on the batch size), by op.
SHAPE_ARGS: dict[str, frozenset[int]] = {
    op: frozenset(at)
    for at, ops in [
        ((0,), "Conv2DBackpropInput Fill Split"),
        ((1,), "BroadcastTo Conv2DBackpropFilter Conv3DBackpropFilterV2 ExpandDims Reshape Sum"),
        ((1,), "DepthwiseConv2dNativeBackpropFilter Tile Transpose"),
        ((2,), "GatherV2 UnsortedSegmentSum"),
        ((1, 2), "Slice SplitV"),
        ((1, 2, 3), "StridedSlice"),
    ]
    for op in ops.split()
}
# Shape arguments whose first entry is the number of rows: (op, input).
ROW_SHAPES = frozenset(
    {
        ("BroadcastTo", 1),
        ("Conv2DBackpropInput", 0),
        ("Fill", 0),
        ("Reshape", 1),
        ("Slice", 2),
        ("StridedSlice", 2),
        ("Tile", 1),
    }
)
FILTER_GRADS = frozenset(
    {
        "Conv2DBackpropFilter",
        "Conv2DBackpropFilterV2",
        "Conv3DBackpropFilterV2",
        "DepthwiseConv2dNativeBackpropFilter",
    }
)
CONVS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput"})


def shape_args(op: tf.Operation) -> frozenset[int]:
    """The inputs of ``op`` that only give a shape or axes."""
    if op.type == "ConcatV2":
        return frozenset({len(op.inputs) - 1})
    return SHAPE_ARGS.get(op.type, frozenset())


def widening(op: tf.Operation) -> bool:
    """Whether a Cast goes from a float type to a float type at least as wide."""
    src, dst = tf.as_dtype(op.get_attr("SrcT")), tf.as_dtype(op.get_attr("DstT"))
    return src.is_floating and dst.is_floating and dst.size >= src.size


def first_row(begin: tf.Tensor) -> bool:
    """Whether a slice's ``begin`` starts at row 0: a constant, or a concatenation's
    gradient offsets (``ConcatOffset``) along another axis."""
    value = tf.get_static_value(begin)
    if value is not None:
        return int(np.asarray(value).reshape(-1)[0]) == 0
    if begin.op.type != "ConcatOffset":
        return False
    axis, rank = begin.op.inputs[0], begin.op.inputs[1].shape[0]
    if axis.op.type == "FloorMod":  # the axis, modulo the rank
        axis = axis.op.inputs[0]
    value = tf.get_static_value(axis)
    return value is not None and rank is not None and int(value) % rank != 0
