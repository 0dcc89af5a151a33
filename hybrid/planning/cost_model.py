"""The cost model: one run configuration's predicted step time, bubble and memory per device
(:func:`evaluate`), from a model's per-layer costs, the machine, and a simulation of the
schedule with every action's cost.

Conventions: times in seconds, sizes in bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from hybrid.core import memory, partition
from hybrid.core import schedule as schedule_lib
from hybrid.core.config import RunConfig, validate_run
from hybrid.planning.costs import CostProfile
from hybrid.planning.hardware import Hardware, all_gather_time, all_reduce_time
from hybrid.planning.stage_costs import (
    ActionCosts,
    StageCost,
    action_costs,
    deferred_schedule,
)

__all__ = ["Prediction", "evaluate", "layer_bytes"]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the cost model predicts for one :class:`RunConfig` (balance filled in).

    Attributes:
      config: the configuration, with the balance used, the global batch and layer count.
      global_batch: examples per step.
      step_time: seconds per step.
      pipeline_time: the schedule's makespan (all actions of one replica).
      all_reduce_time: the slowest device's gradient all-reduce.
      update_time: the slowest device's optimizer update.
      bubble: idle share of the pipeline devices over the makespan.
      memory_per_device: peak bytes of each pipeline device (equal on every replica).
      peak_in_flight: per pipeline device, micro-batches whose activations it holds at once.
      memory_terms: per pipeline device, ``memory_per_device`` in its terms (bytes):
        ``params``, ``optimizer`` (slots), ``batch_input``, ``gradients``,
        ``activations`` and their ``total``
        (:func:`hybrid.core.memory.memory_terms`).
    """

    config: RunConfig
    global_batch: int
    step_time: float
    pipeline_time: float
    all_reduce_time: float
    update_time: float
    bubble: float
    memory_per_device: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    memory_terms: tuple[dict[str, float], ...] = ()

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


@dataclasses.dataclass(frozen=True)
class _DeviceCost:
    """One pipeline device's share of a step.

    Attributes:
      finish: when its last action ends, plus its all-reduce and its update.
      reduce: its gradient all-reduce.
      update: its optimizer updates (one launch per model stage it holds; sharded: its
        share of them, then the all-gather of the updated weights).
      work: busy time + all-reduce + update, summed over the R replicas of this device.
      memory: peak bytes: weights, gradients, optimizer slots and the activations of its
        fullest model stage.
    """

    finish: float
    reduce: float
    update: float
    work: float
    memory: float
    terms: dict[str, float]


