"""The user's Keras model as a sequence of layer calls, and its cut into stage segments.

A model is a graph of layer calls (a ``keras.Sequential`` or a list of layers is a chain).
The pipeline's unit is one layer call; the calls are taken in a topological order (Keras's
own: deepest nodes first), and a cut into S stages is S contiguous runs of calls::

    calls:   c0 c1 c2 | c3 c4 | c5 c6 c7            (balance 3, 2, 3)
    stage k reads  live(start_k):  every tensor made before its first call (or a model
                                   input) that a call at or after it reads, or that is a
                                   model output
    stage k writes live(stop_k)    (the last stage: the model outputs)

A skip tensor made on stage 0 and read on stage 2 is live at both cuts, so stage 1 passes
it through unchanged (its gradient comes back the same way). A functional model (or a
Sequential) called inside the model is flattened into its own layer calls, in place of its
call, so a cut can fall inside it (KerasHub's task models call their backbone so)::

    model:  ids -> backbone(ids) -> head          calls:  embed block0 block1 norm | head
                   (ids -> embed -> block0 -> block1 -> norm)

Its variables stay the user's (paths, checkpoints and ``to_keras`` see the nesting); a
subclassed model inside stays one call. Each segment runs the user's own
layer objects (``Layer.__call__``, so Keras's call semantics hold); the stage binds their
variables to per-device values around it (``hybrid.engine.step.stage``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from hybrid.engine import keras_private

__all__ = ["Call", "Graph", "Segment", "TensorSpec", "graph_of"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape (without the batch dimension) and dtype of a tensor crossing a stage boundary."""

    shape: tuple[int | None, ...]
    dtype: str

    def zeros(self, batch: int = 1) -> np.ndarray:
        return np.zeros((batch,) + tuple(d or 1 for d in self.shape), dtype=self.dtype)


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a layer in the model.

    Attributes:
      layer: the user's layer object (or a ``keras.ops`` operation of a functional graph).
      inputs: keys of the tensors it reads.
      outputs: keys of the tensors it makes.
      node: the Keras node (its arguments, with the non-tensor ones), or None in a chain;
        its input tensors are read from ``inputs``, in order.
    """

    layer: keras.layers.Layer
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    node: Any = None

    def run(self, values: dict[int, Any], training: bool) -> None:
        """Calls the layer on the tensors in ``values``; adds its outputs to ``values``."""
        call = keras_private.with_training(self.layer, training)
        if self.node is None:
            outputs = call(values[self.inputs[0]])
        else:
            found = zip(self.node.input_tensors, self.inputs, strict=True)
            args, kwargs = self.node.arguments.fill_in({id(t): values[k] for t, k in found})
            outputs = call(*args, **kwargs)
        for key, value in zip(self.outputs, keras.tree.flatten(outputs), strict=True):
            values[key] = value


@dataclasses.dataclass(frozen=True)
class Segment:
    """Calls ``calls`` of a graph, reading the tensors ``inputs`` and writing ``outputs``."""

    calls: tuple[Call, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    @classmethod
    def chain(cls, layers: Sequence[keras.layers.Layer]) -> Segment:
        """The layers applied one after another to one tensor."""
        return graph_of(list(layers)).segment(0, len(layers))

    @property
    def layers(self) -> list[keras.layers.Layer]:
        """The distinct layers called, in call order (not ``keras.ops`` operations, which
        hold no variables)."""
        found: list[keras.layers.Layer] = []
        for call in self.calls:
            if not isinstance(call.layer, keras.layers.Layer):
                continue
            if not any(call.layer is seen for seen in found):
                found.append(call.layer)
        return found

    def run(self, inputs: Sequence[Any], training: bool) -> list[Any]:
        """The segment's output tensors from its input tensors (both in key order)."""
        values = self.trace(inputs, training)
        return [values[key] for key in self.outputs]

    def trace(self, inputs: Sequence[Any], training: bool) -> dict[int, Any]:
        """Every tensor the segment reads or makes, by key."""
        values = dict(zip(self.inputs, inputs, strict=True))
        for call in self.calls:
            call.run(values, training)
        return values


