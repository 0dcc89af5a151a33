"""What a built pipeline is, as ``model.summary()`` says what a model is: one row per model
stage, then the run's settings and the schedule's bubble.

    for each model stage k:
        devices       its copies, one per replica (mesh[device_of(k), :])
        layer calls   first … last of its calls, and how many
        parameters    the weights its calls read (a tied weight counted on every stage)
        crossing in   each tensor crossing the cut into it: shape (batch first) and dtype
        compute       its share of the model's estimated work per example: every weight a
                      call reads times the positions it is applied at (the call's output
                      shape without its batch and last axes); embedding lookups count nothing
        memory        the predicted peak bytes of each of its devices (weights, gradients,
                      optimizer state, activations in flight: ``stage_memory.py``; with
                      virtual stages, of all the stages a device holds), when the batch size
                      is known; then the largest device peak over the smallest
    bubble            schedule.simulate() with each stage's F costing its compute share and
                      its backward twice that: the idle share of the devices

The estimate needs no measurement; ``hybrid.plan`` measures (``hybrid-train --dry_run``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import keras

from hybrid.core import memory
from hybrid.core import schedule as schedule_lib
from hybrid.engine.model.graph import TensorSpec

__all__ = ["StageRow", "one_line", "stage_rows", "summary"]


class StageRow:
    """One model stage as :func:`summary` shows it (see the module docstring)."""

    def __init__(self, copies: Sequence[Any]) -> None:
        first = copies[0]
        self.index: int = first.index
        self.devices = [c.device for c in copies]
        self.calls = [_call_name(call.layer) for call in first.segment.calls]
        self.parameters = sum(math.prod(v.shape) for v in first.templates)
        self.inputs: list[TensorSpec] = list(first.input_specs)
        self.work = _work(first.segment, self.inputs)


def _work(segment: Any, inputs: Sequence[TensorSpec]) -> int:
    """Σ over the segment's calls of weights × positions (the call's output shape without
    the batch and the last axis), from a symbolic run of the calls (Keras's shape
    inference); where that fails, the positions of the stage's first input."""
    computing = [call for call in segment.calls if _computes(call.layer)]
    try:
        symbolic = [keras.KerasTensor((1, *s.shape), s.dtype) for s in inputs]
        values = segment.trace(symbolic, training=False)
        shapes = [values[call.outputs[0]].shape for call in computing]
    except Exception:  # noqa: BLE001 - an estimate: fall back to the input's positions
        shapes = [(1, *inputs[0].shape) if inputs else (1, 1)] * len(computing)
    return sum(
        _weights(call.layer) * math.prod(d or 1 for d in shape[1:-1])
        for call, shape in zip(computing, shapes, strict=True)
    )


def stage_rows(pipe: Any) -> list[StageRow]:
    """A :class:`StageRow` per model stage of the built ``pipe``."""
    if not pipe.built:
        raise RuntimeError(
            "the pipeline is built on its first batch; call pipe.build(input_shape) (or "
            "train a step) before pipe.summary()"
        )
    return [StageRow(copies) for copies in pipe.stages]


def _call_name(layer: Any) -> str:
    return str(getattr(layer, "name", type(layer).__name__))


def _weights(layer: Any) -> int:
    return sum(math.prod(v.shape) for v in getattr(layer, "weights", []))


def _computes(layer: Any) -> bool:
    """Whether a call's weights are multiplied per position: an embedding (Keras's, or a
    class whose name says it is one) only looks rows up."""
    return not any("Embedding" in cls.__name__ for cls in type(layer).__mro__)


def _bubble(pipe: Any, rows: Sequence[StageRow]) -> float:
    """The simulated idle share of the devices, stage costs in proportion to their work."""
    total = sum(r.work for r in rows) or 1
    forward = [max(r.work / total, 1e-6) for r in rows]
    costs = schedule_lib.Costs(
        forward=forward, backward=[f for f in forward], weight=[f for f in forward]
    )
    return float(schedule_lib.simulate(pipe.schedule, costs).bubble_fraction)


def _first_last(calls: Sequence[str]) -> str:
    if len(calls) <= 2:
        return ", ".join(calls)
    return f"{calls[0]} … {calls[-1]}"


def _specs(specs: Sequence[TensorSpec]) -> str:
    return ", ".join(
        f"({', '.join(['batch', *(str(d) for d in s.shape)])}) {s.dtype}" for s in specs
    )


def summary(pipe: Any, print_fn: Callable[[str], None] | None = None) -> str:
    """The table of ``pipe``'s stages and its settings; printed with ``print_fn`` (default
    ``print``) and returned."""
    rows = stage_rows(pipe)
    total = sum(r.work for r in rows) or 1
    peaks = pipe.predicted_memory()
    cells = [
        (
            str(r.index),
            ", ".join(d.rsplit("/", 1)[-1] for d in r.devices),
            f"{_first_last(r.calls)} ({len(r.calls)})",
            f"{r.parameters:,}",
            f"{r.work / total:.1%}",
            memory.format_bytes(peaks[pipe.schedule.device_of(r.index)]) if peaks else "?",
        )
        for r in rows
    ]
    titles = ("stage", "devices", "layer calls", "params", "compute", "memory")
    # Each column as wide as its widest cell (long layer names keep the columns in line).
    widths = [max(len(t), *(len(c[i]) for c in cells)) for i, t in enumerate(titles)]
    right = (True, False, False, True, True, True)

    def row(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right, strict=True)
        ).rstrip()

    head = row(titles)
    lines = [f"Pipeline: {one_line(pipe)}", head, "-" * len(head)]
    for r, values in zip(rows, cells, strict=True):
        lines.append(row(values))
        lines.append(f"{'':>7}in: {_specs(r.inputs)}")
    config = pipe.config
    lines += [
        "-" * len(head),
        f"parameters {sum(r.parameters for r in rows):,} (a weight read on several stages "
        "counts on each); compute: estimated share of the work per example",
        f"bubble {_bubble(pipe, rows):.1%} (schedule {config.schedule}, M={pipe.micro_batches}, "
        "each stage's costs in proportion to its compute; hybrid.plan measures)",
        _memory_line(peaks),
    ]
    text = "\n".join(lines)
    (print_fn or print)(text)
    return text


def _memory_line(peaks: Sequence[float] | None) -> str:
    if not peaks:
        return "memory: ? (build with the batch size in the shape to predict each device's peak)"
    return (
        f"memory: largest device peak {memory.format_bytes(max(peaks))}, "
        f"{memory.spread(peaks):.2f}× the smallest (estimated from shapes; "
        'balance="memory" evens it, hybrid.plan measures)'
    )


def one_line(pipe: Any) -> str:
    """``Pipeline(mesh stage:2;replica:2, M=4, gpipe, remat=except_last, balance (3, 4))``."""
    config = pipe.config
    v = f"(v={config.virtual_stages})" if config.virtual_stages > 1 else ""
    try:
        balance = f"balance {tuple(pipe.balance)}" + ("" if pipe.built else ", not built")
    except RuntimeError:  # chosen when built
        balance = "not built"
    deferred = ", deferred weight gradients" if config.defer_weight_gradients else ""
    return (
        f"mesh {pipe.mesh.spec}, M={pipe.micro_batches}, {config.schedule}{v}, "
        f"remat={config.remat}{deferred}, {balance}"
    )
