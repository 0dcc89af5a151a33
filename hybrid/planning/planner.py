"""Planner: predict step time, bubble and memory of every mesh configuration, and rank them.

For N devices the question is which S × R mesh, how many micro-batches M, which schedule and
remat mode train fastest within the memory of one device. The planner answers it from a cost
model instead of trying every configuration::

    profile = per-layer costs (measured once on one device, or given)   ->  CostProfile
    for every S × R = N, M, schedule (and virtual stages), remat mode:
        b        = global_batch / (R · M)                  # examples per micro-batch
        balance  = balance_by_cost(layer time at b, S · v)  # contiguous, min-max optimal
        costs    = schedule.Costs of every action:           # from the balanced layer costs
                     F = overhead + Σ forward(b)
                     B = overhead + Σ backward(b)   (+ Σ forward(b) when recomputed)
                         + per-array gradient accumulation
                     transfer = boundary bytes(b) / pipeline bandwidth + latency
        run      = schedule.simulate(schedule, costs)       # makespan, bubble, in-flight
        step     = max over devices d of  end_d + all_reduce(stage bytes_d) + update_d
        memory_d = weights, gradients, optimizer slots + in-flight activations (by remat)
    rank the configurations that fit by step time; say why the others were rejected

Everything here is arithmetic on plain numbers (no TensorFlow); :func:`profile_model`
measures a Keras model with :mod:`hybrid.planning.profile` when a plan is asked for a list of layers.

Conventions: times in seconds, sizes in bytes, bandwidths in bytes per second.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hybrid.core import partition
from hybrid.core import schedule as schedule_lib

__all__ = [
    "REMAT_MODES",
    "Choice",
    "Config",
    "CostProfile",
    "Hardware",
    "Infeasible",
    "LayerCost",
    "Link",
    "Plan",
    "Prediction",
    "Rejection",
    "all_reduce_time",
    "choose_mesh",
    "evaluate",
    "plan",
    "profile_model",
    "uniform_profile",
]

# The engine's remat modes (hybrid.engine.pipeline.REMAT_MODES; repeated so this module needs no
# TensorFlow, and a test keeps the two equal).
REMAT_MODES = ("never", "except_last", "always")
GiB = float(1 << 30)


# ---------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Link:
    """One mesh axis's links: a message of n bytes takes ``latency + n / bandwidth``.

    Attributes:
      bandwidth: bytes per second (``math.inf``: free).
      latency: seconds per message.
    """

    bandwidth: float = math.inf
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(
                f"a link needs bandwidth > 0 and latency >= 0; got bandwidth={self.bandwidth}, "
                f"latency={self.latency}"
            )

    def time(self, nbytes: float) -> float:
        """Seconds to send one message of ``nbytes``."""
        return self.latency + nbytes / self.bandwidth

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float]) -> Link:
        """The least-squares line ``seconds = latency + size / bandwidth`` through measured
        (size, seconds) pairs; a flat or falling line gives an infinite bandwidth.

        Raises:
          ValueError: fewer than two pairs, or lengths that differ.
        """
        if len(sizes) != len(seconds) or len(sizes) < 2:
            raise ValueError(
                f"fitting a link needs two or more (size, seconds) pairs; got {len(sizes)} "
                f"sizes and {len(seconds)} times"
            )
        n = len(sizes)
        mx, my = sum(sizes) / n, sum(seconds) / n
        sxx = sum((x - mx) ** 2 for x in sizes)
        sxy = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True))
        slope = sxy / sxx if sxx > 0 else 0.0
        if slope <= 0:
            return cls(math.inf, max(0.0, my))
        return cls(1.0 / slope, max(0.0, my - slope * mx))


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The machine the plan is for.

    Attributes:
      memory_per_device: bytes one device can hold; None: no limit.
      pipeline: the links between consecutive stages (activations and their gradients).
      replica: the links inside a replica group (the gradient all-reduce).
      action_overhead: seconds every scheduled action costs beyond its compute (launching a
        program, control dependencies).
      tensor_overhead: seconds per weight array for every backward: adding one
        micro-batch's gradient into the step's accumulator is one op per array.
      step_overhead: seconds every step costs once (launching the step).
      compute_scale: factor on every profiled compute time (a device faster or slower than
        the one profiled, or a calibration).
      host_cores: for simulated devices that share one host: the cores they share. A step
        then takes at least (all devices' work) / host_cores, and at least the sum of every
        device's gradient accumulations (``tensor_overhead``: framework ops outside the
        device programs, which run one at a time on the host). None: every device is its
        own hardware (GPUs, TPU cores).
    """

    memory_per_device: float | None = None
    pipeline: Link = Link()
    replica: Link = Link()
    action_overhead: float = 0.0
    tensor_overhead: float = 0.0
    step_overhead: float = 0.0
    compute_scale: float = 1.0
    host_cores: float | None = None

    def __post_init__(self) -> None:
        if self.memory_per_device is not None and not self.memory_per_device > 0:
            raise ValueError(f"memory_per_device must be positive, got {self.memory_per_device}")
        if self.host_cores is not None and not self.host_cores > 0:
            raise ValueError(f"host_cores must be positive or None, got {self.host_cores}")
        overheads = (self.action_overhead, self.tensor_overhead, self.step_overhead)
        if min(overheads) < 0 or not self.compute_scale > 0:
            raise ValueError(
                f"overheads must be >= 0 and compute_scale > 0; got action_overhead="
                f"{self.action_overhead}, tensor_overhead={self.tensor_overhead}, "
                f"step_overhead={self.step_overhead}, compute_scale={self.compute_scale}"
            )


