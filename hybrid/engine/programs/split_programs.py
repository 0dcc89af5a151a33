"""One traced forward-and-backward computation cut into two programs that pass their
residuals explicitly: what a stage runs when it keeps activations (``remat="never"``).

TensorFlow's own route, a ``GradientTape`` around a compiled forward program, makes the
forward return every tensor its backward reads, the inputs included; an XLA program cannot
return an input without copying it, so each micro-batch's forward copied the stage's whole
weights, its backward computed the input gradient even where nothing needs it (the first
stage), and the gradients were accumulated by TensorFlow ops outside the program. Here the
joint computation is traced once as one graph,

    joint(forward_args, backward_args) -> forward_outputs + backward_outputs,

and its nodes are sorted by what they depend on:

- backward nodes: everything that depends on ``backward_args`` (output gradients, the
  running gradient sums);
- recomputed in the backward: pure nodes that depend on no data input (constants, a weight
  cast to float16, a dropout mask of the seed) and cheap views of what the backward has;
- residuals: every other forward tensor a backward node reads (activations, the loss's
  softmax): the forward program returns them after its outputs.

A split backward (zero-bubble schedules: B computes the input gradients, W later the
weight gradients) cuts the backward nodes once more, into those the input gradients need
and the rest; the first part also returns the tensors of its own the rest reads.

The programs import their parts of the one graph (``tf.graph_util.import_graph_def``),
so they compute exactly the ops the joint computation would, and every input of the
forward (weights, micro-batch) is passed to the backward directly, never through the
forward's outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import tensorflow as tf
from tensorflow.python.framework import op_def_registry

from hybrid.engine.programs.shape_values import SHAPE_OPS
from hybrid.engine.traced import Traced

__all__ = ["Part", "SplitPrograms", "descendants", "flatten", "pure", "signature", "split"]

Tensors = list[tf.Tensor]


class Part(NamedTuple):
    """What one backward program computes, in the traced graph: for an analysis of it
    (``row_sums.py``: may its weight gradients run once over all micro-batches?).

    Attributes:
      graph: the traced joint graph.
      ops: the program's nodes (recomputed ones and the placeholders it reads included).
      returns: names of the tensors it returns.
      args, more: the forward's and the backward's argument placeholders (op names), in the
        order the program takes them.
      residuals, carried: names of the residuals and carried tensors, in the order the
        program takes them (what it reads of them is ``ops``' inputs).
    """

    graph: tf.Graph
    ops: frozenset[tf.Operation]
    returns: list[str]
    args: list[str]
    more: list[str]
    residuals: list[str]
    carried: list[str]


# Ops a backward may recompute from what it has although they depend on data: views.
_VIEWS = frozenset({"Identity", "Reshape", "ExpandDims", "Squeeze", "Shape", "Const"})
_SOURCES = frozenset({"Placeholder", "Const"})


def pure(op: tf.Operation) -> bool:
    """Whether running ``op`` twice gives the same values and changes nothing."""
    if op.type in _SOURCES:
        return True
    definition = op_def_registry.get(op.type)
    return definition is not None and not definition.is_stateful


class SplitPrograms:
    """The forward and backward programs of one joint computation at one signature.

    ``forward(forward_args) -> forward_outputs + residuals``;
    ``backward(forward_args, residuals, backward_args) -> backward_outputs``; and when the
    backward was cut again after its first outputs (``split(..., first=n)``, a split
    backward's B and W), ``input_backward`` computes those and what the rest carries over,
    ``weight_backward`` the rest.

    Attributes:
      num_outputs: the forward's outputs before its residuals.
      output_names: the traced tensors the forward's outputs are, through the identities
        the trace returns them by (a residual may be one).
      reads: per forward argument, whether the (whole) backward reads it.
      residual_names, carried_names: the traced tensors the residuals (and what
        ``input_backward`` carries over) are, in the order the programs pass them.
      weights: the program that computes the weight gradients: ``weight_backward`` when
        the backward is cut, else ``backward``.
    """

    def __init__(
        self,
        forward: Any,
        backward: Any,
        num_outputs: int,
        parts: tuple[Any, Any, int] | None,
        residual_names: list[str],
        carried_names: list[str],
        weights: Part,
        output_names: list[str],
        reads: list[bool],
    ) -> None:
        self._forward = forward
        self._backward = backward
        self.num_outputs = num_outputs
        self.output_names = output_names
        self.reads = reads
        self._parts = parts
        self.residual_names = residual_names
        self.carried_names = carried_names
        self.weights = weights

    def forward(self, args: Sequence[tf.Tensor]) -> tuple[Tensors, Tensors]:
        """The forward outputs and the residuals to hand to :meth:`backward`."""
        out = self._forward(list(args))
        return out[: self.num_outputs], out[self.num_outputs :]

    def backward(
        self, args: Sequence[tf.Tensor], residuals: Sequence[tf.Tensor], more: Sequence[tf.Tensor]
    ) -> Tensors:
        return self._backward(list(args), list(residuals), list(more))

    @property
    def cut_backward(self) -> bool:
        """Whether the backward also comes as :meth:`input_backward` + :meth:`weight_backward`."""
        return self._parts is not None

    def input_backward(
        self, args: Sequence[tf.Tensor], residuals: Sequence[tf.Tensor], more: Sequence[tf.Tensor]
    ) -> tuple[Tensors, Tensors]:
        """The backward's first outputs, and what :meth:`weight_backward` carries on from."""
        assert self._parts is not None, "split(..., first=n) cuts the backward"
        first, _, count = self._parts
        out = first(list(args), list(residuals), list(more))
        return out[:count], out[count:]

    def weight_backward(
        self,
        args: Sequence[tf.Tensor],
        residuals: Sequence[tf.Tensor],
        more: Sequence[tf.Tensor],
        carried: Sequence[tf.Tensor],
    ) -> Tensors:
        """The backward's other outputs, from what :meth:`input_backward` carried over."""
        assert self._parts is not None, "split(..., first=n) cuts the backward"
        return self._parts[1](list(args), list(residuals), list(more), list(carried))


def split(
    joint: Callable[[Tensors, Tensors], tuple[Tensors, Tensors]],
    forward_args: Sequence[tf.Tensor | tf.TensorSpec],
    backward_args: Sequence[tf.Tensor | tf.TensorSpec],
    data: Sequence[int],
    jit_compile: bool,
    first: int | None = None,
) -> SplitPrograms:
    """Traces ``joint`` once and cuts it (see the module docstring).

    Args:
      joint: ``joint(forward_args, backward_args) -> (forward_outputs, backward_outputs)``,
        lists of tensors; no forward output may depend on a backward argument.
      forward_args, backward_args: tensors or specs of the two argument lists.
      data: indices into ``forward_args`` of the data (what varies per micro-batch: stage
        inputs, labels); nodes that depend on them are never recomputed by the backward
        unless they are views.
      jit_compile: compile the programs with XLA.
      first: also cut the backward after its first ``first`` outputs: its nodes those
        outputs depend on run first (a split backward's B: the input gradients) and return
        what the others read from them, the rest then run alone (W: the weight gradients),
        neither computing anything twice.
    """
    f_specs = [_spec(a) for a in forward_args]
    b_specs = [_spec(a) for a in backward_args]
    counts: list[int] = []

    def flat(f_args: Tensors, b_args: Tensors) -> Tensors:
        outs, grads = joint(f_args, b_args)
        counts[:] = [len(outs), len(grads)]
        return list(outs) + list(grads)

    # Traced at the root name scope: its op names do not depend on where it is traced from.
    with tf.compat.v1.get_default_graph().name_scope(None):
        traced = tf.function(flat, autograph=False).get_concrete_function(f_specs, b_specs)
    graph = traced.graph
    n_f, n_b = len(f_specs), len(b_specs)
    placeholders = [t.op for t in graph.inputs]
    f_inputs, b_inputs = placeholders[:n_f], placeholders[n_f : n_f + n_b]
    captures = (t.op.name for t in graph.internal_captures)
    captured = dict(zip(captures, traced.captured_inputs, strict=True))
    outputs = list(graph.outputs)
    f_outputs, b_outputs = outputs[: counts[0]], outputs[counts[0] :]

    backward_ops = descendants(graph, b_inputs)
    data_ops = descendants(graph, [f_inputs[i] for i in data])
    for t in f_outputs:
        if t.op in backward_ops:
            raise ValueError(f"forward output {t.name} depends on a backward argument")

    # What the backward needs from outside its own nodes, and which of it is recomputed.
    recompute: set[tf.Operation] = set()
    residuals: dict[str, tf.Tensor] = {}  # by name, in the order found
    kept: set[tf.Operation] = set()  # known not to be recomputable

    def inputs(op: tf.Operation) -> set[tf.Operation]:
        return {t.op for t in op.inputs if t.op.type != "Placeholder"}

    def recomputable(root: tf.Operation) -> bool:
        """Pure, reading no data (views aside) nor what does; a loop: chains may be long."""
        todo = [root]
        while todo:
            op = todo[-1]
            if op in recompute or op in kept or op.type == "Placeholder":
                todo.pop()
            elif not pure(op) or op in data_ops and op.type not in _VIEWS or kept & inputs(op):
                kept.add(todo.pop())
            elif pending := inputs(op) - recompute:
                todo += pending
            else:
                recompute.add(todo.pop())
        return root in recompute or root.type == "Placeholder"

    def needed(t: tf.Tensor) -> None:
        """Makes ``t`` available to the backward: its own, recomputed, or a residual."""
        if t.op in backward_ops or recomputable(t.op) or t.name in residuals:
            return
        residuals[t.name] = t

    b_program = _ancestors(b_outputs, stop=lambda op: op not in backward_ops)
    for op in sorted(b_program, key=lambda o: o.name):
        for t in op.inputs:
            needed(t)
    for t in b_outputs:  # a gradient that does not depend on the output gradients (zeros)
        needed(t)
    # A shape of what the backward has is computed there, not kept: W on more rows reads its own.
    for name, t in list(residuals.items()):
        have = (backward_ops, recompute)
        if t.op.type in SHAPE_OPS and all(
            i.op.type == "Placeholder" or any(i.op in h for h in have) or i.name in residuals
            for i in t.op.inputs
        ):
            recompute.add(t.op)
            del residuals[name]
    f_nodes = {o.name for o in _ancestors(f_outputs + [*residuals.values()]) - backward_ops}
    graph_def = graph.as_graph_def()
    f_def = _subgraph(graph_def, f_nodes)
    f_names = [op.name for op in f_inputs]
    b_names = [op.name for op in b_inputs]
    r_names = list(residuals)
    f_returns = [t.name for t in f_outputs] + r_names

    def arguments(names: Sequence[str], values: Tensors) -> dict[str, tf.Tensor]:
        return dict(zip((f"{n}:0" for n in names), values, strict=True))

    def forward(f_args: Tensors) -> Tensors:
        mapping = _input_map(f_names, f_args, captured, f_nodes)
        return _import(f_def, mapping, f_returns, arguments(f_names, f_args))

    def part(
        ops: set[tf.Operation], returns: list[str], carried: Sequence[str] = ()
    ) -> tuple[Any, Part]:
        """The program of backward nodes ``ops`` (and what they recompute): it reads the
        forward's arguments and residuals, the backward's arguments and the tensors named
        ``carried`` (computed by an earlier part), and returns ``returns``."""
        ops = ops | recompute
        ops |= {t.op for op in ops for t in op.inputs if t.op.type == "Placeholder"}
        about = Part(graph, frozenset(ops), returns, f_names, b_names, r_names, list(carried))
        nodes = {op.name for op in ops}
        consumed = {t.name for op in ops for t in op.inputs}
        part_def = _subgraph(graph_def, nodes)

        def run(
            f_args: Tensors, rs: Tensors, b_args: Tensors, more: Sequence[tf.Tensor] = ()
        ) -> Tensors:
            mapping = _input_map(f_names, f_args, captured, nodes)
            mapping.update(_input_map(b_names, b_args, {}, nodes))
            given = dict(zip(r_names, rs, strict=True))
            given.update(zip(carried, more, strict=True))
            mapping.update((n, r) for n, r in given.items() if n in consumed)
            given.update(arguments(f_names, f_args))
            given.update(arguments(b_names, b_args))
            return _import(part_def, mapping, returns, given)

        return Traced(run, jit_compile), about

    b_returns = [t.name for t in b_outputs]
    backward, weights = part(b_program, b_returns)
    read = {op.name for op in weights.ops}
    parts, carried = None, []
    if first is not None:
        in_first = _ancestors(b_outputs[:first], stop=lambda op: op not in backward_ops)
        in_rest = _ancestors(
            b_outputs[first:], stop=lambda op: op not in backward_ops or op in in_first
        )
        reads = [t for op in in_rest for t in op.inputs] + b_outputs[first:]
        carried = sorted({t.name for t in reads if t.op in in_first})
        rest, weights = part(in_rest, b_returns[first:], carried)
        parts = (part(in_first, b_returns[:first] + carried)[0], rest, first)
    return SplitPrograms(
        Traced(forward, jit_compile),
        backward,
        counts[0],
        parts,
        r_names,
        carried,
        weights,
        [_through_identities(t).name for t in f_outputs],
        [name in read for name in f_names],
    )


def _through_identities(t: tf.Tensor) -> tf.Tensor:
    """The tensor ``t`` is an identity (of an identity ...) of."""
    while t.op.type == "Identity" and t.op.inputs:
        t = t.op.inputs[0]
    return t


def flatten(structure: Any) -> tuple[Tensors, Callable[[Sequence[tf.Tensor]], Any]]:
    """The tensors of a nest of lists and tuples (None leaves skipped), and the function
    that puts tensors back in their places."""
    leaves = tf.nest.flatten(structure)
    tensors = [leaf for leaf in leaves if leaf is not None]

    def rebuild(values: Sequence[tf.Tensor]) -> Any:
        found = iter(values)
        return tf.nest.pack_sequence_as(
            structure, [None if leaf is None else next(found) for leaf in leaves]
        )

    return tensors, rebuild


def signature(structure: Any) -> str:
    """What a trace of ``structure`` depends on: its nesting, its None leaves, and the
    shape and dtype of each tensor."""
    return repr(
        tf.nest.map_structure(
            lambda t: None if t is None else (tuple(t.shape), t.dtype.name), structure
        )
    )


def _spec(value: tf.Tensor | tf.TensorSpec) -> tf.TensorSpec:
    """``value``'s shape and dtype, without a name: the traced placeholders are named by
    their place in the arguments, not by the tensors given, so two traces match."""
    return tf.TensorSpec(value.shape, value.dtype)


def descendants(graph: tf.Graph, roots: Sequence[tf.Operation]) -> set[tf.Operation]:
    """The ops that depend on ``roots`` (data or control), the roots included."""
    found = set(roots)
    for op in graph.get_operations():  # creation order is a topological order
        if any(t.op in found for t in op.inputs) or any(c in found for c in op.control_inputs):
            found.add(op)
    return found


def _ancestors(
    tensors: Sequence[tf.Tensor],
    stop: Callable[[tf.Operation], bool] = lambda op: False,
    roots: Any = (),
) -> set[tf.Operation]:
    """The ops ``tensors`` (and ``roots``) are computed from, data and control inputs
    followed, not going past an op for which ``stop`` holds."""
    found: set[tf.Operation] = set()
    todo = [t.op for t in tensors] + list(roots)
    while todo:
        op = todo.pop()
        if op in found or stop(op):
            continue
        found.add(op)
        todo += [t.op for t in op.inputs] + list(op.control_inputs)
    return found


def _subgraph(graph_def: Any, names: set[str]) -> Any:
    """``graph_def`` with only the nodes ``names`` that are not placeholders (what they
    fed comes through the import's ``input_map``), control inputs to dropped nodes and
    colocation hints removed, its function library kept."""
    kept = {n.name for n in graph_def.node if n.name in names and n.op != "Placeholder"}
    out = type(graph_def)()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name not in kept:
            continue
        copy = out.node.add()
        copy.CopyFrom(node)
        del copy.input[:]
        for name in node.input:
            if not name.startswith("^") or name[1:] in kept:
                copy.input.append(name)
        if "_class" in copy.attr:
            del copy.attr["_class"]
        copy.device = ""
    return out


def _input_map(
    names: Sequence[str], values: Sequence[Any], captured: dict[str, Any], used: set[str]
) -> dict[str, Any]:
    """Placeholder tensor name -> the value it takes in the program being traced: the
    arguments, and what the joint computation captured (variable handles), captured
    again by this program."""
    mapping = {f"{n}:0": v for n, v in zip(names, values, strict=True) if n in used}
    graph = tf.compat.v1.get_default_graph()
    mapping.update({f"{n}:0": graph.capture(v) for n, v in captured.items() if n in used})
    return mapping


def _import(
    graph_def: Any, mapping: dict[str, Any], returns: Sequence[str], given: dict[str, Any]
) -> Tensors:
    """The tensors ``returns`` names: those in ``given`` as they are (an argument or a
    residual returned unchanged), the others from ``graph_def`` imported into the program
    being traced with ``mapping`` as its inputs."""
    wanted = [n for n in returns if n not in given]
    imported = iter(
        tf.graph_util.import_graph_def(
            graph_def, input_map=mapping, return_elements=wanted, name="split"
        )
        if wanted
        else []
    )
    return [given[n] if n in given else next(imported) for n in returns]