def evaluate(
    profile: CostProfile,
    config: RunConfig,
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
        step = max(max_d (end_d + all_reduce(param bytes on d, R) + update_d),
                   R · |schedule actions| · dispatch overhead) + step overhead
        (with host_cores: every compute cost × max(1, R · min(S, M) / host_cores), the
         devices that compute at once sharing the host's cores, × the profile's
         concurrency when R · min(S, M) ≥ 2; the step at least R · Σ_d (busy_d at full speed +
         all_reduce_d + update_d) / host_cores and R · M · Σ_k arrays_k · tensor_overhead)
        memory_d = memory_terms(param bytes on d, optimizer_slots, R,
                                the activations peak_in_flight[d] micro-batches hold
                                (its largest stage), ...)["total"]

    (weights, the gradient accumulator and the optimizer slots; the update phase's reduced
    gradients; activations by remat mode: :func:`hybrid.core.memory.device_terms`).
    Deferred weight gradients: B is each micro-batch's input gradient, the rest of every
    stage's backward runs once at M·b rows, and every micro-batch's activations stay
    (``deferred_bytes``).

    Args:
      profile: per-layer costs.
      config: the configuration; with ``balance`` None or "time" the planner balances the
        layers by time; its ``global_batch`` and ``num_layers``, when given, must agree with
        ``global_batch`` and the profile.
      global_batch: examples per step over all replicas.
      hardware: links, overheads and memory; default: free links, no overheads.
      optimizer_slots: optimizer state per weight (Adam 2, SGD with momentum 1, SGD 0).

    Raises:
      ConfigError: a configuration :func:`hybrid.core.config.validate_run` refuses (its
        ``kind`` says which rule); the message names the values.
      ValueError: ``optimizer_slots`` below 0, ``balance="params"`` or ``"compute"``, or a
        global batch or layer count in ``config`` that differs from the arguments.
    """
    hardware = hardware or Hardware()
    config = _checked(config, profile.num_layers, global_batch)
    if optimizer_slots < 0:
        raise ValueError(f"optimizer_slots must be >= 0, got {optimizer_slots}")
    S, R, M = config.stages, config.replicas, config.micro_batches
    sched = _schedule(config.schedule, S, M, config.virtual_stages)
    batch = global_batch / (R * M)
    balance = _balance(profile, config, batch, sched, optimizer_slots)
    scale = hardware.compute_scale * _sharing(config, hardware) * _beside(config, hardware, profile)
    stages = _stage_costs(profile, balance, batch, scale)
    defer = config.defer_weight_gradients and M > 1
    whole = _stage_costs(profile, balance, batch * M, scale) if defer else None
    sched = deferred_schedule(sched) if defer else sched
    run = _simulate(sched, stages, config.remat, hardware, whole)
    ends = _device_ends(sched, run)
    usage = memory.Usage(
        optimizer_slots=optimizer_slots,
        replicas=R,
        micro_batches=M,
        remat=config.remat,
        in_flight=[run.peak_in_flight[sched.device_of(k)] for k in range(len(stages))],
        keeps_last=memory.keeps_last(sched),
        deferred=defer,
        fused=memory.fuses_all(sched),
        sharded=config.shard_optimizer_states,
    )
    devices = [
        _device_cost(d, ends[d], sched, stages, run, config, hardware, whole, usage)
        for d in range(S)
    ]
    return Prediction(
        config=dataclasses.replace(config, balance=balance),
        global_batch=global_batch,
        step_time=_step_time(
            devices, stages, config, hardware, config.replicas * sched.num_actions
        ),
        pipeline_time=float(run.makespan),
        all_reduce_time=max(0.0, *(dev.reduce for dev in devices)),
        update_time=max(0.0, *(dev.update for dev in devices)),
        bubble=float(run.bubble_fraction),
        memory_per_device=tuple(dev.memory for dev in devices),
        peak_in_flight=tuple(run.peak_in_flight),
        memory_terms=tuple(dev.terms for dev in devices),
    )


def _checked(config: RunConfig, num_layers: int, global_batch: int) -> RunConfig:
    """``config`` with the global batch and layer count filled in, checked by
    :func:`validate_run`; the planner models no balance by parameter counts or estimated compute."""
    for name, value in (("global_batch", global_batch), ("num_layers", num_layers)):
        given = getattr(config, name)
        if given is not None and given != value:
            raise ValueError(
                f"config.{name}={given!r} differs from the {name} being evaluated ({value!r})"
            )
    config = validate_run(
        dataclasses.replace(config, global_batch=global_batch, num_layers=num_layers)
    )
    if config.balance in ("params", "compute"):
        raise ValueError(
            "the planner balances layers by measured time or memory; use balance=None, "
            f"'time', 'memory' or layer counts per stage, not {config.balance!r}"
        )
    return config


@functools.lru_cache(maxsize=512)
def _schedule(name: str, stages: int, micro_batches: int, virtual: int) -> schedule_lib.Schedule:
    """The validated schedule, cached (a plan evaluates the same one under many remats)."""
    return schedule_lib.validate(schedule_lib.get(name, stages, micro_batches, virtual))


def _balance(
    profile: CostProfile,
    config: RunConfig,
    batch: float,
    sched: schedule_lib.Schedule,
    optimizer_slots: int,
) -> tuple[int, ...]:
    """Layers per model stage: the given counts; with ``balance="memory"`` the cut whose
    largest predicted stage peak is smallest (:func:`hybrid.core.memory.balance_by_memory`
    on the measured layer bytes); else the time-balanced contiguous partition into S·v
    model stages at this micro-batch."""
    if config.balance is not None and not isinstance(config.balance, str):
        return tuple(config.balance)
    if config.balance == "memory":
        M = config.micro_batches
        usage = memory.usage_of(config, sched, optimizer_slots)
        whole = layer_bytes(profile, batch * M)
        return memory.balance_by_memory(
            layer_bytes(profile, batch), config.model_stages, usage, whole
        )
    backward = "backward" if config.remat == "never" else "recompute_backward"
    costs = [
        profile.value(i, "forward", batch) + profile.value(i, backward, batch)
        for i in range(profile.num_layers)
    ]
    return partition.balance_by_cost(costs, config.model_stages)


def layer_bytes(profile: CostProfile, batch: float) -> memory.LayerBytes:
    """The profile's measured per-layer bytes at this micro-batch size."""
    ids = range(profile.num_layers)
    return memory.LayerBytes(
        params=[profile.layers[i].param_bytes for i in ids],
        stored=[profile.value(i, "stored_bytes", batch) for i in ids],
        working=[profile.value(i, "working_bytes", batch) for i in ids],
        output=[profile.value(i, "output_bytes", batch) for i in ids],
        model_input=profile.input_bytes * batch,
    )


def _stage_costs(
    profile: CostProfile, balance: Sequence[int], batch: float, scale: float
) -> list[StageCost]:
    """Every model stage's summed layer costs at this micro-batch."""
    starts = [sum(balance[:k]) for k in range(len(balance))]
    return [
        StageCost(profile, start, count, batch, scale)
        for start, count in zip(starts, balance, strict=True)
    ]


def _simulate(
    sched: schedule_lib.Schedule,
    stages: Sequence[StageCost],
    remat: str,
    hardware: Hardware,
    whole: Sequence[StageCost] | None,
) -> schedule_lib.SimulationResult:
    """The schedule simulated with every action's cost and the largest boundary transfer
    (weight gradients deferred when ``whole``, the stages at all micro-batches' rows)."""
    transfer = 0.0
    if len(stages) > 1:
        transfer = hardware.pipeline.time(max(st.output for st in stages[:-1]))
    table = action_costs(sched, stages, remat, hardware, whole)
    return schedule_lib.simulate(sched, ActionCosts(transfer=transfer, table=table))


def _device_ends(sched: schedule_lib.Schedule, run: schedule_lib.SimulationResult) -> list[float]:
    """Per pipeline device: when its last action ends."""
    ends = [0.0] * sched.num_stages
    for action, _, end in run.timeline:
        d = sched.device_of(action.stage)
        ends[d] = max(ends[d], float(end))
    return ends


def _device_cost(
    d: int,
    end: float,
    sched: schedule_lib.Schedule,
    stages: Sequence[StageCost],
    run: schedule_lib.SimulationResult,
    config: RunConfig,
    hardware: Hardware,
    whole: Sequence[StageCost] | None,
    usage: memory.Usage,
) -> _DeviceCost:
    """Device ``d``'s all-reduce, update, work and memory (``usage``: how the run uses it),
    and when it finishes the step."""
    R = config.replicas
    ks = [k for k in range(len(stages)) if sched.device_of(k) == d]
    params = sum(stages[k].params for k in ks)
    reduce = all_reduce_time(params, R, hardware.replica)
    update = sum(stages[k].update for k in ks) + hardware.action_overhead * len(ks)
    if config.shard_optimizer_states:  # each replica updates its share, then sends it
        update = update / R + all_gather_time(params, R, hardware.replica)
    terms = memory.device_terms(
        [stages[k] for k in ks], [(whole or stages)[k] for k in ks], ks, usage
    )
    return _DeviceCost(
        finish=end + reduce + update,
        reduce=reduce,
        update=update,
        work=R * (float(run.busy[d]) / _sharing(config, hardware) + reduce + update),
        memory=terms["total"],
        terms=terms,
    )


def _sharing(config: RunConfig, hardware: Hardware) -> float:
    """How much slower each device computes with ``host_cores`` cores shared by the devices
    that compute at once, R · min(S, M): a replica's pipeline keeps at most M of its S
    devices busy (one micro-batch: one device at a time, a core to itself). 1 without a
    shared host. On a real host two busy cores already run slower than one (shared caches,
    memory bandwidth, clocks), which a fitted host_cores below the core count expresses."""
    if hardware.host_cores is None:
        return 1.0
    return max(1.0, _at_once(config) / hardware.host_cores)


def _at_once(config: RunConfig) -> int:
    """The devices that can compute at the same time: R · min(S, M)."""
    return config.replicas * min(config.stages, config.micro_batches)


def _beside(config: RunConfig, hardware: Hardware, profile: CostProfile) -> float:
    """How much slower each device computes while others of the host compute beside it,
    beyond sharing the cores (:func:`_sharing`): the profile's ``concurrency``, measured
    on the model, on a shared host where two devices or more compute at once; else 1 (a
    pipeline of one micro-batch computes on one device at a time)."""
    if hardware.host_cores is None or _at_once(config) < 2:
        return 1.0
    return profile.concurrency


def _step_time(
    devices: Sequence[_DeviceCost],
    stages: Sequence[StageCost],
    config: RunConfig,
    hardware: Hardware,
    actions: int,
) -> float:
    """The slowest device's finish (or, on a shared host, the bound of its cores and of its
    serial gradient accumulations), at least the host's launches of the step's
    ``actions`` (every replica's schedule), plus the step's own overhead."""
    step = max(max(dev.finish for dev in devices), actions * hardware.dispatch_overhead)
    if hardware.host_cores is not None:
        R = config.replicas
        M = 1 if config.defer_weight_gradients else config.micro_batches  # accumulations
        serial = R * M * hardware.tensor_overhead * sum(st.tensors for st in stages)
        work = sum(dev.work for dev in devices)
        step = max(step, work / hardware.host_cores, serial)
    return step + hardware.step_overhead