def all_reduce_time(nbytes: float, replicas: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``replicas`` devices.

    A ring sends 2(R−1) messages of nbytes/R per device (reduce-scatter, then all-gather)::

        time = 2(R−1)/R · nbytes / bandwidth + 2(R−1) · latency        (0 when R = 1)
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    if replicas == 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (replicas - 1)
    return steps / replicas * nbytes / link.bandwidth + steps * link.latency


# ---------------------------------------------------------------------------
# Cost profiles
# ---------------------------------------------------------------------------


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear in the batch size through the measured points, extended by the
    nearest segment beyond them (proportional to the batch with a single point), >= 0."""
    if len(xs) == 1:
        return max(0.0, ys[0] * x / xs[0])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's costs, each per-batch figure given at :attr:`CostProfile.batch_sizes`.

    Attributes:
      name: the layer name, for tables.
      forward: seconds of its forward.
      backward: seconds of its backward from stored activations (remat "never").
      recompute_backward: seconds of the backward inside a recomputing forward+backward
        program (a rematerialized B costs forward + recompute_backward).
      input_backward: seconds of the input gradient alone (a split backward's B).
      stored_bytes: bytes its forward keeps for the backward (output and intermediates).
      working_bytes: the transient peak of its forward+backward above that.
      output_bytes: bytes of its output (what a stage boundary after it sends).
      param_bytes: bytes of its trainable weights.
      update: seconds of one optimizer update of its weights.
      param_tensors: its trainable weight arrays (each backward accumulates one gradient
        per array, see :attr:`Hardware.tensor_overhead`).
    """

    name: str
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    recompute_backward: tuple[float, ...]
    input_backward: tuple[float, ...]
    stored_bytes: tuple[float, ...]
    working_bytes: tuple[float, ...]
    output_bytes: tuple[float, ...]
    param_bytes: float
    update: float = 0.0
    param_tensors: int = 0


_PER_BATCH = (
    "forward",
    "backward",
    "recompute_backward",
    "input_backward",
    "stored_bytes",
    "working_bytes",
    "output_bytes",
)


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """Per-layer costs of a model; figures between the measured batch sizes are
    interpolated linearly (and extended by the nearest segment beyond them).

    Attributes:
      layers: one :class:`LayerCost` per layer, in model order.
      batch_sizes: the micro-batch sizes every per-batch figure is given at, increasing.
      input_bytes: bytes of one example of the model input.
      input_is_float: whether the model input has a gradient (token ids do not).
      source: where the figures come from, for reports.
    """

    layers: tuple[LayerCost, ...]
    batch_sizes: tuple[int, ...]
    input_bytes: float
    input_is_float: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a cost profile needs at least one layer")
        sizes = list(self.batch_sizes)
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(
                f"batch_sizes must be distinct positive integers in increasing order, got {sizes}"
            )
        for layer in self.layers:
            for name in _PER_BATCH:
                if len(getattr(layer, name)) != len(sizes):
                    raise ValueError(
                        f"layer {layer.name!r}: {name} has {len(getattr(layer, name))} values "
                        f"but the profile has {len(sizes)} batch sizes {sizes}"
                    )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def value(self, layer: int, name: str, batch: float) -> float:
        """Per-batch figure ``name`` of layer ``layer`` at a micro-batch of ``batch``."""
        return _interpolate(self.batch_sizes, getattr(self.layers[layer], name), batch)

    @property
    def param_bytes(self) -> float:
        return float(sum(layer.param_bytes for layer in self.layers))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form; :meth:`from_dict` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostProfile:
        """Reads the form :meth:`to_dict` writes."""
        layers = []
        for layer in data["layers"]:
            per_batch = {k: tuple(float(x) for x in layer[k]) for k in _PER_BATCH}
            layers.append(
                LayerCost(
                    name=str(layer["name"]),
                    param_bytes=float(layer["param_bytes"]),
                    update=float(layer.get("update", 0.0)),
                    param_tensors=int(layer.get("param_tensors", 0)),
                    **per_batch,
                )
            )
        return cls(
            layers=tuple(layers),
            batch_sizes=tuple(int(b) for b in data["batch_sizes"]),
            input_bytes=float(data["input_bytes"]),
            input_is_float=bool(data.get("input_is_float", True)),
            source=str(data.get("source", "")),
        )

    @classmethod
    def from_measurement(cls, measurement: Any, input_is_float: bool = True) -> CostProfile:
        """From :func:`hybrid.planning.profile.measure_layers`' result.

        Without allocator statistics (bytes measured as None) a layer's stored bytes fall
        back to its output bytes and its working bytes to twice that: lower bounds.
        """
        layers = []
        batch_sizes = tuple(t.batch for t in measurement.layers[0].timings)
        for m in measurement.layers:
            t = m.timings
            stored = tuple(
                float(x.stored_bytes if x.stored_bytes is not None else x.output_bytes) for x in t
            )
            working = tuple(
                float(x.working_bytes if x.working_bytes is not None else 2 * s)
                for x, s in zip(t, stored, strict=True)
            )
            layers.append(
                LayerCost(
                    name=m.name,
                    forward=tuple(x.forward for x in t),
                    backward=tuple(x.backward for x in t),
                    recompute_backward=tuple(x.recompute_backward for x in t),
                    input_backward=tuple(x.input_backward for x in t),
                    stored_bytes=stored,
                    working_bytes=working,
                    output_bytes=tuple(float(x.output_bytes) for x in t),
                    param_bytes=float(m.param_bytes),
                    update=m.update,
                    param_tensors=int(m.param_tensors),
                )
            )
        return cls(
            tuple(layers),
            batch_sizes,
            float(measurement.input_bytes),
            input_is_float,
            source=f"profiled on {measurement.device}",
        )


def uniform_profile(
    num_layers: int,
    forward: float = 1.0,
    backward: float = 2.0,
    *,
    batch: int = 1,
    input_backward: float | None = None,
    param_bytes: float = 0.0,
    stored_bytes: float = 0.0,
    working_bytes: float = 0.0,
    output_bytes: float = 0.0,
    input_bytes: float = 0.0,
    update: float = 0.0,
) -> CostProfile:
    """``num_layers`` identical layers, every per-batch figure given at one batch size
    (so proportional to the micro-batch): handy for projections and tests."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    layer = LayerCost(
        name="layer",
        forward=(forward,),
        backward=(backward,),
        recompute_backward=(backward,),
        input_backward=(backward / 2 if input_backward is None else input_backward,),
        stored_bytes=(stored_bytes,),
        working_bytes=(working_bytes,),
        output_bytes=(output_bytes,),
        param_bytes=param_bytes,
        update=update,
    )
    layers = tuple(dataclasses.replace(layer, name=f"layer_{i}") for i in range(num_layers))
    return CostProfile(layers, (batch,), input_bytes, source="uniform")


# ---------------------------------------------------------------------------
# One configuration
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One way to run a step: the mesh, the micro-batches, the schedule, the remat mode.

    Attributes:
      stages: S, devices along the pipeline.
      replicas: R, data-parallel copies of the pipeline.
      micro_batches: M per replica per step.
      schedule: a name in ``hybrid.core.schedule.names()``.
      remat: one of :data:`REMAT_MODES`.
      virtual_stages: model stages per device (interleaved only).
      balance: layers per model stage; None: the planner balances by time.
    """

    stages: int
    replicas: int
    micro_batches: int
    schedule: str = "gpipe"
    remat: str = "except_last"
    virtual_stages: int = 1
    balance: tuple[int, ...] | None = None

    @property
    def devices(self) -> int:
        return self.stages * self.replicas

    @property
    def mesh_spec(self) -> str:
        """The mesh as ``hybrid.DeviceMesh.from_spec`` reads it: ``"stage:S;replica:R"``."""
        return f"stage:{self.stages};replica:{self.replicas}"

    def label(self) -> str:
        """Short form for tables: ``2x1 M=8 interleaved(v=2) except_last``."""
        sched = self.schedule + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else "")
        return f"{self.stages}x{self.replicas} M={self.micro_batches} {sched} {self.remat}"


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for one :class:`Config` (balance filled in).

    Attributes:
      config: the configuration, with the balance used.
      global_batch: examples per step.
      step_time: seconds per step.
      pipeline_time: the schedule's makespan (all actions of one replica).
      all_reduce_time: the slowest device's gradient all-reduce.
      update_time: the slowest device's optimizer update.
      bubble: idle share of the pipeline devices over the makespan.
      memory_per_device: peak bytes of each pipeline device (equal on every replica).
      peak_in_flight: per pipeline device, micro-batches whose activations it holds at once.
    """

    config: Config
    global_batch: int
    step_time: float
    pipeline_time: float
    all_reduce_time: float
    update_time: float
    bubble: float
    memory_per_device: tuple[float, ...]
    peak_in_flight: tuple[int, ...]

    @property
    def throughput(self) -> float:
        """Examples per second."""
        return self.global_batch / self.step_time if self.step_time > 0 else math.inf

    @property
    def peak_memory(self) -> float:
        """The most any one device holds."""
        return max(self.memory_per_device)

    @property
    def total_memory(self) -> float:
        """Summed over every device of the mesh."""
        return sum(self.memory_per_device) * self.config.replicas


@functools.lru_cache(maxsize=512)
def _schedule(name: str, stages: int, micro_batches: int, virtual: int) -> schedule_lib.Schedule:
    return schedule_lib.validate(schedule_lib.get(name, stages, micro_batches, virtual))


@functools.lru_cache(maxsize=512)
def _fused(sched: schedule_lib.Schedule) -> frozenset[schedule_lib.Action]:
    return schedule_lib.pairs_to_fuse(sched)


class Infeasible(ValueError):
    """A configuration that cannot run on this model and batch.

    Attributes:
      kind: what is wrong, without the values: one of "more stages than layers",
        "batch not divisible by R × M", "interleaved needs M % S == 0", "bad balance".
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _check_config(config: Config, num_layers: int, global_batch: int) -> None:
    """Raises ValueError for bad arguments and :class:`Infeasible` for a configuration that
    cannot run, each naming the values."""
    S, R, M, v = config.stages, config.replicas, config.micro_batches, config.virtual_stages
    for name, value in (("stages", S), ("replicas", R), ("micro_batches", M)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    if config.schedule not in schedule_lib.names():
        raise ValueError(
            f"unknown schedule {config.schedule!r}; choose one of {schedule_lib.names()}"
        )
    if config.remat not in REMAT_MODES:
        raise ValueError(f"unknown remat mode {config.remat!r}; choose one of {list(REMAT_MODES)}")
    if v != 1 and config.schedule != "interleaved":
        raise ValueError(
            f"schedule {config.schedule!r} runs one stage per device; virtual_stages={v} "
            "needs the interleaved schedule"
        )
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"virtual_stages must be a positive integer, got {v!r}")
    if S * v > num_layers:
        per = f" ({S} devices × {v} virtual stages)" if v > 1 else ""
        raise Infeasible(
            "more stages than layers",
            f"more stages than layers: {S * v} model stages{per} but the model has "
            f"{num_layers} layers",
        )
    if global_batch % (R * M):
        raise Infeasible(
            "batch not divisible by R × M",
            f"global batch {global_batch} is not divisible by replicas ({R}) × micro_batches "
            f"({M}) = {R * M}",
        )
    if config.schedule == "interleaved" and M % S:
        raise Infeasible(
            "interleaved needs M % S == 0",
            f"interleaved needs micro_batches to be a multiple of the stages: M={M}, S={S}",
        )
    if config.balance is not None:
        try:
            partition.check_balance(config.balance, num_layers, S * v)
        except ValueError as err:
            raise Infeasible("bad balance", str(err)) from err