@dataclasses.dataclass(frozen=True)
class Graph:
    """A model's layer calls in topological order, with its input and output tensors.

    Attributes:
      calls: the layer calls; the pipeline's unit of balance.
      inputs: the model input keys, in ``keras.tree.flatten`` order of the input structure.
      outputs: the model output keys, likewise.
      source: the model, or the list of layers.
      input_names: the input structure's keys when the model takes a dict, else None.
      output_names: the output structure's keys when the model returns a dict, else None.
    """

    calls: tuple[Call, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    source: Any
    input_names: tuple[str, ...] | None = None
    output_names: tuple[str, ...] | None = None

    def variables(self) -> tuple[Any, ...]:
        """Every variable of the model once, in ``model.weights`` order (a list of layers:
        its layers' weights in order); known once the layers are built."""
        if isinstance(self.source, keras.Model):
            weights = list(self.source.weights)
        else:
            weights = [v for layer in self.source for v in layer.weights]
        seen: dict[int, Any] = {}
        for v in weights:
            seen.setdefault(id(v), v)
        return tuple(seen.values())

    def keras_model(self, input_specs: Sequence[Any]) -> keras.Model:
        """The model (a list of layers: a Sequential of them, for inputs of ``input_specs``)."""
        if isinstance(self.source, keras.Model):
            return self.source
        (spec,) = input_specs
        return keras.Sequential([keras.Input(spec.shape, dtype=spec.dtype), *self.source])

    def live(self, cut: int) -> tuple[int, ...]:
        """The tensors crossing the cut before call ``cut``: made before it (model inputs
        included), read at or after it or returned by the model; in the order made."""
        if cut == len(self.calls):
            return self.outputs
        made = list(self.inputs) + [k for call in self.calls[:cut] for k in call.outputs]
        needed = {k for call in self.calls[cut:] for k in call.inputs} | set(self.outputs)
        live: list[int] = []
        for key in made:
            if key in needed and key not in live:
                live.append(key)
        return tuple(live)

    def trace(self, inputs: Sequence[Any], training: bool = False) -> dict[int, Any]:
        """Every tensor of the model on ``inputs``, by key (runs, and so builds, each call)."""
        values = dict(zip(self.inputs, inputs, strict=True))
        for call in self.calls:
            call.run(values, training)
        return values

    def segment(self, start: int, stop: int) -> Segment:
        return Segment(self.calls[start:stop], self.live(start), self.live(stop))

    def segments(self, balance: Sequence[int]) -> list[Segment]:
        """The stages' segments for ``balance`` calls per stage."""
        starts = [0]
        for count in balance:
            starts.append(starts[-1] + count)
        return [self.segment(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)]


def graph_of(model: keras.Model | Sequence[keras.layers.Layer]) -> Graph:
    """The layer calls of ``model``: a functional model or Sequential (built), or a list of
    layers applied in order.

    Raises:
      TypeError: a subclassed model (its call is Python code the pipeline cannot cut), or
        a list holding something other than layers.
      ValueError: an empty model, or a list of layers that the model they came from does not
        apply as a chain (a merge or a skip connection): pass the model itself.
    """
    if isinstance(model, keras.Model):
        functional = keras_private.functional_of(model)
        if functional is not None:
            return _functional_graph(functional)
        if isinstance(model, keras.Sequential):
            return _chain(list(model.layers), model)
        raise TypeError(
            f"{type(model).__name__} is a subclassed Keras model: its call() is Python code "
            "that cannot be cut into stages. Express it as a functional model "
            "(keras.Model(inputs, outputs)) or a keras.Sequential, or pass its layers as a "
            "list when call() applies them one after another"
        )
    if isinstance(model, Sequence) and not isinstance(model, str):
        layers = list(model)
        for i, layer in enumerate(layers):
            if not isinstance(layer, keras.layers.Layer):
                raise TypeError(f"model layer {i} is {type(layer).__name__}, not a Keras layer")
        _check_chain(layers)
        return _chain(layers, layers)
    raise TypeError(
        f"model must be a Keras model (functional or Sequential) or a list of Keras layers, "
        f"got {type(model).__name__}"
    )


def _chain(layers: list[keras.layers.Layer], source: Any) -> Graph:
    if not layers:
        raise ValueError("the model has no layers")
    calls = tuple(Call(layer, (i,), (i + 1,)) for i, layer in enumerate(layers))
    return Graph(calls, (0,), (len(layers),), source)


def _functional_graph(model: keras.Model) -> Graph:
    calls = _Flattener().calls(model, {})
    if not calls:
        raise ValueError(f"model {model.name!r} has no layers")
    return Graph(
        tuple(calls),
        tuple(id(t) for t in model.inputs),
        tuple(id(t) for t in model.outputs),
        model,
        _names(keras_private.input_structure(model)),
        _names(keras_private.output_structure(model)),
    )


class _Flattener:
    """A functional model's calls in topological order, each nested functional model's
    calls in place of its call. A tensor's key is its ``id`` in the outer model; inside a
    nested model, the outer tensor it stands for, or a new negative key (a model called
    twice makes new tensors each time)."""

    def __init__(self) -> None:
        self._fresh = 0

    def calls(self, model: keras.Model, keys: dict[int, int]) -> list[Call]:
        """``model``'s calls; ``keys`` maps its boundary tensors (ids) to outer keys."""
        scope: dict[int, int] = dict(keys)

        def key(t: Any) -> int:
            if id(t) not in scope:
                if keys:  # inside a nested model: a key no outer tensor has
                    self._fresh -= 1
                    scope[id(t)] = self._fresh
                else:
                    scope[id(t)] = id(t)
            return scope[id(t)]

        calls: list[Call] = []
        by_depth = model._nodes_by_depth
        for depth in sorted(by_depth, reverse=True):
            for node in by_depth[depth]:
                if node.operation is None or node.is_input:
                    continue
                ins = tuple(key(t) for t in node.input_tensors)
                outs = tuple(key(t) for t in node.outputs)
                inner = _nested(node)
                if inner is None:
                    calls.append(Call(node.operation, ins, outs, node))
                    continue
                boundary = zip(_flat_inputs(inner) + _flat_outputs(inner), ins + outs, strict=True)
                calls += self.calls(inner, {id(t): k for t, k in boundary})
        return calls


def _nested(node: Any) -> keras.Model | None:
    """The functional model a node calls, when it can be flattened (called on one input
    structure matching its own, its outputs made inside it), else None.

    A ``training=`` given to the nested call is dropped, as Keras drops it: a functional
    model passes its own call's training mode to every call in its graph, overriding the
    recorded one (Keras 3.15 trains the BatchNormalization of ``base(x, training=False)``
    inside a model that ``fit`` trains)."""
    if not isinstance(node.operation, keras.Model):
        return None
    inner = keras_private.functional_of(node.operation)
    args = node.arguments.args
    kwargs = {  # without the masks Keras passes as None (mask=None, or a dict of None)
        k: v
        for k, v in node.arguments.kwargs.items()
        if any(leaf is not None for leaf in keras.tree.flatten(v))
    }
    kwargs.pop("training", None)
    if inner is None or len(args) != 1 or kwargs:
        return None
    inputs, outputs = _flat_inputs(inner), _flat_outputs(inner)
    if not _passed_as_is(args[0], keras_private.input_structure(inner)):
        return None  # Keras would rearrange or convert the inputs at the boundary
    if len(node.outputs) != len(outputs):
        return None
    passed = {id(t) for t in inputs}
    if any(id(t) in passed for t in outputs) or len({id(t) for t in outputs}) < len(outputs):
        return None  # an input returned as it is, or one tensor returned twice
    return inner


def _passed_as_is(given: Any, declared: Any) -> bool:
    """Whether a functional model called on ``given`` would take each tensor as the input
    in its place of ``declared`` unchanged: the same structure (a dict with the same keys, a
    list of the same length; Keras maps a dict onto a list of inputs by name), and each
    tensor of the input's dtype and rank (Keras converts and reshapes otherwise)."""
    try:
        keras.tree.assert_same_structure(given, declared)
    except (TypeError, ValueError):
        return False
    pairs = zip(keras.tree.flatten(given), keras.tree.flatten(declared), strict=True)
    return all(
        keras.backend.standardize_dtype(a.dtype) == keras.backend.standardize_dtype(b.dtype)
        and len(a.shape) == len(b.shape)
        for a, b in pairs
    )


def _flat_inputs(model: keras.Model) -> list[Any]:
    return list(keras.tree.flatten(keras_private.input_structure(model)))


def _flat_outputs(model: keras.Model) -> list[Any]:
    return list(keras.tree.flatten(keras_private.output_structure(model)))


def _names(structure: Any) -> tuple[str, ...] | None:
    return tuple(sorted(structure)) if isinstance(structure, dict) else None


def _check_chain(layers: list[keras.layers.Layer]) -> None:
    """Refuses layers taken from a model that does not apply them one after another."""
    for i, layer in enumerate(layers):
        for node in getattr(layer, "_inbound_nodes", []):
            sources = [t._keras_history.operation for t in node.input_tensors]
            chained = i == 0 or all(
                s is layers[i - 1] or isinstance(s, keras.layers.InputLayer) for s in sources
            )
            if len(sources) > 1 or not chained:
                names = ", ".join(repr(s.name) for s in sources)
                raise ValueError(
                    f"layer {i} {layer.name!r} ({type(layer).__name__}) reads the outputs of "
                    f"{names} in the model it was built in, so applying the list of layers in "
                    "order would train a different model (without its merges or skip "
                    "connections); pass the Keras model itself to Pipeline"
                )
