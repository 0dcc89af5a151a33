"""A model as the planner profiles it: the layer calls the Pipeline cuts, each with the
shape and dtype of every tensor it reads and makes.

The units are the Pipeline's (:func:`hybrid.engine.model.graph.graph_of`): the calls of the
flattened graph in topological order, nested functional models (a KerasHub task model's
backbone) flattened in place. Each call is profiled as a stage on the tensors the graph
passes it (:meth:`ModelCalls.segment`: a merge reads several, a skip's source is read
twice, a call given ``reverse=True`` or a mask gets them), so a model with skips, merges,
several inputs and tied weights is planned as a chain is::

    calls:     c0  c1  c2  c3  c4          (a skip from c0's output to c3's input)
    cut 2 sends live(2) = c1's output and c0's output: boundary_bytes(1) counts both

A model of many calls (a Keras Applications CNN: 150-300) is measured in at most a few
dozen contiguous runs of calls (:meth:`ModelCalls.groups`), each one stage, and a run's
figures are shared among its calls by their estimated work: what a profile costs stays
bounded whatever the depth.

A list of layers, or a ``Sequential``, is the chain of its layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hybrid.core.partition import balance_by_cost
from hybrid.engine.model.graph import Call, Graph, Segment, TensorSpec, graph_of
from hybrid.engine.model.layer_costs import compute_costs

__all__ = ["ModelCalls", "model_calls"]


@dataclasses.dataclass(frozen=True)
class ModelCalls:
    """A model's layer calls and the spec (shape without batch, dtype) of every tensor.

    Attributes:
      graph: the calls, inputs and outputs (the Pipeline's :class:`Graph`).
      specs: every tensor's spec by key, the model inputs' included.
    """

    graph: Graph
    specs: Mapping[int, TensorSpec]

    @property
    def calls(self) -> tuple[Call, ...]:
        return self.graph.calls

    @property
    def names(self) -> list[str]:
        """Each call's layer (or operation) name, for the profile's rows."""
        return [str(getattr(c.layer, "name", type(c.layer).__name__)) for c in self.calls]

    @property
    def input_specs(self) -> list[TensorSpec]:
        return [self.specs[k] for k in self.graph.inputs]

    def segment(self, start: int, stop: int) -> Segment:
        """Calls ``start`` to ``stop - 1`` alone: reading each tensor they are passed from
        outside once, writing what they make that a later call reads or the model returns
        (the last call's outputs at least); no skip passing over them."""
        calls = self.calls[start:stop]
        made = {k for call in calls for k in call.outputs}
        inputs = dict.fromkeys(k for call in calls for k in call.inputs if k not in made)
        later = {k for call in self.calls[stop:] for k in call.inputs}
        later |= set(self.graph.outputs) | set(calls[-1].outputs)
        outputs = dict.fromkeys(k for call in calls for k in call.outputs if k in later)
        return Segment(tuple(calls), tuple(inputs), tuple(outputs))

    def work(self) -> list[float]:
        """Each call's estimated work per example (multiply-adds,
        :func:`hybrid.engine.model.layer_costs.call_work`), from the specs."""
        values = {k: tf.TensorSpec((1, *spec.shape), spec.dtype) for k, spec in self.specs.items()}
        return compute_costs(self.calls, values)

    def groups(self, limit: int) -> list[tuple[int, int]]:
        """The calls as at most ``limit`` contiguous runs ``(start, stop)``, each measured
        as one stage: every call alone when there are no more than ``limit``; else runs
        whose estimated work (:meth:`work`) balances, as a cut into ``limit`` stages would."""
        n = len(self.calls)
        if n <= limit:
            return [(i, i + 1) for i in range(n)]
        counts = balance_by_cost([w + 1e-9 for w in self.work()], limit)
        runs, start = [], 0
        for count in counts:
            runs.append((start, start + count))
            start += count
        return runs

    def arguments(self, i: int) -> list[Any]:
        """Call ``i``'s non-tensor arguments (``reverse=True``, ``training=False``, ...),
        the tensors replaced by their position: what, beside its layer and inputs, decides
        what it computes."""
        node = self.calls[i].node
        if node is None:
            return []
        tensors = {id(t) for t in node.input_tensors}

        def constant(value: Any) -> Any:
            return "<tensor>" if id(value) in tensors else value

        args = keras.tree.map_structure(constant, list(node.arguments.args))
        kwargs = keras.tree.map_structure(constant, dict(node.arguments.kwargs))
        return [args, sorted(kwargs.items())]

    def wiring(self) -> list[list[int]]:
        """Which tensors each call reads, as the numbers of the tensors in the order they
        appear (model inputs first): two models with the same layers wired differently
        differ here."""
        numbers = {k: n for n, k in enumerate(self.graph.inputs)}
        for call in self.calls:
            for key in call.outputs:
                numbers.setdefault(key, len(numbers))
        return [[numbers[k] for k in call.inputs] for call in self.calls]

    def example_bytes(self, key: int) -> int:
        """Bytes of one example of tensor ``key``."""
        return _bytes(self.specs[key])

    def boundary_bytes(self, i: int) -> float:
        """Bytes per example of every tensor crossing the cut after call ``i`` (its outputs
        still needed, and every skip passing over it)."""
        return float(sum(_bytes(self.specs[k]) for k in self.graph.live(i + 1)))

    @property
    def input_bytes(self) -> float:
        """Bytes of one example of the model inputs."""
        return float(sum(_bytes(spec) for spec in self.input_specs))

    @property
    def input_is_float(self) -> bool:
        """Whether any model input has a gradient (token ids and masks do not)."""
        return any(tf.as_dtype(spec.dtype).is_floating for spec in self.input_specs)

    def layers(self) -> list[Any]:
        """The distinct layers called, in call order (operations hold no weights)."""
        return self.graph.segment(0, len(self.calls)).layers


def model_calls(
    model: keras.Model | Sequence[keras.layers.Layer],
    input_shape: Sequence[int] | None = None,
    input_dtype: str = "float32",
    x: Any = None,
) -> ModelCalls:
    """``model``'s calls and the spec of every tensor, found by running the model once on
    one example of zeros (which builds layers not built yet).

    The input comes from ``x`` when given (a sample batch in the structure the model takes:
    its shapes and dtypes; the values are not used), else ``input_shape`` and
    ``input_dtype`` (one input), else the model's ``keras.Input``.

    Raises:
      ValueError: a subclassed model (no graph to cut), a model with several outputs, an
        input left open (a ``None`` dimension) with neither ``x`` nor ``input_shape``, or
        an input shape for a model with several inputs; each names the fix.
    """
    try:
        graph = graph_of(model if isinstance(model, keras.Model) else list(model))
    except TypeError as err:  # a subclassed model, or something that is not layers
        raise ValueError(f"plan() profiles the layer calls the Pipeline cuts: {err}") from None
    if len(graph.outputs) != 1:
        raise ValueError(
            f"plan() profiles models with one output; {_name(model)} returns "
            f"{len(graph.outputs)}: plan it from a CostProfile (hybrid.planning.CostProfile), "
            "or choose the mesh yourself and compare with pipe.summary()"
        )
    given = _given_specs(x, input_shape, input_dtype, graph, model)
    with tf.device("/CPU:0"):
        inputs = [tf.convert_to_tensor(spec.zeros(1)) for spec in given]
        values = graph.trace(inputs)
    specs = {k: TensorSpec(tuple(v.shape[1:]), v.dtype.name) for k, v in values.items()}
    if graph.outputs[0] not in graph.calls[-1].outputs:
        raise ValueError(
            f"plan() measures the loss on the last layer call; {_name(model)}'s output is "
            "made by an earlier call: plan it from a CostProfile, or choose the mesh yourself"
        )
    return ModelCalls(graph, specs)


def _given_specs(
    x: Any,
    input_shape: Sequence[int] | None,
    input_dtype: str,
    graph: Graph,
    model: Any,
) -> list[TensorSpec]:
    """The model inputs' specs, in the graph's input order."""
    count = len(graph.inputs)
    if x is not None:
        flat = keras.tree.flatten(x)
        if len(flat) != count:
            raise ValueError(
                f"x holds {len(flat)} arrays; {_name(model)} takes {count} inputs: give a "
                "sample batch in the structure the model is called on"
            )
        return [TensorSpec(tuple(np.shape(t)[1:]), _dtype(t)) for t in flat]
    if input_shape is not None:
        if count != 1:
            raise ValueError(
                f"input_shape describes one input; {_name(model)} takes {count}: give "
                "plan(x=...) a sample batch (a dict or list of arrays, as fit takes)"
            )
        return [TensorSpec(tuple(int(d) for d in input_shape), str(input_dtype))]
    if not isinstance(model, keras.Model) or not model.inputs:
        raise ValueError(
            "plan() needs input_shape (without the batch dimension) to profile a list of "
            "layers or a Sequential without keras.Input, or a CostProfile instead"
        )
    specs = [TensorSpec(tuple(t.shape[1:]), str(t.dtype)) for t in model.inputs]
    for spec in specs:
        if None in spec.shape:
            raise ValueError(
                f"{_name(model)} leaves an input dimension open {spec.shape}: the planner "
                "profiles at a fixed input shape; give plan() input_shape= (e.g. with the "
                "sequence length) or x= (a sample batch), or the model's keras.Input a "
                "fixed shape"
            )
    return specs


def _dtype(t: Any) -> str:
    dtype = getattr(t, "dtype", None)
    return tf.as_dtype(dtype if dtype is not None else np.asarray(t).dtype).name


def _bytes(spec: TensorSpec) -> int:
    return math.prod(int(d or 1) for d in spec.shape) * tf.as_dtype(spec.dtype).size


def _name(model: Any) -> str:
    return repr(model.name) if isinstance(model, keras.Model) else "the list of layers"