class _Stage:
    """Summed costs of one model stage's layers at one micro-batch size."""

    def __init__(
        self, profile: CostProfile, first: int, count: int, batch: float, scale: float
    ) -> None:
        ids = range(first, first + count)

        def total(name: str) -> float:
            return sum(profile.value(i, name, batch) for i in ids)

        self.forward = scale * total("forward")
        self.backward = scale * total("backward")
        self.recompute = scale * total("recompute_backward")
        self.input_backward = scale * total("input_backward")
        # The first layer's input gradient is B's job in a split backward; model stage 0
        # never computes it (nothing upstream needs it).
        self.first_dx = scale * profile.value(first, "input_backward", batch)
        self.stored = total("stored_bytes")
        working = [profile.value(i, "working_bytes", batch) for i in ids]
        self.working, self.working_sum = max(working), sum(working)
        self.output = profile.value(first + count - 1, "output_bytes", batch)
        self.params = sum(profile.layers[i].param_bytes for i in ids)
        self.tensors = sum(profile.layers[i].param_tensors for i in ids)
        self.update = scale * sum(profile.layers[i].update for i in ids)
        if first == 0:
            self.input = profile.input_bytes * batch
            self.needs_dx = False
        else:
            self.input = profile.value(first - 1, "output_bytes", batch)
            self.needs_dx = True

    def stored_fraction(self, part: float) -> float:
        """``part`` of the recomputing backward as a share of the stored backward."""
        return self.backward * part / self.recompute if self.recompute > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class _ActionCosts(schedule_lib.Costs):
    """:class:`hybrid.core.schedule.Costs` with a time for every single action: a fused pair or
    ``except_last`` makes one micro-batch's backward cost differ from the others'."""

    table: Mapping[schedule_lib.Action, float] = dataclasses.field(default_factory=dict)

    def of(self, action: schedule_lib.Action, split: bool) -> float:
        return self.table[action]


