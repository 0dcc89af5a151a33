"""What a built pipeline is, as ``model.summary()`` says what a model is: one row per model
stage, then the run's settings and the schedule's bubble.

    for each model stage k:
        devices       its copies, one per replica (mesh[device_of(k), :])
        layer calls   first … last of its calls, and how many
        parameters    the weights its calls read (a tied weight counted on every stage)
        crossing in   each tensor crossing the cut into it: shape (batch first) and dtype
        compute       its share of the model's estimated work per example (multiply-adds
                      from shapes: ``layer_costs.call_work``, what the default cut balances)
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

from hybrid.core import memory, partition
from hybrid.core import schedule as schedule_lib
from hybrid.engine.model import layer_costs
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
        self.call_work = _call_work(first.segment, self.inputs)
        self.work = sum(self.call_work)


def _call_work(segment: Any, inputs: Sequence[TensorSpec]) -> list[float]:
    """The estimated work per example of each of the segment's calls
    (:func:`hybrid.engine.model.layer_costs.call_work`, the default cut's rule), from a
    symbolic run of the calls (Keras's shape inference); where that fails, each call's
    weights over the stage's first input."""
    try:
        symbolic = [keras.KerasTensor((1, *s.shape), s.dtype) for s in inputs]
        values = segment.trace(symbolic, training=False)
    except Exception:  # noqa: BLE001 - an estimate: fall back to the input's shape
        first = keras.KerasTensor((1, *(inputs[0].shape if inputs else (1,))), "float32")
        return [layer_costs.call_work(call.layer, [first], first) for call in segment.calls]
    return layer_costs.compute_costs(segment.calls, values)


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
        *_cut_advice(rows),
        _memory_line(peaks),
    ]
    text = "\n".join(lines)
    (print_fn or print)(text)
    return text


def _cut_advice(rows: Sequence[StageRow]) -> list[str]:
    """A line naming the compute-balanced cut (``partition.balance_by_cost`` of the calls'
    work, what ``balance="compute"`` builds) where it would shrink the largest stage's
    share by more than a twentieth; else none."""
    works = [w for r in rows for w in r.call_work]
    total = sum(works)
    if len(rows) < 2 or total <= 0:
        return []
    cut = partition.balance_by_cost(works, len(rows))
    now = max(r.work for r in rows) / total
    best = max(partition.stage_costs(works, cut)) / total
    if best >= now * 0.95:
        return []
    return [
        f"the largest stage does {now:.1%} of the compute: balance={list(cut)} (the compute "
        f'cut, balance="compute", the default) would make it {best:.1%}'
    ]


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
