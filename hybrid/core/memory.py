"""Peak memory of a pipeline device, term by term, and the cut that makes the largest
stage's peak as small as possible.

One rule for both users of it: the planner feeds it per-layer bytes it measured
(:mod:`hybrid.planning.cost_model`), the engine per-layer bytes it estimates from shapes
(``Pipeline(balance="memory")``, ``pipe.summary()``). Every function here computes on
plain numbers or, unchanged, on numpy arrays (one value per candidate cut). No TensorFlow.

Conventions: sizes in bytes; activation sizes at one micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from hybrid.core import schedule as schedule_lib

__all__ = [
    "LayerBytes",
    "StageBytes",
    "Usage",
    "activation_bytes",
    "balance_by_memory",
    "deferred_bytes",
    "device_peaks",
    "device_terms",
    "format_bytes",
    "fuses_all",
    "holdings",
    "keeps_last",
    "memory_terms",
    "parse_bytes",
    "recompute_working",
    "spread",
    "stage_bytes",
    "scaled",
    "stage_peaks",
    "usage_of",
]


class Held(Protocol):
    """What a model stage holds for its backward at one micro-batch (a :class:`StageBytes`,
    or the planner's ``StageCost``)."""

    @property
    def input(self) -> Any:
        """Its input (the previous stage's output, or the model's input)."""

    @property
    def stored(self) -> Any:
        """What its forward keeps for the backward, beyond the input."""

    @property
    def working(self) -> Any:
        """The largest one layer's forward+backward temporaries."""

    @property
    def recompute_working(self) -> Any:
        """The peak of one program that recomputes the stage's forward for its backward:
        at each layer's backward, the activations the stage's earlier layers keep beside
        that layer's working set, at the layer where that is largest."""

    @property
    def output(self) -> Any:
        """Its output (what it sends on)."""


@dataclasses.dataclass(frozen=True)
class StageBytes:
    """One model stage's summed layer bytes (see :class:`Held`); ``params`` the bytes of its
    weights, ``output`` of what it sends on."""

    params: Any
    input: Any
    stored: Any
    working: Any
    recompute_working: Any
    output: Any


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """Per-layer bytes in model order, activations at one micro-batch size.

    Attributes:
      params: bytes of each layer's weights.
      stored: bytes each layer's forward keeps for its backward (its output and
        intermediates; not its input, which the previous layer stored).
      working: each layer's peak temporaries while its forward and backward run.
      output: bytes of each layer's output (what crosses a cut after it).
      model_input: bytes of the model's input (what model stage 0 starts from).
    """

    params: Sequence[float]
    stored: Sequence[float]
    working: Sequence[float]
    output: Sequence[float]
    model_input: float

    def __post_init__(self) -> None:
        sizes = {len(self.params), len(self.stored), len(self.working), len(self.output)}
        if len(sizes) != 1:
            raise ValueError(f"per-layer byte lists of different lengths: {sorted(sizes)}")

    @property
    def num_layers(self) -> int:
        return len(self.params)


@dataclasses.dataclass(frozen=True)
class Usage:
    """How a run uses a stage's memory, beyond its layers.

    Attributes:
      optimizer_slots: optimizer state per weight (Adam 2, SGD with momentum 1, SGD 0).
      replicas: R.
      micro_batches: M.
      remat: "never", "always" or "except_last".
      in_flight: per model stage, the most micro-batches whose activations it holds at once
        (:func:`holdings`).
      keeps_last: per model stage, whether its last micro-batch's activations are stored
        (its forward not fused with its backward; matters under ``except_last``).
      deferred: weight gradients deferred to one W per stage over all micro-batches.
      sharded: optimizer states sharded across the replicas (ZeRO-1).
      device_of: per model stage, its pipeline device (default: model stage k on device k).
      fused: per model stage, whether every forward runs in one program with its backward
        (:func:`fuses_all`: it keeps nothing between actions; default: none does).
    """

    optimizer_slots: int
    replicas: int
    micro_batches: int
    remat: str
    in_flight: Sequence[int]
    keeps_last: Sequence[bool]
    deferred: bool = False
    sharded: bool = False
    device_of: Sequence[int] = ()
    fused: Sequence[bool] = ()


def usage_of(config: Any, sched: schedule_lib.Schedule, optimizer_slots: int) -> Usage:
    """The :class:`Usage` of a run: ``config`` a :class:`hybrid.core.config.RunConfig`,
    ``sched`` its schedule."""
    in_flight, keeps_last = holdings(sched)
    return Usage(
        optimizer_slots=optimizer_slots,
        replicas=config.replicas,
        micro_batches=sched.num_microbatches,
        remat=config.remat,
        in_flight=in_flight,
        keeps_last=keeps_last,
        deferred=config.defer_weight_gradients,
        sharded=config.shard_optimizer_states,
        device_of=tuple(sched.device_of(k) for k in range(sched.num_model_stages)),
        fused=fuses_all(sched),
    )


def memory_terms(
    params: Any,
    optimizer_slots: int,
    replicas: int,
    activations: Any,
    batch_input: Any = 0.0,
    deferred: bool = False,
    sharded: bool = False,
    accumulates: bool = True,
) -> dict[str, Any]:
    """One pipeline device's peak bytes, by term::

        state       = optimizer_slots · params   (÷ replicas when ``sharded``: ZeRO-1)
        resident    = params + state
        pipeline    = resident + batch_input + gradients + activations
        update      = resident + batch_input + params (accumulated)
                                                + params (reduced, when replicas > 1)
        total       = max(pipeline, update)

    ``gradients`` is the running sum a backward reads and the new one it writes
    (2 · params); one micro-batch (not ``accumulates``) has no running sum: its backward
    writes the gradients (params); with deferred weight gradients none: the one W's weight
    gradients are its output, inside its working set (``deferred_bytes``). The user's Keras
    model is on no device (the engine builds it in the client's host memory);
    ``batch_input`` is the replica's whole input shard, which stage 0 receives and slices
    into its micro-batches (slices of it: no bytes of their own). The update reads the
    reduced gradients beside the accumulated ones (one replica reduces nothing) and writes
    the variables and optimizer slots in place (an XLA update aliases them): nothing beyond.
    All measured by ``benchmarks/memory.py``, as the bytes requested from each device's
    allocator.
    """
    state = optimizer_slots * params / (replicas if sharded else 1)
    resident = params + state
    gradients = 0.0 * params if deferred else (2 if accumulates else 1) * params
    pipeline = resident + batch_input + gradients + activations
    update = resident + batch_input + (2 if replicas > 1 else 1) * params
    total = np.maximum(pipeline, update)
    return {
        "params": params,
        "optimizer": state,
        "batch_input": batch_input,
        "gradients": gradients,
        "activations": activations,
        "total": float(total) if np.ndim(total) == 0 else total,
    }


def activation_bytes(
    st: Held,
    in_flight: int,
    remat: str,
    keeps_last: bool,
    first: bool = False,
    fused: bool = False,
    last: bool = False,
) -> Any:
    """Peak activation bytes of one model stage holding ``in_flight`` micro-batches::

    never:        in_flight · (input + stored) + output + the largest layer's working set
    always:       in_flight · input + output + one recomputing program's peak (at layer
                  l's backward: the stored activations of the layers before l, and l's
                  working set; ``recompute_working``)
    except_last:  as always, + stored when the last micro-batch's activations are kept
                  (``keeps_last``: its forward is not fused with its backward)
    ``fused``:    as always, in every mode: each forward runs in one program with its
                  backward (a last stage under 1F1B), so nothing is stored between them

    ``output``: the gradient of the stage's output its backward reads, sent by the next
    stage (none on the ``last``, whose backward starts from its loss).
    The ``first`` model stage's inputs are slices of the batch input (``memory_terms``'
    ``batch_input``): they count nothing here.
    """
    if in_flight == 0:
        return 0.0 * st.input
    inputs = in_flight * (0.0 * st.input if first else st.input)
    if fused:
        return inputs + st.recompute_working
    inputs = inputs + (0.0 * st.output if last else st.output)
    if remat == "never":
        return inputs + in_flight * st.stored + st.working
    extra = st.stored if remat == "except_last" and keeps_last else 0.0 * st.stored
    return inputs + st.recompute_working + extra


def recompute_working(stored: Sequence[Any], working: Sequence[Any]) -> Any:
    """The peak of one program recomputing a run of layers for its backward (per layer in
    order: the bytes its forward keeps, its working set)::

        max over l of  Σ_{j<l} stored_j + working_l

    (XLA keeps the earlier layers' activations while layer l's backward runs; a layer's
    own working set includes what it keeps)."""
    peak, kept = None, 0.0 * stored[0]
    for st, work in zip(stored, working, strict=True):
        here = kept + work
        peak = here if peak is None else np.maximum(peak, here)
        kept = kept + st
    return peak


def deferred_bytes(st: Held, whole: Held, micro_batches: int) -> Any:
    """Peak activation bytes of one model stage deferring its weight gradients: what the
    one W over all micro-batches reads, joined at M micro-batches' rows (each layer's input:
    the stage's input and its stored activations but its output; and each layer's output
    gradient, about as many bytes as the stored activations), and that W's working set
    (``whole``: the stage at all micro-batches' rows), its weight gradients included."""
    reads = st.input + 2 * st.stored - st.output
    return micro_batches * reads + whole.working


def holdings(sched: schedule_lib.Schedule) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    """Per model stage of ``sched``: the most micro-batches its device holds activations of
    (its device's, from the order of its row), and whether its last micro-batch's
    activations are stored (not fused with its backward in one program)."""
    in_flight = schedule_lib.simulate(sched, schedule_lib.Costs()).peak_in_flight
    stages = range(sched.num_model_stages)
    return tuple(in_flight[sched.device_of(k)] for k in stages), keeps_last(sched)


def keeps_last(sched: schedule_lib.Schedule) -> tuple[bool, ...]:
    """Per model stage of ``sched``: whether its last micro-batch's activations are stored
    (M > 1 and its last forward not fused with its backward in one program)."""
    fused = schedule_lib.pairs_to_fuse(sched)
    M = sched.num_microbatches
    return tuple(
        M > 1 and schedule_lib.Action(k, schedule_lib.Op.F, M - 1) not in fused
        for k in range(sched.num_model_stages)
    )


def fuses_all(sched: schedule_lib.Schedule) -> tuple[bool, ...]:
    """Per model stage of ``sched``: whether every one of its forwards runs in one program
    with its backward (:func:`hybrid.core.schedule.pairs_to_fuse`), keeping nothing
    between actions."""
    fused = schedule_lib.pairs_to_fuse(sched)
    F = schedule_lib.Op.F
    return tuple(
        all(schedule_lib.Action(k, F, m) in fused for m in range(sched.num_microbatches))
        for k in range(sched.num_model_stages)
    )


def stage_bytes(layers: LayerBytes, first: int, count: int) -> StageBytes:
    """The summed bytes of layers ``first … first+count-1``."""
    ids = range(first, first + count)
    return StageBytes(
        params=sum(layers.params[i] for i in ids),
        input=layers.model_input if first == 0 else layers.output[first - 1],
        stored=sum(layers.stored[i] for i in ids),
        working=max(layers.working[i] for i in ids),
        recompute_working=recompute_working(
            [layers.stored[i] for i in ids], [layers.working[i] for i in ids]
        ),
        output=layers.output[first + count - 1],
    )


def device_terms(
    stages: Sequence[Any],
    wholes: Sequence[Any],
    ks: Sequence[int],
    usage: Usage,
) -> dict[str, Any]:
    """:func:`memory_terms` of one pipeline device holding model stages ``ks`` (a
    :class:`StageBytes`, or the planner's ``StageCost``, for each; ``wholes``: each at all
    micro-batches' rows, for deferred weight gradients): the weights, gradients and state
    of them all, and the activations of its fullest stage (one runs at a time), or
    deferring weight gradients, what every one of its stages keeps for its W beside the
    largest W's working set (each keeps all M micro-batches' until its W, at the step's
    end); the input shard when it holds model stage 0."""
    M = usage.micro_batches
    deferred = usage.deferred and M > 1
    if deferred:
        pairs = list(zip(stages, wholes, strict=True))
        kept = [deferred_bytes(st, whole, M) - whole.working for st, whole in pairs]
        working = [whole.working for _, whole in pairs]
        held = functools.reduce(operator.add, kept) + functools.reduce(np.maximum, working)
    else:
        held = _fullest(stages, ks, usage)
    first = [st for st, k in zip(stages, ks, strict=True) if k == 0]
    return memory_terms(
        params=functools.reduce(operator.add, [st.params for st in stages]),
        optimizer_slots=usage.optimizer_slots,
        replicas=usage.replicas,
        activations=held,
        batch_input=first[0].input * M if first else 0.0,
        deferred=deferred,
        sharded=usage.sharded,
        accumulates=M > 1,
    )


def _fullest(stages: Sequence[Any], ks: Sequence[int], usage: Usage) -> Any:
    """The activations of the fullest of one device's model stages ``ks`` (one runs at a
    time; its micro-batches in flight are the device's)."""
    return functools.reduce(
        np.maximum,
        [
            activation_bytes(
                st,
                usage.in_flight[k],
                usage.remat,
                usage.keeps_last[k],
                first=k == 0,
                fused=bool(usage.fused) and usage.fused[k],
                last=k == len(usage.in_flight) - 1,
            )
            for st, k in zip(stages, ks, strict=True)
        ],
    )


def _peak(st: StageBytes, k: int, usage: Usage, whole: StageBytes) -> Any:
    """Model stage ``k``'s peak bytes, as if its device held it alone."""
    return device_terms([st], [whole], [k], usage)["total"]


def device_peaks(
    layers: LayerBytes,
    balance: Sequence[int],
    usage: Usage,
    whole: LayerBytes | None = None,
) -> tuple[float, ...]:
    """Each pipeline device's peak bytes under ``balance`` (a device holds the model stages
    ``usage.device_of`` gives it: one, or v with virtual stages)."""
    whole = whole or scaled(layers, usage.micro_batches)
    starts = [sum(balance[:k]) for k in range(len(balance))]
    stages = [stage_bytes(layers, s, n) for s, n in zip(starts, balance, strict=True)]
    wholes = [stage_bytes(whole, s, n) for s, n in zip(starts, balance, strict=True)]
    devices = usage.device_of or tuple(range(len(balance)))
    peaks = []
    for d in sorted(set(devices)):
        ks = [k for k, dev in enumerate(devices) if dev == d]
        terms = device_terms([stages[k] for k in ks], [wholes[k] for k in ks], ks, usage)
        peaks.append(float(terms["total"]))
    return tuple(peaks)


def stage_peaks(
    layers: LayerBytes,
    balance: Sequence[int],
    usage: Usage,
    whole: LayerBytes | None = None,
) -> tuple[float, ...]:
    """Each model stage's peak bytes under ``balance`` (``whole``: the layers at all
    micro-batches' rows, for deferred weight gradients; default: ``layers``' working sets
    × M)."""
    whole = whole or scaled(layers, usage.micro_batches)
    starts = [sum(balance[:k]) for k in range(len(balance))]
    return tuple(
        float(_peak(stage_bytes(layers, s, n), k, usage, stage_bytes(whole, s, n)))
        for k, (s, n) in enumerate(zip(starts, balance, strict=True))
    )


def balance_by_memory(
    layers: LayerBytes, num_stages: int, usage: Usage, whole: LayerBytes | None = None
) -> tuple[int, ...]:
    """The contiguous cut of ``layers`` into ``num_stages`` non-empty model stages whose
    largest :func:`stage_peaks` is as small as possible.

    Conceptually::

        best(j, k) = min over i < j of max(best(i, k-1), peak_k(layers[i:j]))

    exact, by dynamic programming over every cut (each stage's peaks for all its possible
    ends computed at once). Ties go to the earliest cut.
    """
    L, S = layers.num_layers, num_stages
    if not 1 <= S <= L:
        raise ValueError(
            f"cannot cut {L} layers into {S} stages: each stage needs at least one layer; "
            f"use at most {L} stages or a model with more layers"
        )
    whole = whole or scaled(layers, usage.micro_batches)
    a, w = _Prefix(layers), _Prefix(whole)
    best = np.full(L + 1, np.inf)
    best[0] = 0.0
    cuts: list[np.ndarray] = []
    for k in range(S):
        new = np.full(L + 1, np.inf)
        arg = np.zeros(L + 1, dtype=int)
        for i in range(k, L - (S - k) + 1):  # stage k starts at layer i
            if not np.isfinite(best[i]):
                continue
            peaks = _peak(a.stages(i), k, usage, w.stages(i))  # stage k = layers[i:j]
            value = np.maximum(best[i], peaks)
            ends = np.arange(i + 1, L + 1)
            better = value < new[ends]
            new[ends[better]] = value[better]
            arg[ends[better]] = i
        cuts.append(arg)
        best = new
    balance, end = [], L
    for k in reversed(range(S)):
        start = int(cuts[k][end])
        balance.append(end - start)
        end = start
    return tuple(reversed(balance))


def format_bytes(nbytes: float) -> str:
    """1.5 GiB, 3.2 MiB, 12 KiB, 100 B."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes:.0f} B"


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_UNITS.update({"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12})


def parse_bytes(text: str) -> float:
    """``"16GiB"``, ``"512 MiB"``, ``"80GB"``, ``"1e9B"`` -> bytes.

    Raises:
      ValueError: no unit, an unknown unit, or not a positive number; says what to write.
    """
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    number, unit = match.groups() if match else ("", "")
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or not value > 0:
        raise ValueError(
            f"{text!r} is not a memory size: give a positive number and one of "
            f"{', '.join(_UNITS)}, e.g. '16GiB' or '512MiB'"
        )
    return value * _UNITS[unit]


def spread(peaks: Sequence[float]) -> float:
    """The largest stage peak over the smallest (1.0: perfectly even)."""
    return max(peaks) / min(peaks) if min(peaks) > 0 else float("inf")


def scaled(layers: LayerBytes, factor: float) -> LayerBytes:
    """``layers`` with every activation size × ``factor`` (per-example sizes at a
    micro-batch; a stage at M micro-batches' rows, where nothing better is known)."""
    return LayerBytes(
        params=layers.params,
        stored=[factor * x for x in layers.stored],
        working=[factor * x for x in layers.working],
        output=[factor * x for x in layers.output],
        model_input=factor * layers.model_input,
    )


class _Prefix:
    """Prefix sums over :class:`LayerBytes`, to form every stage starting at one layer at
    once: :meth:`stages` (i) is the :class:`StageBytes` of ``layers[i:j]`` for every j > i,
    as arrays over j."""

    def __init__(self, layers: LayerBytes) -> None:
        self.layers = layers
        self.params = np.concatenate([[0.0], np.cumsum(np.asarray(layers.params, float))])
        self.stored = np.concatenate([[0.0], np.cumsum(np.asarray(layers.stored, float))])
        self.working = np.asarray(layers.working, float)
        self.peaks = self.stored[:-1] + self.working  # recompute_working's, from layer 0
        self.output = np.asarray(layers.output, float)

    def stages(self, i: int) -> StageBytes:
        inp = self.layers.model_input if i == 0 else self.output[i - 1]
        return StageBytes(
            params=self.params[i + 1 :] - self.params[i],
            input=np.full(len(self.output) - i, float(inp)),
            stored=self.stored[i + 1 :] - self.stored[i],
            working=np.maximum.accumulate(self.working[i:]),
            recompute_working=np.maximum.accumulate(self.peaks[i:]) - self.stored[i],
            output=self.output[i:],
        )