def _action_costs(
    sched: schedule_lib.Schedule, stages: Sequence[_Stage], remat: str, hardware: Hardware
) -> dict[schedule_lib.Action, float]:
    """Seconds of every action of ``sched``.

    F costs ``action_overhead`` + the stage's forward. B recomputes the forward first when
    remat says so; the last stage's B that directly follows its F runs in one program with
    it (no second launch, no recomputation). With a split backward B is the input gradient
    (nothing on model stage 0, which needs none) and W the weight gradients, which also
    carry the input gradients of every layer but the first through the stage. The action
    that makes the weight gradients pays ``tensor_overhead`` per weight array it
    accumulates.
    """
    M = sched.num_microbatches
    split = sched.splits_backward
    fused = _fused(sched)
    launch = hardware.action_overhead
    Op = schedule_lib.Op

    def recomputes(m: int) -> bool:
        return remat == "always" or (remat == "except_last" and m != M - 1)

    def cost(action: schedule_lib.Action) -> float:
        k, m = action.stage, action.microbatch
        st = stages[k]
        skip_dx = 0.0 if st.needs_dx else st.first_dx  # model stage 0: no input gradient
        accumulate = hardware.tensor_overhead * st.tensors
        if action.op is Op.F:
            return launch + st.forward
        if schedule_lib.Action(k, Op.F, m) in fused:  # B (and W) inside F's program
            return st.recompute - skip_dx + accumulate if action.op is Op.B else 0.0
        if not split:
            if recomputes(m):
                return launch + st.forward + st.recompute - skip_dx + accumulate
            return launch + st.backward - st.stored_fraction(skip_dx) + accumulate
        if action.op is Op.B:
            if not st.needs_dx:
                return 0.0
            if recomputes(m):
                return launch + st.forward + st.input_backward
            return launch + st.stored_fraction(st.input_backward)
        if recomputes(m):
            return launch + st.forward + st.recompute - st.first_dx + accumulate
        return launch + st.backward - st.stored_fraction(st.first_dx) + accumulate

    return {a: cost(a) for row in sched.actions for a in row}


