"""Whether a traced weight-gradient program W is a sum over the rows of its batch, the proof
deferred weight gradients (``deferral.py``) rest on: W(concat_m inputs_m) = Σ_m W(inputs_m).

It holds when W is made of operations that act on each row alone (elementwise ops, products
with a weight, reshapes that keep each row's elements together), then sums over the rows (a
kernel gradient's contraction over the batch, a bias gradient's sum) and linear operations on
those sums, and what W reads that is not per row is the same for every micro-batch (the
weights, the loss's seed). :func:`plan` proves it op by op or names the op that stops it; an
op it does not know stops it. Its evidence of the batch axis is two traces of the stage's
forward + backward, at b and at M·b rows: a tensor whose first dimension is b in one and M·b
in the other, the rest equal, is per row. A constant must be equal in both traces unless it
only gives a shape (a reshape's, a sum's axes), and then unequal only in a shape's rows
(``shape_values``): the batch size used as a value, or for another axis, stops it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from hybrid.engine.programs import row_ops, shape_values
from hybrid.engine.programs.split_programs import SplitPrograms, descendants, pure

__all__ = ["Plan", "plan"]

# What a tensor of W is, for the rows of the batch:
ROW = "row"  # per row: concatenating the micro-batches' gives the whole batch's
SUM = "sum"  # a sum over the rows: the micro-batches' add up to the whole batch's
FIXED = "fixed"  # the same for every micro-batch and in both traces
SHAPE = "shape"  # the same for every micro-batch, but depends on the batch size


# Attributes that hold a shape or a constant's value: they differ between the two traces.
_SIZED = frozenset({"shape", "value", "_output_shapes", "output_shapes", "element_shape"})


class _Stop(Exception):
    """W is not (provably) additive over rows: why."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the deferred W's inputs are made from the micro-batches' (``None``: micro-batch
    0's, the same for all; else concatenated): per forward argument, residual (with its
    index among the micro-batch programs' residuals), backward argument and carried tensor."""

    args: list[bool]
    residuals: list[tuple[int, bool]]
    more: list[bool]
    carried: list[tuple[int, bool]]


def plan(
    full: SplitPrograms,
    micro: SplitPrograms,
    micro_batches: int,
    varying_args: Sequence[bool],
    varying_more: Sequence[bool],
    kept: SplitPrograms | None = None,
    row_returns: int = 0,
) -> Plan | str:
    """Whether ``full``'s weight program (traced at ``micro_batches`` times the rows of
    ``micro``, neither adding to running sums) run once on the micro-batches' inputs
    concatenated computes the sum of ``micro``'s over the micro-batches, and how to feed it
    from the tensors the programs ``kept`` (default ``micro``) pass; else why not.

    Args:
      varying_args, varying_more: which forward and backward arguments differ between
        micro-batches (inputs, labels, the seed, output gradients; not the weights).
      row_returns: W's last ``row_returns`` outputs are per row, not sums (the values and
        indices of sparse gradients): the whole batch's must be the micro-batches' joined.
    """
    try:
        analysis = _Analysis(full, micro, micro_batches, kept or micro)
        return analysis.run(varying_args, varying_more, row_returns)
    except _Stop as stop:
        return str(stop)


