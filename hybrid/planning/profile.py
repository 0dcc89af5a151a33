"""Detailed per-layer measurements for the planner: the time of each action kind, activation
and weight bytes, and the optimizer update (:func:`measure_layers`); the all-reduce and
transfers between devices are measured by :mod:`hybrid.planning.link_timing` (re-exported
here)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from hybrid.engine.model.layer_costs import block, weight_bytes
from hybrid.engine.model.objective import Objective
from hybrid.engine.model.optimizers import optimizer_copies
from hybrid.engine.step.stage import StageReplica
from hybrid.engine.traced import traced
from hybrid.planning.compiling import Compiler, DeviceGate
from hybrid.planning.concurrency import measure_concurrency
from hybrid.planning.layer_programs import (
    PROGRAMS,
    Probe,
    ProgramArgs,
    StagePrograms,
    identity_programs,
    measure_memory,
    signature,
    with_repeats,
)
from hybrid.planning.link_timing import measure_all_reduce, measure_transfer
from hybrid.planning.model_calls import ModelCalls
from hybrid.planning.stopwatch import median_seconds, run_seconds

__all__ = [
    "LayerMeasurement",
    "LayerTiming",
    "ModelMeasurement",
    "measure_all_reduce",
    "measure_layers",
    "measure_transfer",
]


@dataclasses.dataclass(frozen=True)
class LayerTiming:
    """One layer, run as a one-layer pipeline stage on one device, at one micro-batch size.

    Every time is seconds of compute net of the fixed cost of launching a program (measured
    on an identity layer and subtracted, see :class:`ModelMeasurement`), so the planner can
    add back its own per-action overhead once per scheduled action.

    Attributes:
      batch: the micro-batch size measured.
      forward: an F action (the forward program).
      backward: a B action from stored activations (remat "never"): input and weight
        gradients from the forward that kept its activations.
      recompute_backward: the backward part of the fused forward+backward program (a
        rematerialized B costs ``forward + recompute_backward``).
      input_backward: the B of a split backward from stored activations (its input
        gradient only; W is ``backward - input_backward``); 0 when the input has no
        gradient.
      stored_bytes: bytes a forward keeps until its backward inside a stage of several
        layers: its residuals (inner activations) and each of its outputs a backward reads
        (not its input, which the layer before counts); None without allocator statistics.
      working_bytes: the allocator's peak above what was held before while one fused
        forward+backward runs (the least of a few runs); None without allocator
        statistics.
      output_bytes: bytes of the layer output for this batch (what crosses a stage boundary).
    """

    batch: int
    forward: float
    backward: float
    recompute_backward: float
    input_backward: float
    stored_bytes: int | None
    working_bytes: int | None
    output_bytes: int


@dataclasses.dataclass(frozen=True)
class LayerMeasurement:
    """What :func:`measure_layers` found for one layer.

    Attributes:
      name: the Keras layer name.
      param_bytes: bytes of its trainable weights.
      param_tensors: how many trainable weight arrays it has (each backward accumulates
        one gradient per array).
      update: seconds of one optimizer update of its weights (0 without an optimizer), net of
        the launch cost.
      timings: one :class:`LayerTiming` per measured micro-batch size, in increasing size.
    """

    name: str
    param_bytes: int
    param_tensors: int
    update: float
    timings: tuple[LayerTiming, ...]


@dataclasses.dataclass(frozen=True)
class ModelMeasurement:
    """Per-layer measurements of a model on one device.

    Attributes:
      layers: one :class:`LayerMeasurement` per layer, in model order.
      input_bytes: bytes of one example of the model input.
      launch_overhead: seconds per repetition of the identity layer's forward (a program
        that does next to no work, launched inside a graph); every timing above is net of
        its identity twin.
      device: where it was measured.
      update_call: seconds one optimizer update program costs once whatever its weights
        (each layer's ``update`` is net of it): the layers' updates measured one by one,
        less the whole model's measured as one, over one less than their count.
      concurrency: how much slower a device computes while another device of the host
        computes beside it (1: not measured).
    """

    layers: tuple[LayerMeasurement, ...]
    input_bytes: int
    launch_overhead: float
    device: str
    update_call: float = 0.0
    concurrency: float = 1.0


# A model of more layer calls than this is measured in this many runs of calls.
MAX_RUNS = 32
# Two devices at once are timed only on a program of at least this many seconds: on a
# shorter one the ratio measures the host launching two programs (the calibration's cost
# per action), not two devices computing (a 4 × Dense(256) MLP's 0.1 ms programs read
# 1.37 and put its 2×2 step at twice the measured).
MIN_CONCURRENCY_SECONDS = 1e-3


@dataclasses.dataclass(frozen=True)
class _Setup:
    """How :func:`measure_layers` measures: its arguments every step needs."""

    device: str
    loss: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] | None
    optimizer: Callable[[], keras.optimizers.Optimizer] | None
    labels_shape: tuple[int, ...]
    target_dtype: str
    repeats: int
    chain: int
    jit_compile: bool


def measure_layers(
    calls: ModelCalls,
    batch_sizes: Sequence[int],
    device: str,
    loss: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] | None = None,
    target_shape: Sequence[int] | None = None,
    target_dtype: str = "int32",
    optimizer: Callable[[], keras.optimizers.Optimizer] | None = None,
    repeats: int = 7,
    chain: int = 8,
    jit_compile: bool = True,
    verbose: int = 0,
    max_runs: int = MAX_RUNS,
    beside: str | None = None,
) -> ModelMeasurement:
    """Times and sizes every layer call of a model as its own one-call stage on ``device``.

    Conceptually, for each call l and each batch size b, with ``x`` the tensors the model
    passes call l, holding b examples (zeros; token ids 0)::

        F      = t(stage_l.forward(x))                          - t(same on identity)
        B      = t(stage_l.forward(x, kept) + its backward)      - t(same on identity) - F
        B_re   = t(stage_l.forward_backward(x))                  - t(same on identity) - F
        B_dx   = t(stage_l.forward(x, split) + its B, dx only)   - t(same on identity) - F
        stored = bytes of the tensors stage_l's kept forward returns for its backward,
                 and of each output some backward reads (:func:`_kept_bytes`)
        work   = the allocator's peak above what was held while forward_backward runs

    where t is the time of one of up to ``chain`` back-to-back repetitions inside one
    graph function (as many as make a run of :data:`RUN_SECONDS`), with the programs the
    engine runs
    (:class:`hybrid.engine.step.stage.StageReplica`), and
    "identity" is a one-weight layer whose programs do next to no work: the difference is
    compute only. Every program is compiled first; then ``repeats`` rounds time every
    program of every call once, each beside its identity twin, and each figure is the
    median over the rounds (so a busy spell on a shared machine hits all calls alike).
    Calls with the same layer class, configuration (names and seeds aside), inputs and
    arguments are measured once. Memory needs TensorFlow's BFC allocator on CPU
    (``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts); without it the byte
    fields are None.

    Args:
      calls: the model's layer calls and tensor specs
        (:func:`hybrid.planning.model_calls.model_calls`).
      batch_sizes: micro-batch sizes to measure at.
      device: where to measure (one device of the mesh).
      loss: when given, the last call is measured as the last stage, with this loss on
        zero targets of ``target_shape`` (default: the output shape without its last axis,
        i.e. sparse class ids) and ``target_dtype``.
      optimizer: a zero-argument factory; when given, each layer's update is timed too.
      repeats: timing rounds.
      chain: back-to-back repetitions per timed run (in the first round; later, at most).
      verbose: 1 shows a ``keras.utils.Progbar`` over the work: one unit per call and
        batch size compiled, one per timing round; 0 is silent.
      max_runs: a model of more calls is measured in this many runs of calls, each one
        stage, whose figures are shared among their calls
        (:meth:`hybrid.planning.model_calls.ModelCalls.groups`).
      beside: another device of the same host (a simulated CPU device): the heaviest
        run's fused program at the largest size is timed there and on ``device`` at once
        (:func:`hybrid.planning.concurrency.measure_concurrency`) when it takes
        :data:`MIN_CONCURRENCY_SECONDS` or more; else, or None, not measured (1).

    Raises:
      ValueError: no batch size, or one below 1.
    """
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
    out_shape = tuple(int(d or 1) for d in calls.specs[calls.graph.outputs[0]].shape)
    labels_shape = tuple(target_shape) if target_shape is not None else out_shape[:-1]
    identity, base_args = _warm_identity(device, chain, jit_compile)
    setup = _Setup(device, loss, optimizer, labels_shape, target_dtype, repeats, chain, jit_compile)
    count = len(calls.calls)
    if verbose:
        print(
            f"profiling {count} layer calls at micro-batch sizes {sizes} on {device}: "
            f"compiling each, then {repeats} timing rounds"
        )
    bar = keras.utils.Progbar(count * len(sizes) + repeats, verbose=verbose, unit_name="task")
    runs = calls.groups(max_runs)
    keys, distinct = _probe_calls(calls, runs, sizes, setup, bar)
    groups = [probes for _, probes in distinct.values()]
    launch = max(0.0, _time_rounds(groups, identity, base_args, repeats, bar))
    measured = {
        key: _measurement(stage, probes, setup) for key, (stage, probes) in distinct.items()
    }
    call = _update_call(calls, [measured[key].update for key in keys], setup)
    measured = {
        key: dataclasses.replace(m, update=max(0.0, m.update - call)) if m.update else m
        for key, m in measured.items()
    }
    work = calls.work()
    kept = _kept_bytes(calls, runs, keys, distinct, setup)
    per_call = [
        m
        for run, key, stored in zip(runs, keys, kept, strict=True)
        for m in _per_call(calls, run, _with_stored(measured[key], stored), work)
    ]
    rows = tuple(
        dataclasses.replace(m, name=name) for m, name in zip(per_call, calls.names, strict=True)
    )
    together = 1.0 if beside is None else _concurrency(calls, runs, keys, distinct, setup, beside)
    return ModelMeasurement(rows, int(calls.input_bytes), launch, device, call, together)


def _concurrency(
    calls: ModelCalls,
    runs: Sequence[tuple[int, int]],
    keys: Sequence[str],
    distinct: dict[str, tuple[StageReplica, list[Probe]]],
    setup: _Setup,
    beside: str,
) -> float:
    """The heaviest distinct run's fused program at its largest size, timed on the profiled
    device and on ``beside`` at once over alone (:func:`measure_concurrency`), when it takes
    :data:`MIN_CONCURRENCY_SECONDS` or more; else 1."""
    seconds = {
        k: max(0.0, statistics.median(probes[-1].times["fused"]))  # net: noise can be < 0
        for k, (_, probes) in distinct.items()
    }
    heaviest = max(seconds, key=seconds.__getitem__)
    if seconds[heaviest] < MIN_CONCURRENCY_SECONDS:
        return 1.0
    start, stop = dict(zip(keys, runs, strict=True))[heaviest]
    twin = StagePrograms(_stage(calls, start, stop, setup, beside))
    probe = distinct[heaviest][1][-1]
    count = _repetitions(seconds[heaviest], setup.chain)
    return measure_concurrency(
        probe, _probe(calls, start, stop, setup, twin, probe.batch), setup.repeats, count
    )


def _kept_bytes(
    calls: ModelCalls,
    runs: Sequence[tuple[int, int]],
    keys: Sequence[str],
    distinct: dict[str, tuple[StageReplica, list[Probe]]],
    setup: _Setup,
) -> list[list[int | None]]:
    """Per run, per batch size: what its forward keeps for the backward, inside a stage of
    several runs: its own residuals (:class:`Memory`'s ``stored``) and each of its outputs
    that a backward reads, its own (a residual) or a later run's (an input it reads).
    (A layer's output that only the next layer's forward reads is not kept: a ReLU keeps
    its output, the BatchNormalization before it then keeps nothing of its own output.)"""
    segments = [calls.segment(start, stop) for start, stop in runs]
    read: set[int] = set()
    for segment, key in zip(segments, keys, strict=True):
        memory = distinct[key][1][0].memory
        if memory is not None and memory.reads is not None:
            read.update(k for k, r in zip(segment.inputs, memory.reads, strict=True) if r)
    kept = []
    for (_, stop), segment, key in zip(runs, segments, keys, strict=True):
        outputs = () if _ends_with_loss(calls, stop, setup) else segment.outputs  # its loss
        row: list[int | None] = []
        for probe in distinct[key][1]:
            memory = probe.memory
            if memory is None:
                row.append(None)
                continue
            held = memory.stored
            if memory.keeps is not None and len(memory.keeps) == len(outputs):
                held += sum(
                    calls.example_bytes(k) * probe.batch
                    for k, own in zip(outputs, memory.keeps, strict=True)
                    if own or k in read
                )
            row.append(int(held))
        kept.append(row)
    return kept


def _with_stored(m: LayerMeasurement, stored: Sequence[int | None]) -> LayerMeasurement:
    """``m`` with the stored bytes of each batch size replaced by ``stored``'s."""
    timings = tuple(
        dataclasses.replace(t, stored_bytes=b) for t, b in zip(m.timings, stored, strict=True)
    )
    return dataclasses.replace(m, timings=timings)


def _update_call(calls: ModelCalls, updates: Sequence[float], setup: _Setup) -> float:
    """What one update program costs whatever its weights: with n runs of calls that hold
    weights, updated alone in ``updates`` (each ``call + own``), and the whole model's
    update measured as one (``call + Σ own``), ``call = (Σ updates − whole) / (n − 1)``,
    kept within [0, the smallest update]. 0 without an optimizer or with one such run."""
    held = [u for u in updates if u > 0]
    if setup.optimizer is None or len(held) < 2:
        return 0.0
    stage = _stage(calls, 0, len(calls.calls), setup, setup.device, with_loss=False)
    whole = _update_seconds(stage, setup.device, setup.repeats)
    return min(max(0.0, (sum(held) - whole) / (len(held) - 1)), min(held))


def _warm_identity(device: str, chain: int, jit_compile: bool) -> tuple[StagePrograms, ProgramArgs]:
    """The identity layer's programs, each run once (compiled), and their arguments."""
    identity = identity_programs(device, jit_compile)
    with tf.device(device):
        base_args: ProgramArgs = ([tf.zeros((1, 1))], [tf.ones((1, 1))], [], tf.constant(chain))
    for name in PROGRAMS:
        block(getattr(identity, name)(*base_args))
    return identity, base_args


def _probe_calls(
    calls: ModelCalls,
    runs: Sequence[tuple[int, int]],
    sizes: Sequence[int],
    setup: _Setup,
    bar: keras.utils.Progbar,
) -> tuple[list[str], dict[str, tuple[StageReplica, list[Probe]]]]:
    """Each run's signature, and per distinct signature its stage (the run's calls) with a
    compiled, memory-measured :class:`Probe` per batch size (``bar`` advanced by one per
    call and size).

    Each probe is traced here, compiled on other threads while the next is traced, and
    its memory measured alone on the device once it is compiled
    (:class:`hybrid.planning.compiling.Compiler`)."""
    keys: list[str] = []
    distinct: dict[str, tuple[StageReplica, list[Probe]]] = {}

    def measure(item: tuple[Probe, int]) -> None:
        probe, width = item
        probe.memory = measure_memory(setup.device, probe.programs, probe.args)
        bar.add(width)

    with Compiler(_compile, measure) as compiler:
        for start, stop in runs:
            last = _ends_with_loss(calls, stop, setup)
            key = " | ".join(
                signature(calls, i, last and i == stop - 1) for i in range(start, stop)
            )
            keys.append(key)
            if key in distinct:
                bar.add(len(sizes) * (stop - start))
                continue
            stage = _stage(calls, start, stop, setup, setup.device)
            programs = StagePrograms(stage)
            probes = []
            for b in sizes:
                probe = _probe(calls, start, stop, setup, programs, b)
                programs.trace(probe.args)
                compiler.submit((probe, stop - start))
                probes.append(probe)
            distinct[key] = (stage, probes)
        compiler.finish()
    return keys, distinct


def _ends_with_loss(calls: ModelCalls, stop: int, setup: _Setup) -> bool:
    """Whether a run ending before call ``stop`` is measured as the last stage (with the
    loss)."""
    return setup.loss is not None and stop == len(calls.calls)


def _stage(
    calls: ModelCalls, start: int, stop: int, setup: _Setup, device: str, with_loss: bool = True
) -> StageReplica:
    """Calls ``start:stop`` as one stage on ``device``, with the optimizer and, when they
    end the model, the loss (unless not ``with_loss``)."""
    last = with_loss and _ends_with_loss(calls, stop, setup)
    segment = calls.segment(start, stop)
    return StageReplica(
        start,
        segment,
        device,
        [calls.specs[k] for k in segment.inputs],
        optimizer_copies(setup.optimizer) if setup.optimizer else None,
        Objective.of(setup.loss, None, None, 1) if last else None,
        setup.jit_compile,
    )


def _probe(
    calls: ModelCalls, start: int, stop: int, setup: _Setup, programs: StagePrograms, batch: int
) -> Probe:
    """The probe of calls ``start:stop`` (run by ``programs``) at ``batch`` examples."""
    segment = calls.segment(start, stop)
    last = _ends_with_loss(calls, stop, setup)
    return Probe(
        programs,
        [calls.specs[k] for k in segment.outputs],
        calls.boundary_bytes(stop - 1),
        batch,
        setup.labels_shape if last else None,
        setup.target_dtype,
        setup.chain,
    )


def _compile(item: tuple[Probe, int], gate: DeviceGate) -> None:
    """Runs each of the probe's programs once (XLA compiles it for the probe's size)."""
    probe, _ = item
    for name in probe.names:
        with gate.shared():
            block(getattr(probe.programs, name)(*probe.args))
    with gate.shared():
        block(probe.programs.fused_once(*probe.args[:3]))


def _time_rounds(
    groups: Sequence[Sequence[Probe]],
    identity: StagePrograms,
    base_args: ProgramArgs,
    repeats: int,
    bar: keras.utils.Progbar | None = None,
) -> float:
    """Runs ``repeats`` rounds that time every program of every probe once, each followed
    by its identity twin with as many repetitions, and appends to the probe's ``times`` the
    seconds per repetition net of the twin's; returns the identity forward's median seconds
    per repetition at the full chain (``bar`` advanced by one per round).

    The first round repeats every program as often as ``base_args`` says (the profile's
    chain); later rounds repeat a program just often enough for a run of about
    :data:`RUN_SECONDS` (once at least, the chain at most): a long program rises above
    the clock's noise and the launch cost without repetitions, and a round then costs
    little more than its short programs."""
    chain = int(base_args[3])
    launches: list[float] = []
    counts: dict[tuple[int, str], int] = {}
    with_count = {chain: base_args}
    for round_ in range(repeats):
        for group in groups:
            for probe in group:
                for name in probe.names:
                    n = counts.get((id(probe), name), chain)
                    if n not in with_count:
                        with_count[n] = with_repeats(base_args, n)
                    took = run_seconds(getattr(probe.programs, name), with_repeats(probe.args, n))
                    base = run_seconds(getattr(identity, name), with_count[n])
                    probe.times[name].append((took - base) / n)
                    if n == chain and name == "forward":
                        launches.append(base / chain)
                    if round_ == 0:
                        counts[id(probe), name] = _repetitions(took / n, chain)
        if bar is not None:
            bar.add(1)
    return statistics.median(launches)


# A timed run repeats a program about this long at least (after the first round).
RUN_SECONDS = 0.02


def _repetitions(per_repetition: float, chain: int) -> int:
    """Repetitions of a program of ``per_repetition`` seconds for a timed run of about
    :data:`RUN_SECONDS`: once at least, ``chain`` at most."""
    return min(chain, max(1, math.ceil(RUN_SECONDS / max(per_repetition, 1e-9))))


def _layer_timing(probe: Probe) -> LayerTiming:
    """One probe's figures: each program's median seconds per repetition net of its
    identity twin, the forward subtracted from the programs that contain it."""

    def net(name: str) -> float:
        return statistics.median(probe.times[name])

    f = max(0.0, net("forward"))
    return LayerTiming(
        batch=probe.batch,
        forward=f,
        backward=max(0.0, net("stored") - f),
        recompute_backward=max(0.0, net("fused") - f),
        input_backward=max(0.0, net("input_only") - f) if probe.need_dx else 0.0,
        stored_bytes=None if probe.memory is None else probe.memory.stored,
        working_bytes=None if probe.memory is None else probe.memory.working,
        output_bytes=probe.output_bytes,
    )


def _measurement(stage: StageReplica, probes: Sequence[Probe], setup: _Setup) -> LayerMeasurement:
    """One distinct run's measurement (unnamed): its timings per batch size, weight bytes
    and arrays, and its optimizer update when there is an optimizer."""
    timings = tuple(_layer_timing(probe) for probe in probes)
    update = 0.0
    if setup.optimizer is not None and stage.trainable_variables:
        update = _update_seconds(stage, setup.device, setup.repeats)
    param_bytes = int(weight_bytes(stage.trainable_variables))
    tensors = len(stage.trainable_variables)
    return LayerMeasurement("", param_bytes, tensors, update, timings)


def _per_call(
    calls: ModelCalls, run: tuple[int, int], m: LayerMeasurement, work: Sequence[float]
) -> list[LayerMeasurement]:
    """A run's measurement shared among its calls: times by each call's share of the run's
    estimated work, stored bytes by its share of the run's outputs' bytes, the run's
    working peak all on the call with the largest outputs (so a stage holding the whole run
    sees the run's peak both as its largest call's, remat "never", and as the sum of its
    calls', a recomputing program), the bytes crossing the cut after each call its own;
    each call's weights its own, the update by their share. ``work``: every call's
    estimated work (:meth:`ModelCalls.work`)."""
    start, stop = run
    if stop - start == 1:
        return [m]
    work = work[start:stop]
    made = [sum(calls.example_bytes(k) for k in c.outputs) for c in calls.calls[start:stop]]
    own = [list(getattr(c.layer, "trainable_weights", [])) for c in calls.calls[start:stop]]
    weights = [int(weight_bytes(vs)) for vs in own]

    def share(parts: Sequence[float], j: int) -> float:
        total = sum(parts)
        return parts[j] / total if total else 1.0 / len(parts)

    peak_at = made.index(max(made))
    rows = []
    for j, i in enumerate(range(start, stop)):
        w, o = share(work, j), share(made, j)
        timings = tuple(
            dataclasses.replace(
                t,
                forward=t.forward * w,
                backward=t.backward * w,
                recompute_backward=t.recompute_backward * w,
                input_backward=t.input_backward * w,
                stored_bytes=None if t.stored_bytes is None else int(t.stored_bytes * o),
                working_bytes=None if t.working_bytes is None else t.working_bytes * (j == peak_at),
                output_bytes=int(calls.boundary_bytes(i) * t.batch),
            )
            for t in m.timings
        )
        update = m.update * share(weights, j)
        rows.append(LayerMeasurement("", weights[j], len(own[j]), update, timings))
    return rows


def _update_seconds(stage: StageReplica, device: str, repeats: int) -> float:
    """Seconds of one optimizer update of ``stage``'s weights, beyond launching a program
    (an update of zero gradients, minus the same graph function with no update in it)."""
    with tf.device(device):
        zeros = [tf.zeros_like(v) for v in stage.trainable_variables]

        def apply(grads: list[tf.Tensor]) -> tf.Tensor:
            stage.apply_gradients(grads)
            return tf.constant(0)

        def nothing(grads: list[tf.Tensor]) -> tf.Tensor:
            return tf.constant(0)

        update = traced(apply)
        empty = traced(nothing)
        return max(
            0.0,
            median_seconds(lambda: [update(zeros)], repeats)
            - median_seconds(lambda: [empty(zeros)], repeats),
        )