def _activation_bytes(st: _Stage, in_flight: int, remat: str, keeps_last: bool) -> float:
    """Peak activation bytes of one model stage holding ``in_flight`` micro-batches::

    never:        in_flight · (input + stored) + the largest layer's working set
    always:       in_flight · input + Σ working sets (one recomputing program at a time:
                  all its layers' intermediates, and their backward's temporaries)
    except_last:  as always, + stored when the last micro-batch's activations are kept
                  (``keeps_last``: its forward is not fused with its backward)
    """
    if in_flight == 0:
        return 0.0
    if remat == "never":
        return in_flight * (st.input + st.stored) + st.working
    extra = st.stored if remat == "except_last" and keeps_last else 0.0
    return in_flight * st.input + st.working_sum + extra


def _balance_for(profile: CostProfile, config: Config, batch: float) -> tuple[int, ...]:
    """Time-balanced contiguous partition into S·v model stages at this micro-batch."""
    backward = "backward" if config.remat == "never" else "recompute_backward"
    costs = [
        profile.value(i, "forward", batch) + profile.value(i, backward, batch)
        for i in range(profile.num_layers)
    ]
    return partition.balance_by_cost(costs, config.stages * config.virtual_stages)


def evaluate(
    profile: CostProfile,
    config: Config,
    global_batch: int,
    hardware: Hardware | None = None,
    optimizer_slots: int = 2,
) -> Prediction:
    """Predicts one configuration's step time, bubble and memory per device.

    Conceptually::

        b = global_batch / (R · M);  balance = config.balance or time-balanced at b
        costs = Costs(F, B, W per model stage, transfer = boundary bytes / bandwidth)
        run = schedule.simulate(schedule, costs)
        end_d = when device d's last action ends in run
        step = max_d (end_d + all_reduce(param bytes on d, R) + update_d) + step overhead
        (with host_cores: at least R · Σ_d (busy_d + all_reduce_d + update_d) / host_cores,
         and at least R · M · Σ_k weight arrays_k · tensor_overhead)
        memory_d = param bytes on d · (2 + optimizer_slots) + 2 · param bytes if R > 1
                   + the activations peak_in_flight[d] micro-batches hold (its largest stage)

    (weights, the gradient accumulator and the optimizer slots; the flattened all-reduce
    buffers; activations by remat mode, see :func:`_activation_bytes`).

    Args:
      profile: per-layer costs.
      config: the configuration; with ``balance=None`` the planner balances by time.
      global_batch: examples per step over all replicas.
      hardware: links, overheads and memory; default: free links, no overheads.
      optimizer_slots: optimizer state per weight (Adam 2, SGD with momentum 1, SGD 0).

    Raises:
      Infeasible: a configuration that cannot run (more stages than layers, a batch not
        divisible by R × M, interleaved with M % S != 0, a bad balance).
      ValueError: bad arguments (an unknown schedule or remat mode, sizes below 1). Every
        message names the values.
    """
    hardware = hardware or Hardware()
    _check_config(config, profile.num_layers, global_batch)
    if optimizer_slots < 0:
        raise ValueError(f"optimizer_slots must be >= 0, got {optimizer_slots}")
    S, R, M = config.stages, config.replicas, config.micro_batches
    sched = _schedule(config.schedule, S, M, config.virtual_stages)
    batch = global_batch / (R * M)
    balance = config.balance or _balance_for(profile, config, batch)
    starts = [sum(balance[:k]) for k in range(len(balance))]
    stages = [
        _Stage(profile, start, count, batch, hardware.compute_scale)
        for start, count in zip(starts, balance, strict=True)
    ]
    transfer = 0.0
    if len(stages) > 1:
        transfer = hardware.pipeline.time(max(st.output for st in stages[:-1]))
    table = _action_costs(sched, stages, config.remat, hardware)
    fused = _fused(sched)
    run = schedule_lib.simulate(sched, _ActionCosts(transfer=transfer, table=table))

    ends = [0.0] * S
    for action, _, end in run.timeline:
        d = sched.device_of(action.stage)
        ends[d] = max(ends[d], float(end))
    finish, reduce_max, update_max, memory, work = [], 0.0, 0.0, [], 0.0
    for d in range(S):
        mine = [st for k, st in enumerate(stages) if sched.device_of(k) == d]
        params = sum(st.params for st in mine)
        reduce = all_reduce_time(params, R, hardware.replica)
        update = sum(st.update for st in mine) + hardware.action_overhead * len(mine)
        finish.append(ends[d] + reduce + update)
        work += R * (float(run.busy[d]) + reduce + update)
        reduce_max, update_max = max(reduce_max, reduce), max(update_max, update)
        resident = params * (2 + optimizer_slots) + (2 * params if R > 1 else 0.0)
        held = max(
            _activation_bytes(
                stages[k],
                run.peak_in_flight[d],
                config.remat,
                M > 1 and schedule_lib.Action(k, schedule_lib.Op.F, M - 1) not in fused,
            )
            for k in range(len(stages))
            if sched.device_of(k) == d
        )
        memory.append(resident + held)
    step = max(finish)
    if hardware.host_cores is not None:
        serial = R * M * hardware.tensor_overhead * sum(st.tensors for st in stages)
        step = max(step, work / hardware.host_cores, serial)
    return Prediction(
        config=dataclasses.replace(config, balance=tuple(balance)),
        global_batch=global_batch,
        step_time=step + hardware.step_overhead,
        pipeline_time=float(run.makespan),
        all_reduce_time=reduce_max,
        update_time=update_max,
        bubble=float(run.bubble_fraction),
        memory_per_device=tuple(memory),
        peak_in_flight=tuple(run.peak_in_flight),
    )