class _Analysis:
    """One pass over the full trace's W, in graph order (see :func:`plan`)."""

    def __init__(
        self, full: SplitPrograms, micro: SplitPrograms, micro_batches: int, kept: SplitPrograms
    ) -> None:
        self.part, self.micro, self.M, self.kept = full.weights, micro, micro_batches, kept
        self.states: dict[str, str] = {}

    def counterpart(self, t: tf.Tensor) -> tf.Tensor:
        try:
            return self.micro.weights.graph.get_tensor_by_name(t.name)
        except (KeyError, ValueError):
            raise _Stop(f"{t.name} is only in the trace of the whole batch") from None

    def per_row(self, t: tf.Tensor) -> bool:
        """Whether ``t``'s first dimension is the batch's: M times longer in the full trace."""
        full, micro = t.shape, self.counterpart(t).shape
        defined = full.is_fully_defined() and micro.is_fully_defined()
        if not defined or full.rank == 0 or micro.rank != full.rank:
            return False
        return full[0] == self.M * micro[0] and full[1:] == micro[1:]

    def same_op(self, op: tf.Operation) -> None:
        """Stops unless the micro-batch trace has this op with the same type, inputs and
        attributes (shapes and constants aside, which the rules compare): the two traces
        must be one computation at two sizes, not code that branched on the batch size."""
        try:
            other = self.micro.weights.graph.get_operation_by_name(op.name)
        except (KeyError, ValueError):
            raise _Stop(f"{op.name} is only in the trace of the whole batch") from None
        same = other.type == op.type and [t.name for t in other.inputs] == [
            t.name for t in op.inputs
        ]
        attrs, others = op.node_def.attr, other.node_def.attr
        for name in set(attrs) | set(others):
            if name not in _SIZED and (name not in attrs or attrs[name] != others.get(name)):
                same = False
        if not same:
            raise _Stop(f"{op.type} {op.name} differs between the traces of the two sizes")

    def same_shape(self, t: tf.Tensor) -> bool:
        micro = self.counterpart(t).shape
        return t.shape.is_fully_defined() and t.shape == micro

    def source(self, t: tf.Tensor, varies: bool) -> str:
        """A tensor W reads from outside: per row if it varies, else fixed."""
        if varies:
            if not self.per_row(t):
                raise _Stop(f"{t.name} {t.shape} differs per micro-batch but is not per row")
            return ROW
        if not self.same_shape(t):
            raise _Stop(f"{t.name} {t.shape} depends on the batch size")
        return FIXED

    def run(
        self, varying_args: Sequence[bool], varying_more: Sequence[bool], row_returns: int = 0
    ) -> Plan:
        part, graph = self.part, self.part.graph
        placeholders = {f"{n}:0": v for n, v in zip(part.args, varying_args, strict=True)}
        placeholders.update({f"{n}:0": v for n, v in zip(part.more, varying_more, strict=True)})
        roots = [graph.get_tensor_by_name(n).op for n, v in placeholders.items() if v]
        varying = descendants(graph, roots)
        outside = set(part.residuals) | set(part.carried)
        for op in graph.get_operations():  # a topological order
            if op not in part.ops:
                continue
            for t in op.inputs:
                if t.name in self.states:
                    continue
                if t.name in placeholders:
                    self.states[t.name] = self.source(t, placeholders[t.name])
                elif t.name in outside:
                    if t.op not in varying and not _deterministic(t):
                        raise _Stop(f"{t.name} comes from a random or stateful op")
                    self.states[t.name] = self.source(t, t.op in varying)
                elif t.op.type == "Placeholder":  # a captured variable handle
                    self.states[t.name] = self.source(t, False)
                else:
                    raise _Stop(f"{t.name} reaches W from outside its inputs")
            if op.type == "Placeholder":
                continue
            self.same_op(op)
            states = self.rule(op, [self.states[t.name] for t in op.inputs])
            self.states.update((t.name, s) for t, s in zip(op.outputs, states, strict=True))
        rows = len(part.returns) - row_returns
        for i, name in enumerate(part.returns):
            t = graph.get_tensor_by_name(name)
            if name not in self.states and name in outside:  # returned as the forward made it
                self.states[name] = self.source(t, t.op in varying)
            state = self.states.get(name)
            if i >= rows:
                if state != ROW:
                    raise _Stop(f"the sparse gradient's {name} is not per row ({state})")
            elif state != SUM and not (state == FIXED and _zero(t)):
                raise _Stop(f"the gradient {name} is not a sum over the batch ({state})")
        used = {t.name for op in part.ops for t in op.inputs} | set(part.returns)

        def concat(name: str) -> bool:
            return name in used and self.states.get(name) == ROW

        def index(names: list[str], name: str) -> int:
            if name not in names:
                raise _Stop(f"{name} is not kept by the micro-batch's programs")
            return names.index(name)

        return Plan(
            [concat(f"{n}:0") for n in part.args],
            [(index(self.kept.residual_names, n), concat(n)) for n in part.residuals],
            [concat(f"{n}:0") for n in part.more],
            [(index(self.kept.carried_names, n), concat(n)) for n in part.carried],
        )

    def rule(self, op: tf.Operation, ins: list[str]) -> list[str]:
        """The states of ``op``'s outputs, given its inputs'; raises :class:`_Stop`."""
        kinds = set(ins) - {FIXED, SHAPE}
        if not op.outputs and not pure(op):
            raise _Stop(f"{op.type} {op.name} changes state")
        shapes = row_ops.shape_args(op)
        for i in (i for i in shapes if ins[i] == SHAPE):  # may differ in a shape's rows only
            t, rows = op.inputs[i], (op.type, i) in row_ops.ROW_SHAPES
            one_row = op.type == "Sum" and self.counterpart(op.inputs[0]).shape[:1] == [1]
            why = shape_values.beyond_rows(t, self.counterpart(t), self.M, rows, one_row)
            if why is not None:
                raise _Stop(f"{op.type} {op.name} reads {why}")
        if not kinds:
            return [self.constant(op, t, ins) for t in op.outputs]
        for i, s in enumerate(ins):
            if s == SHAPE and i not in shapes:
                raise _Stop(
                    f"{op.type} {op.name} reads {op.inputs[i].name}, a value that "
                    "depends on the batch size"
                )
        if kinds == {SUM}:
            return [self.summed(op, ins, shapes)] * len(op.outputs)
        if kinds != {ROW}:
            raise _Stop(f"{op.type} {op.name} mixes per-row tensors and sums")
        if op.type in ("Shape", "Size", "ShapeN"):
            return [SHAPE] * len(op.outputs)
        if op.type == "Rank":
            return [FIXED]
        return [self.row_op(op, ins)] * len(op.outputs)

    def constant(self, op: tf.Operation, t: tf.Tensor, ins: list[str]) -> str:
        """A tensor computed from fixed values only."""
        if not (pure(op) or op.type == "ReadVariableOp"):
            raise _Stop(f"{op.type} {op.name} is random or stateful")
        shapes = row_ops.shape_args(op)  # (a shape, e.g. Fill's, leaves the values fixed)
        state = SHAPE if any(s == SHAPE and i not in shapes for i, s in enumerate(ins)) else FIXED
        if op.type == "Const":
            full, micro = tf.get_static_value(t), tf.get_static_value(self.counterpart(t))
            same = full is not None and micro is not None and full.shape == micro.shape
            state = FIXED if same and np.array_equal(full, micro) else SHAPE
        if self.same_shape(t):
            return state
        if self.per_row(t) and self.uniform(op, t, ins):
            return ROW
        if t.dtype.is_integer:  # a shape, axes: different in the two traces
            return SHAPE
        raise _Stop(f"{op.type} {op.name} {t.shape} depends on the batch size")

    def uniform(self, op: tf.Operation, t: tf.Tensor, ins: list[str]) -> bool:
        """Whether the fixed per-row tensor ``t`` has the same value in every row."""
        if op.type == "Const":  # one value everywhere, the same in both traces
            full, micro = tf.get_static_value(t), tf.get_static_value(self.counterpart(t))
            if full is None or micro is None or not full.size or not micro.size:
                return False
            return bool(np.all(full == full.flat[0]) and np.all(micro == full.flat[0]))
        if op.type not in row_ops.UNIFORM:
            return False
        value = {"Fill": 1, "BroadcastTo": 0, "Tile": 0}.get(op.type)
        if value is None:  # zeros or ones
            return True
        source = op.inputs[value].shape
        if ins[value] != FIXED or source.rank is None:
            return False
        if op.type == "Tile":
            return source.rank > 0 and source[0] == 1
        return source.rank < t.shape.rank or source[0] == 1

    def summed(self, op: tf.Operation, ins: list[str], shapes: frozenset[int]) -> str:
        """A linear op on sums (and fixed factors) that keeps them off the rows."""
        if not all(self.same_shape(t) for t in op.outputs):
            raise _Stop(f"{op.type} {op.name} spreads a sum over the batch's rows")
        values = [s for i, s in enumerate(ins) if i not in shapes]
        one = values.count(SUM) == 1
        if op.type in row_ops.LINEAR and all(s == SUM for s in values):
            return SUM
        if op.type == "Cast" and not row_ops.widening(op):
            raise _Stop(f"Cast {op.name} of a sum is not linear (to a narrower or integer type)")
        if op.type in row_ops.LINEAR_FIRST and ins[0] == SUM and one:
            return SUM
        if (
            op.type in row_ops.SCALING and ins[0] == SUM or op.type in row_ops.PRODUCTS | {"Mul"}
        ) and one:
            return SUM
        raise _Stop(f"{op.type} {op.name} is not linear in its summed input")

    def row_op(self, op: tf.Operation, ins: list[str]) -> str:
        """The state of an op that reads per-row tensors: per row, a sum, or stopped."""
        fail = _Stop(f"{op.type} {op.name} is not known to act on each row alone")
        if not op.outputs:
            raise fail
        out = op.outputs[0]
        kind, row_out = op.type, all(self.per_row(o) for o in op.outputs)

        def static(i: int) -> np.ndarray:
            value = tf.get_static_value(op.inputs[i])
            if value is None:
                raise fail
            return np.asarray(value)

        def axis(i: int, data: int = 0) -> int:
            return int(static(i).reshape(-1)[0]) % max(op.inputs[data].shape.rank or 1, 1)

        if kind in row_ops.ELEMENTWISE:
            for t, s in zip(op.inputs, ins, strict=True):
                # a fixed operand broadcasts over the rows, a per-row one has the rows
                broadcast = s == FIXED and t.shape.rank == out.shape.rank and t.shape[0] != 1
                misaligned = s == ROW and t.shape.rank != out.shape.rank
                if broadcast or misaligned:
                    raise _Stop(f"{kind} {op.name} broadcasts {t.name} {t.shape} over rows")
            if row_out:
                return ROW
            raise fail
        if kind in ("Sum", "BiasAddGrad") and ins[0] == ROW:
            if row_out:
                return ROW
            if self.same_shape(out):
                return SUM
            raise fail
        if kind == "MatMul" or kind.startswith("BatchMatMul"):
            return self.matmul(op, ins, row_out, fail)
        if kind == "Einsum":
            return self.einsum(op, ins, row_out, fail)
        if kind in row_ops.FILTER_GRADS and ins[0] == ROW and ins[2] == ROW and ins[1] != ROW:
            if self.same_shape(out):
                return SUM
            raise fail
        if kind == "UnsortedSegmentSum" and ins[:2] == [ROW, ROW] and self.same_shape(out):
            return SUM
        if not row_out:
            raise fail
        rows_kept = out.shape[0] == op.inputs[0].shape[0]
        if kind in row_ops.CONVS:
            data = 2 if kind == "Conv2DBackpropInput" else 0
            filt = 1
            if ins[data] == ROW and ins[filt] == FIXED:
                return ROW
        elif kind in ("Reshape", "ExpandDims", "Squeeze", "BroadcastTo", "ZerosLike"):
            same_rank = op.inputs[0].shape.rank == out.shape.rank
            if ins[0] == ROW and (same_rank or kind not in ("BroadcastTo", "ZerosLike")):
                return ROW
        elif kind in ("Softmax", "LogSoftmax") and out.shape.rank >= 2:
            return ROW
        elif kind == "Transpose" and ins[0] == ROW and static(1)[0] == 0:
            return ROW
        elif kind == "Tile" and ins[0] == ROW and static(1)[0] == 1:
            return ROW
        elif kind == "ConcatV2" and axis(len(ins) - 1) != 0:
            if all(s == ROW for s in ins[:-1]):
                return ROW
        elif kind in ("Split", "SplitV"):
            data, at = (1, 0) if kind == "Split" else (0, 2)
            if ins[data] == ROW and axis(at, data) != 0:
                return ROW
        elif kind == "Slice" and ins[0] == ROW and rows_kept and row_ops.first_row(op.inputs[1]):
            return ROW
        elif kind == "StridedSlice" and ins[0] == ROW and rows_kept:
            masks = [
                op.get_attr(m) & 1 for m in ("new_axis_mask", "shrink_axis_mask", "ellipsis_mask")
            ]
            if not any(masks) and static(3)[0] == 1:
                return ROW
        elif kind in ("GatherV2", "Gather") and ins[0] == FIXED and ins[1] == ROW:
            batch_dims = op.get_attr("batch_dims") if "batch_dims" in op.node_def.attr else 0
            if (kind == "Gather" or static(2) == 0) and batch_dims == 0:
                return ROW
        raise fail

    def matmul(self, op: tf.Operation, ins: list[str], row_out: bool, fail: _Stop) -> str:
        """A matrix product: per row (a row operand on the left, a fixed one on the right,
        or batched products whose batch axis is the rows) or a sum (rows contracted)."""
        batched = op.type != "MatMul"
        ta = op.get_attr("adj_x" if batched else "transpose_a")
        tb = op.get_attr("adj_y" if batched else "transpose_b")
        a, b = op.inputs[0], op.inputs[1]
        rank = op.outputs[0].shape.rank
        if row_out and rank is not None and rank >= 3 and batched:
            fixed_ok = all(
                t.shape.rank == rank if s == ROW else t.shape.rank < rank or t.shape[0] == 1
                for t, s in zip((a, b), ins, strict=True)
            )
            if fixed_ok:
                return ROW
        if row_out and ins == [ROW, FIXED] and not ta and rank == 2:
            return ROW
        if ins == [ROW, ROW] and ta and not tb and a.shape.rank == 2:
            if self.same_shape(op.outputs[0]):
                return SUM
        raise fail

    def einsum(self, op: tf.Operation, ins: list[str], row_out: bool, fail: _Stop) -> str:
        """An einsum whose per-row operands all start with the batch letter: per row if the
        output starts with it, a sum if the output lacks it."""
        equation = op.get_attr("equation").decode()
        if "..." in equation or "->" not in equation:
            raise fail
        lhs, result = equation.split("->")
        terms = lhs.split(",")
        letters = {t[0] for t, s in zip(terms, ins, strict=True) if s == ROW}
        if len(letters) != 1:
            raise fail
        (batch,) = letters
        if any(batch in t for t, s in zip(terms, ins, strict=True) if s != ROW):
            raise fail
        if result.startswith(batch) and row_out:
            return ROW
        if batch not in result and self.same_shape(op.outputs[0]):
            return SUM
        raise fail


def _deterministic(t: tf.Tensor) -> bool:
    """Whether ``t`` is computed by pure ops and variable reads only."""
    seen: set[tf.Operation] = set()
    todo = [t.op]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        if not (pure(op) or op.type in ("ReadVariableOp", "Placeholder")):
            return False
        todo += [i.op for i in op.inputs]
    return True


def _zero(t: tf.Tensor) -> bool:
    """Whether the fixed tensor ``t`` is all zeros (a gradient that nothing reaches)."""
    if t.op.type == "ZerosLike":
        return True
    source = t.op.inputs[1] if t.op.type == "Fill" else t
    value = tf.get_static_value(source)
    return value is not None and not np.any(value)
