"""A Keras model as the list of layers the planner profiles, where it is a chain.

The profiler measures each layer as its own one-layer stage on the previous layer's output
(:func:`hybrid.planning.profile.measure_layers`). A model is such a chain when its flattened
layer calls (:func:`hybrid.engine.model.graph.graph_of`: the units the Pipeline cuts, nested
functional models flattened in place) each take the previous call's one output, and nothing
else::

    input -> call 0 -> call 1 -> ... -> call n-1 -> output

a ``keras.Sequential`` always; a functional model without skips, merges, several inputs or
outputs, or extra call arguments (a mask, ``training=``). Anything else is refused naming
the first call that breaks the chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from hybrid.engine.model.graph import graph_of

__all__ = ["chain_of"]


def chain_of(
    model: keras.Model, input_shape: Sequence[int] | None = None, input_dtype: str = "float32"
) -> tuple[list[keras.layers.Layer], tuple[int, ...] | None, str]:
    """``model``'s layer calls in order, and the input shape (without the batch axis) and
    dtype to profile them at: ``input_shape`` when given, else the model's; the model's
    dtype. A ``Sequential`` not built yet has neither: ``input_shape`` (None when not given:
    the caller needs one) and ``input_dtype``.

    Raises:
      ValueError: the model is not a chain (names the call and what it reads or takes), or
        its input leaves a dimension open and no ``input_shape`` is given.
    """
    if isinstance(model, keras.Sequential) and not model.built:
        fixed = None if input_shape is None else tuple(int(d) for d in input_shape)
        return list(model.layers), fixed, input_dtype
    graph = graph_of(model)
    if len(graph.inputs) != 1 or len(graph.outputs) != 1:
        raise _not_a_chain(model, f"it takes {len(graph.inputs)} inputs and returns "
                           f"{len(graph.outputs)} outputs")  # fmt: skip
    previous = graph.inputs[0]
    for i, call in enumerate(graph.calls):
        name = getattr(call.layer, "name", type(call.layer).__name__)
        if not isinstance(call.layer, keras.layers.Layer):
            raise _not_a_chain(model, f"call {i} ({name}) is a keras.ops operation, not a layer")
        if call.inputs != (previous,) or len(call.outputs) != 1:
            raise _not_a_chain(
                model,
                f"call {i} ({name}) reads {len(call.inputs)} tensor(s), not only the previous "
                "call's output (a skip or a merge)",
            )
        arguments = getattr(call.node, "arguments", None)
        if arguments is not None and (arguments.kwargs or len(arguments.args) != 1):
            given = sorted(arguments.kwargs) or ["a second positional argument"]
            raise _not_a_chain(model, f"call {i} ({name}) is given {', '.join(given)}")
        previous = call.outputs[0]
    if previous != graph.outputs[0]:
        raise _not_a_chain(model, "its output is not its last call's")
    (spec,) = model.inputs
    shape = tuple(spec.shape[1:]) if input_shape is None else tuple(input_shape)
    if None in shape:
        raise ValueError(
            f"{model.name!r} leaves an input dimension open {shape}: the planner profiles at "
            "a fixed input shape; give plan() input_shape= (e.g. with the sequence length), "
            "or the model's keras.Input a fixed shape"
        )
    return [call.layer for call in graph.calls], tuple(int(d) for d in shape), str(spec.dtype)


def _not_a_chain(model: Any, why: str) -> ValueError:
    return ValueError(
        f"plan() profiles a model whose layer calls form a chain (each takes the previous "
        f"one's output); {model.name!r} does not: {why}. Plan it from a CostProfile "
        "(hybrid.planning.CostProfile, e.g. measured per layer by hand), or choose the mesh "
        "yourself and compare with pipe.summary()"
    )