# ---------------------------------------------------------------------------
# Plans: every candidate, ranked
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A candidate that cannot run or does not fit, and why.

    Attributes:
      config: the candidate.
      kind: "out of memory" or an :attr:`Infeasible.kind`.
      reason: with the values, e.g. "out of memory: needs 3.1 GiB per device, has 2.0 GiB".
      prediction: the prediction, when the candidate could run but does not fit.
    """

    config: Config
    kind: str
    reason: str
    prediction: Prediction | None = None


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def _bytes(nbytes: float) -> str:
    """1.5 GiB, 3.2 MiB, 12 KiB, 100 B."""
    for unit, size in (("GiB", GiB), ("MiB", float(1 << 20)), ("KiB", 1024.0)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every candidate the planner considered: the ones that fit, fastest first, and the
    rejected ones with their reasons.

    Attributes:
      devices: N, the device budget.
      global_batch: examples per step.
      hardware: the machine planned for.
      ranked: predictions of the feasible candidates, fastest first.
      rejected: the others.
    """

    devices: int
    global_batch: int
    hardware: Hardware
    ranked: tuple[Prediction, ...]
    rejected: tuple[Rejection, ...]

    @property
    def best(self) -> Prediction:
        """The fastest feasible candidate.

        Raises:
          ValueError: none is feasible; the message summarises why.
        """
        if not self.ranked:
            raise ValueError(
                f"no configuration of {self.devices} devices fits a global batch of "
                f"{self.global_batch}: " + "; ".join(self.reasons())
            )
        return self.ranked[0]

    def reasons(self) -> list[str]:
        """Each kind of rejection with its count and one example, most frequent first:
        ``"out of memory ×12 (e.g. 1x8 M=1 gpipe never: needs 3.1 GiB per device, ...)"``."""
        groups: dict[str, list[Rejection]] = {}
        for r in self.rejected:
            groups.setdefault(r.kind, []).append(r)
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
        return [
            f"{kind} ×{len(rs)} (e.g. {rs[0].config.label()}: {rs[0].reason})"
            for kind, rs in ordered
        ]

    def table(self, top: int = 10, rejected: int = 5) -> str:
        """A text table of the ``top`` fastest candidates, then up to ``rejected``
        rejections (the fastest out-of-memory ones first)."""
        memory = self.hardware.memory_per_device
        head = (
            f"plan for {self.devices} devices, global batch {self.global_batch}"
            + (f", {_bytes(memory)} per device" if memory else "")
            + f": {len(self.ranked)} feasible, {len(self.rejected)} rejected"
        )
        cols = f"{'#':>3} {'mesh':>6} {'M':>4} {'schedule':<16} {'remat':<12} {'step':>9} "
        cols += f"{'examples/s':>11} {'bubble':>7} {'mem/device':>11}  balance"
        lines = [head, cols]
        for i, p in enumerate(self.ranked[:top], 1):
            c = p.config
            sched = c.schedule + (f"(v={c.virtual_stages})" if c.virtual_stages > 1 else "")
            bal = _runs(c.balance or ())
            lines.append(
                f"{i:>3} {f'{c.stages}x{c.replicas}':>6} {c.micro_batches:>4} {sched:<16} "
                f"{c.remat:<12} {_time(p.step_time):>9} {p.throughput:>11.4g} "
                f"{p.bubble:>7.1%} {_bytes(p.peak_memory):>11}  {bal}"
            )
        if self.rejected and rejected > 0:
            lines.append("rejected:")
            lines += [f"    {reason}" for reason in self.reasons()]
            fastest = sorted(
                (r for r in self.rejected if r.prediction is not None),
                key=lambda r: r.prediction.step_time if r.prediction else math.inf,
            )[:rejected]
            if fastest:
                lines.append("fastest that do not fit:")
                for r in fastest:
                    assert r.prediction is not None
                    lines.append(
                        f"    {r.config.label()}: {_time(r.prediction.step_time)}, {r.reason}"
                    )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _runs(balance: Sequence[int]) -> str:
    """``(4, 3, 3, 3, 4)`` -> ``"4,3×3,4"``: runs of three or more equal counts shortened."""
    parts: list[str] = []
    i = 0
    while i < len(balance):
        j = i
        while j < len(balance) and balance[j] == balance[i]:
            j += 1
        run = j - i
        parts += [f"{balance[i]}×{run}"] if run > 2 else [str(balance[i])] * run
        i = j
    return ",".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(
    devices: int,
    global_batch: int,
    num_layers: int,
    schedules: Sequence[str],
    remats: Sequence[str],
    micro_batches: Sequence[int] | None,
    max_micro_batches: int,
    max_virtual_stages: int,
    stages: Sequence[int] | None,
) -> Iterable[Config]:
    for S in stages if stages is not None else _divisors(devices):
        R = devices // S
        per_replica = global_batch // R if global_batch % R == 0 else 0
        if micro_batches is not None:
            ms = list(micro_batches)
        else:
            ms = [m for m in _divisors(per_replica) if m <= max_micro_batches] or [1]
        for name in schedules:
            virtuals = range(2, max_virtual_stages + 1) if name == "interleaved" else [1]
            for v in virtuals:
                for M in ms:
                    for remat in remats:
                        yield Config(S, R, M, name, remat, v)


def plan(
    model: Sequence[Any] | CostProfile,
    *,
    devices: int,
    global_batch: int,
    memory_per_device: float | None = None,
    hardware: Hardware | None = None,
    input_shape: Sequence[int] | None = None,
    input_dtype: str = "float32",
    loss: Any = None,
    target_shape: Sequence[int] | None = None,
    optimizer: Callable[[], Any] | None = None,
    optimizer_slots: int = 2,
    schedules: Sequence[str] | None = None,
    remats: Sequence[str] | None = None,
    micro_batches: Sequence[int] | None = None,
    max_micro_batches: int = 32,
    max_virtual_stages: int = 2,
    stages: Sequence[int] | None = None,
    device: str | None = None,
) -> Plan:
    """Ranks every way to train ``model`` on ``devices`` devices by predicted step time.

    Candidates: every S × R = devices (or the given ``stages``), every M dividing the
    per-replica batch up to ``max_micro_batches`` (or the given ``micro_batches``), every
    schedule (interleaved with 2 … ``max_virtual_stages`` virtual stages) and remat mode.
    Each runs through :func:`evaluate`; a candidate that cannot run, or needs more than
    ``memory_per_device``, is rejected with the reason.

    Args:
      model: a list of Keras layers (profiled on one device first, see
        :func:`profile_model`; needs ``input_shape``) or a :class:`CostProfile`.
      devices: N, the device budget.
      global_batch: examples per step.
      memory_per_device: bytes per device (overrides ``hardware.memory_per_device``).
      hardware: links and overheads (default: free links, no overheads, no memory limit).
      input_shape, input_dtype, loss, target_shape, optimizer, device: for profiling
        layers (see :func:`profile_model`).
      optimizer_slots: optimizer state per weight (Adam 2).
      schedules: schedule names (default: all of ``hybrid.core.schedule.names()``).
      remats: remat modes (default: all of :data:`REMAT_MODES`).

    Raises:
      ValueError: devices or global_batch below 1, an unknown schedule or remat mode, or
        layers without an input shape.
    """
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive integer, got {global_batch!r}")
    schedules = list(schedules) if schedules is not None else schedule_lib.names()
    remats = list(remats) if remats is not None else list(REMAT_MODES)
    for name in schedules:
        if name not in schedule_lib.names():
            raise ValueError(f"unknown schedule {name!r}; choose one of {schedule_lib.names()}")
    for mode in remats:
        if mode not in REMAT_MODES:
            raise ValueError(f"unknown remat mode {mode!r}; choose one of {list(REMAT_MODES)}")
    if stages is not None:
        for S in stages:
            if S < 1 or devices % S:
                raise ValueError(f"stages={S} does not divide devices={devices}")
    hardware = hardware or Hardware()
    if memory_per_device is not None:
        hardware = dataclasses.replace(hardware, memory_per_device=memory_per_device)
    if isinstance(model, CostProfile):
        profile = model
    else:
        if input_shape is None:
            raise ValueError(
                "plan() needs input_shape (without the batch dimension) to profile a list "
                "of layers, or a CostProfile instead of layers"
            )
        sizes = _profile_batches(devices, global_batch, micro_batches, max_micro_batches)
        profile = profile_model(
            model,
            input_shape,
            input_dtype,
            sizes,
            loss=loss,
            target_shape=target_shape,
            optimizer=optimizer,
            device=device,
        )
    ranked, rejected = [], []
    for config in _candidates(
        devices,
        global_batch,
        profile.num_layers,
        schedules,
        remats,
        micro_batches,
        max_micro_batches,
        max_virtual_stages,
        stages,
    ):
        try:
            prediction = evaluate(profile, config, global_batch, hardware, optimizer_slots)
        except Infeasible as err:
            rejected.append(Rejection(config, err.kind, str(err)))
            continue
        limit = hardware.memory_per_device
        if limit is not None and prediction.peak_memory > limit:
            needs, has = _bytes(prediction.peak_memory), _bytes(limit)
            reason = f"out of memory: needs {needs} per device, has {has}"
            rejected.append(Rejection(prediction.config, "out of memory", reason, prediction))
            continue
        ranked.append(prediction)
    ranked.sort(key=_rank_key)
    return Plan(devices, global_batch, hardware, tuple(ranked), tuple(rejected))


def _rank_key(p: Prediction) -> tuple[float, float, int, int, str, str]:
    """Fastest first; then less memory, fewer stages, fewer micro-batches, by name."""
    c = p.config
    return (p.step_time, p.peak_memory, c.stages, c.micro_batches, c.schedule, c.remat)


def _profile_batches(
    devices: int, global_batch: int, micro_batches: Sequence[int] | None, cap: int
) -> list[int]:
    """The smallest and largest micro-batch any candidate runs (two points to interpolate)."""
    sizes = set()
    for R in _divisors(devices):
        if global_batch % R:
            continue
        per = global_batch // R
        for M in micro_batches or [m for m in _divisors(per) if m <= cap]:
            if per % M == 0:
                sizes.add(per // M)
    if not sizes:
        return [max(1, global_batch // devices)]
    return sorted({min(sizes), max(sizes)})


def profile_model(
    layers: Sequence[Any],
    input_shape: Sequence[int],
    input_dtype: str,
    batch_sizes: Sequence[int],
    *,
    loss: Any = None,
    target_shape: Sequence[int] | None = None,
    optimizer: Callable[[], Any] | None = None,
    device: str | None = None,
    repeats: int = 7,
) -> CostProfile:
    """Measures ``layers`` on one device (:func:`hybrid.planning.profile.measure_layers`) at the
    given micro-batch sizes and returns their :class:`CostProfile`.

    ``device`` defaults to the first local device (the first GPU, else the first CPU).
    """
    import tensorflow as tf  # only profiling needs TensorFlow

    from hybrid.core.mesh import local_devices
    from hybrid.planning import profile as profile_lib

    where = device or local_devices()[0]
    measurement = profile_lib.measure_layers(
        layers,
        input_shape,
        input_dtype,
        batch_sizes,
        where,
        loss=loss,
        target_shape=target_shape,
        optimizer=optimizer,
        repeats=repeats,
    )
    return CostProfile.from_measurement(
        measurement, input_is_float=tf.as_dtype(input_dtype).is_floating
    )


# ---------------------------------------------------------------------------
# The launcher's --mesh=auto
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Choice:
    """The configuration :func:`choose_mesh` picked, ready for ``hybrid.Pipeline``.

    Attributes:
      stages, replicas: the mesh; :attr:`mesh_spec` is its spec string.
      micro_batches, schedule, remat, virtual_stages, balance: the Pipeline arguments.
      step_time: predicted seconds per step.
      memory_per_device: predicted peak bytes on the fullest device.
    """

    stages: int
    replicas: int
    micro_batches: int
    schedule: str
    remat: str
    virtual_stages: int
    balance: tuple[int, ...]
    step_time: float
    memory_per_device: float

    @property
    def mesh_spec(self) -> str:
        return f"stage:{self.stages};replica:{self.replicas}"


def choose_mesh(
    layers: Sequence[Any] | CostProfile,
    input_spec: tuple[Sequence[int], str] | None,
    devices: int,
    global_batch: int,
    memory_per_device: float | None = None,
    schedule: str | None = None,
    remat: str | None = None,
    *,
    hardware: Hardware | None = None,
    loss: Any = None,
    optimizer: Callable[[], Any] | None = None,
    optimizer_slots: int = 2,
    micro_batches: int | None = None,
    device: str | None = None,
) -> Choice:
    """The fastest configuration of ``devices`` devices that fits, as Pipeline arguments.

    :func:`plan` over every mesh, with ``schedule``, ``remat`` and ``micro_batches``
    fixed when given (None: the planner chooses).

    Args:
      layers: the model's layers (profiled on ``device``) or a :class:`CostProfile`.
      input_spec: (input shape without the batch dimension, dtype), e.g. ((64,), "int32");
        may be None with a CostProfile.

    Raises:
      ValueError: no configuration fits; the message gives the reasons.
    """
    shape, dtype = input_spec if input_spec is not None else (None, "float32")
    result = plan(
        layers,
        devices=devices,
        global_batch=global_batch,
        memory_per_device=memory_per_device,
        hardware=hardware,
        input_shape=shape,
        input_dtype=dtype,
        loss=loss,
        optimizer=optimizer,
        optimizer_slots=optimizer_slots,
        schedules=[schedule] if schedule else None,
        remats=[remat] if remat else None,
        micro_batches=[micro_batches] if micro_batches else None,
        device=device,
    )
    best = result.best
    c = best.config
    assert c.balance is not None  # evaluate() always fills it
    return Choice(
        stages=c.stages,
        replicas=c.replicas,
        micro_batches=c.micro_batches,
        schedule=c.schedule,
        remat=c.remat,
        virtual_stages=c.virtual_stages,
        balance=c.balance,
        step_time=best.step_time,
        memory_per_device=best.peak_memory,
    )
