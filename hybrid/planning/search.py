"""The search: every candidate configuration of N devices (mesh, micro-batches, schedule,
virtual stages, remat), each judged by the cost model and ranked by predicted step time
(:func:`plan`), and the launcher's ``--mesh=auto`` pick as Pipeline arguments
(:func:`choose_mesh`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hybrid.core import schedule as schedule_lib
from hybrid.core.config import (
    BATCH_NORM_MIN_EXAMPLES,
    REMAT_MODES,
    ConfigError,
    RunConfig,
    check_global_batch,
    validate_run,
)
from hybrid.planning.cost_model import Prediction, evaluate
from hybrid.planning.costs import CostProfile, profile_model
from hybrid.planning.hardware import Hardware
from hybrid.planning.report import Plan, Rejection, format_bytes

__all__ = [
    "BATCH_NORM_MIN_EXAMPLES",
    "candidates",
    "choose_mesh",
    "host_hardware",
    "plan",
    "slots_of",
]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _counts(per_replica: int, micro_batches: Sequence[int] | None, cap: int) -> list[int]:
    """The micro-batch counts to try with ``per_replica`` examples on each replica: the
    given ones, else the divisors up to ``cap`` (1 when there are none)."""
    if micro_batches is not None:
        return list(micro_batches)
    return [m for m in _divisors(per_replica) if m <= cap] or [1]


def candidates(
    devices: int,
    global_batch: int,
    num_layers: int,
    schedules: Sequence[str],
    remats: Sequence[str],
    micro_batches: Sequence[int] | None,
    max_micro_batches: int,
    max_virtual_stages: int,
    stages: Sequence[int] | None,
    deferrals: Sequence[bool] = (False, True),
    balances: Sequence[str | None] = (None,),
    shardings: Sequence[bool] = (False,),
) -> Iterator[RunConfig]:
    """Every configuration :func:`plan` judges, with the global batch and layer count: each
    S × R = devices (S in ``stages`` when given), each M in ``micro_batches`` (default: the
    divisors of the per-replica batch up to ``max_micro_batches``, or 1), each schedule
    (interleaved with 2 … ``max_virtual_stages`` virtual stages, only where S > 1) and
    remat mode, with ``remat="never"`` and M > 1 each of ``deferrals`` (deferred weight
    gradients or not), each cut of ``balances`` (None: by time; "memory"), and with R > 1
    each of ``shardings`` (optimizer states sharded across the replicas, ZeRO-1, or not)."""
    for S in stages if stages is not None else _divisors(devices):
        R = devices // S
        per_replica = global_batch // R if global_batch % R == 0 else 0
        ms = _counts(per_replica, micro_batches, max_micro_batches)
        for name in schedules:
            if name == "interleaved" and S == 1:  # virtual stages on one device: no pipeline
                continue
            virtuals = range(2, max_virtual_stages + 1) if name == "interleaved" else [1]
            for v in virtuals:
                for M in ms:
                    for remat in remats:
                        defers = deferrals if remat == "never" and M > 1 else [False]
                        for balance, defer, shard in itertools.product(
                            balances, defers, shardings if R > 1 else [False]
                        ):
                            yield RunConfig(
                                *(S, R, M, name, remat, v, balance, global_batch, num_layers),
                                defer_weight_gradients=defer,
                                shard_optimizer_states=shard,
                            )


def plan(
    model: Sequence[Any] | CostProfile | Any,
    *,
    devices: int,
    global_batch: int,
    memory_per_device: float | None = None,
    hardware: Hardware | None = None,
    input_shape: Sequence[int] | None = None,
    input_dtype: str = "float32",
    x: Any = None,
    loss: Any = None,
    target_shape: Sequence[int] | None = None,
    optimizer: Callable[[], Any] | None = None,
    optimizer_slots: int | None = None,
    schedules: Sequence[str] | None = None,
    remats: Sequence[str] | None = None,
    micro_batches: Sequence[int] | None = None,
    max_micro_batches: int = 32,
    max_virtual_stages: int = 2,
    stages: Sequence[int] | None = None,
    device: str | None = None,
    deferrals: Sequence[bool] = (False, True),
    balances: Sequence[str | None] | None = None,
    shardings: Sequence[bool] | None = None,
    verbose: int = 1,
) -> Plan:
    """Ranks every way to train ``model`` on ``devices`` devices by predicted step time.

    Candidates: see :func:`candidates`. Each runs through :func:`evaluate`; a candidate
    :func:`hybrid.core.config.validate_run` refuses, or one that needs more than
    ``memory_per_device``, is rejected with the reason. The rest are ranked by predicted
    step time, except that with BatchNormalization in the model (``CostProfile.batch_norm``)
    every candidate whose BN normalizes over at least :data:`BATCH_NORM_MIN_EXAMPLES`
    examples ranks before those that normalize over fewer. On a 1-stage mesh the schedules
    coincide: a candidate there whose prediction equals one already ranked but for the
    schedule is left out of the ranking and counted in ``Plan.merged``.

    Args:
      model: any model ``hybrid.Pipeline`` takes (a functional model or ``Sequential``,
        with skips, merges, several inputs, nested functional models such as a KerasHub
        task model's backbone, tied layers) or a list of Keras layers, profiled on one
        device first, one row per layer call the Pipeline cuts (:func:`profile_model`; a
        profile this host measured of the same model and arguments is read back,
        :mod:`hybrid.planning.profile_cache`); or a :class:`CostProfile`.
      devices: N, the device budget.
      global_batch: examples per step.
      memory_per_device: bytes per device (overrides ``hardware.memory_per_device``).
      hardware: links and overheads (default: free links, no memory limit, and, when
        ``model`` is profiled here, this host's measured cost per step and per action,
        :mod:`hybrid.planning.host_calibration`; for a ``CostProfile``, no overheads).
      input_shape, input_dtype, x, loss, target_shape, optimizer, device: for profiling
        (see :func:`profile_model`): the input from ``x`` (a sample batch in the structure
        the model takes, e.g. a dict of arrays), else ``input_shape`` and ``input_dtype``
        (one input), else the model's ``keras.Input``; ``loss`` and ``optimizer`` as you
        will compile with.
      optimizer_slots: optimizer state per weight, in weights of its size (Adam 2, SGD 0);
        default: counted on ``optimizer`` when given (:func:`slots_of`), else 2 (Adam).
      schedules: schedule names (default: all of ``hybrid.core.schedule.names()``).
      remats: remat modes (default: all of :data:`REMAT_MODES`).
      deferrals: with ``remat="never"``, whether weight gradients are deferred
        (``Pipeline(defer_weight_gradients=...)``; default: both are judged).
      balances: the cuts to judge: None (balance time) and/or "memory" (the smallest
        largest stage peak); default: both when a memory budget is given, else by time.
      shardings: with R > 1, whether optimizer states are sharded across the replicas
        (``Pipeline(shard_optimizer_states=...)``); default: both when a memory budget is
        given, else not.
      verbose: 1 (the default) shows ``keras.utils.Progbar`` bars over the profiled layers
        and over the candidates; 0 is silent. ``Plan.seconds`` holds the time either way.

    Raises:
      ValueError: devices or global_batch below 1, an unknown schedule or remat mode, a
        micro-batch count below 1, stages that do not divide devices, layers without an
        input shape, or a model the planner cannot profile (a subclassed model, several
        outputs, an input dimension left open without ``input_shape`` or ``x``), named
        with what to do instead.
    """
    schedules, remats = _checked_arguments(
        devices, global_batch, schedules, remats, micro_batches, stages
    )
    began = time.perf_counter()
    slots = slots_of(optimizer) if optimizer_slots is None else optimizer_slots
    if isinstance(model, CostProfile):
        profile = model
        hardware = hardware or Hardware()
    else:
        from hybrid.planning.model_calls import model_calls

        calls = model_calls(model, input_shape, input_dtype, x)
        keep = sizes_kept(len(calls.calls))
        sizes = _profile_batches(
            devices, global_batch, micro_batches, max_micro_batches, stages, keep
        )
        profile = profile_model(
            calls, None, input_dtype, sizes, loss=loss, target_shape=target_shape,
            optimizer=optimizer, device=device, verbose=verbose,
        )  # fmt: skip
        hardware = hardware or host_hardware(devices, verbose)
    if memory_per_device is not None:
        hardware = dataclasses.replace(hardware, memory_per_device=memory_per_device)
    configs = list(
        candidates(
            devices,
            global_batch,
            profile.num_layers,
            schedules,
            remats,
            micro_batches,
            max_micro_batches,
            max_virtual_stages,
            stages,
            deferrals,
            balances if balances is not None else _balances(hardware),
            shardings if shardings is not None else _shardings(hardware),
        )
    )
    ranked, rejected, seen, merged = [], [], set(), 0
    judged: set[RunConfig] = set()  # a memory cut equal to the time cut is judged once
    bar = _progress_bar(len(configs), verbose)
    for config in configs:
        outcome = _judge(profile, config, global_batch, hardware, slots)
        if bar is not None:
            bar.add(1)
        if _judged_before(outcome, config, judged):
            continue
        if isinstance(outcome, Rejection):
            rejected.append(outcome)
        elif outcome.config.stages == 1 and _same_but_schedule(outcome) in seen:
            merged += 1
        else:
            seen.add(_same_but_schedule(outcome))
            ranked.append(outcome)
    ranked.sort(key=lambda p: (_small_norm(profile, p), *_rank_key(p)))
    seconds = time.perf_counter() - began
    return Plan(devices, global_batch, hardware, tuple(ranked), tuple(rejected), merged, seconds)


def _judged_before(
    outcome: Prediction | Rejection, config: RunConfig, judged: set[RunConfig]
) -> bool:
    """Whether a memory cut's ``outcome`` repeats one judged already: its cut equals the
    time cut's, or it was refused whatever the cut (a rule of the run, not memory). Adds
    ``outcome``'s configuration (with the cut) to ``judged``."""
    refused = isinstance(outcome, Rejection) and outcome.prediction is None
    if config.balance == "memory" and (refused or outcome.config in judged):
        return True
    judged.add(outcome.config)
    return False


def _balances(hardware: Hardware) -> tuple[str | None, ...]:
    """The cuts to judge by default: by time, and with a memory budget also by memory."""
    return (None,) if hardware.memory_per_device is None else (None, "memory")


def _shardings(hardware: Hardware) -> tuple[bool, ...]:
    """Whether to judge sharded optimizer states by default: with a memory budget."""
    return (False,) if hardware.memory_per_device is None else (False, True)


def _progress_bar(candidates: int, verbose: int) -> Any:
    """A Keras progress bar over the candidates (None when silent)."""
    if not verbose:
        return None
    import keras

    print(f"judging {candidates} candidates")
    return keras.utils.Progbar(candidates, unit_name="candidate")


def _same_but_schedule(p: Prediction) -> tuple[Any, ...]:
    """What makes two predictions the same row of the table, the schedule's name aside."""
    c = p.config
    return (
        c.stages,
        c.replicas,
        c.micro_batches,
        c.remat,
        c.virtual_stages,
        c.defer_weight_gradients,
        c.balance,
        p.step_time,
        p.bubble,
        p.memory_per_device,
    )


def _checked_arguments(
    devices: int,
    global_batch: int,
    schedules: Sequence[str] | None,
    remats: Sequence[str] | None,
    micro_batches: Sequence[int] | None,
    stages: Sequence[int] | None,
) -> tuple[list[str], list[str]]:
    """The schedules and remat modes to search (default: all), after checking the
    arguments; names and micro-batch counts by :func:`validate_run`'s rules, so every
    candidate it rejects later is infeasible, never malformed."""
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    check_global_batch(RunConfig(1), global_batch)
    schedules = list(schedules) if schedules is not None else schedule_lib.names()
    remats = list(remats) if remats is not None else list(REMAT_MODES)
    for name in schedules:
        validate_run(RunConfig(1, schedule=name))
    for mode in remats:
        validate_run(RunConfig(1, remat=mode))
    for M in micro_batches or []:
        validate_run(RunConfig(1, micro_batches=M))
    for S in stages or []:
        if S < 1 or devices % S:
            raise ValueError(f"stages={S} does not divide devices={devices}")
    return schedules, remats


def _judge(
    profile: CostProfile,
    config: RunConfig,
    global_batch: int,
    hardware: Hardware,
    optimizer_slots: int,
) -> Prediction | Rejection:
    """The candidate's prediction when it can run and fits in memory; else why not."""
    try:
        prediction = evaluate(profile, config, global_batch, hardware, optimizer_slots)
    except ConfigError as err:
        return Rejection(config, err.kind, str(err))
    unsharded = _too_few_to_shard(profile, prediction.config)
    if unsharded:
        return Rejection(prediction.config, "too few variables to shard", unsharded)
    limit = hardware.usable_memory
    if limit is not None and prediction.peak_memory > limit:
        needs, has = format_bytes(prediction.peak_memory), format_bytes(limit)
        reason = f"out of memory: needs {needs} per device, has {has}{_kept(hardware)}"
        return Rejection(prediction.config, "out of memory", reason, prediction)
    return prediction


def _kept(hardware: Hardware) -> str:
    """What the usable bytes leave out of each device's, as a clause ("" for none)."""
    if not hardware.allocator_headroom or hardware.memory_per_device is None:
        return ""
    whole = format_bytes(hardware.memory_per_device)
    return f" (of {whole}, {hardware.allocator_headroom:.0%} left to the allocator)"


def _too_few_to_shard(profile: CostProfile, config: RunConfig) -> str:
    """Why the Pipeline would refuse ``config``'s sharded optimizer states ("" if it would
    not): a model stage with fewer weight arrays than replicas (whole arrays are shared
    out; a layer whose profile counts no arrays but has weights counts as one)."""
    if not config.shard_optimizer_states:
        return ""
    assert isinstance(config.balance, tuple)
    start = 0
    for k, count in enumerate(config.balance):
        layers = profile.layers[start : start + count]
        start += count
        arrays = sum(max(x.param_tensors, 1 if x.param_bytes else 0) for x in layers)
        if arrays < config.replicas:
            return (
                f"shard_optimizer_states=True: model stage {k} has {arrays} weight array(s) "
                f"for {config.replicas} replicas; each replica needs one at least"
            )
    return ""


def _small_norm(profile: CostProfile, p: Prediction) -> bool:
    """Whether the model's BatchNormalization normalizes over fewer than
    :data:`BATCH_NORM_MIN_EXAMPLES` examples in ``p`` (such candidates rank after the rest)."""
    c = p.config
    examples = profile.batch_norm_examples(p.global_batch, c.replicas, c.micro_batches)
    return bool(profile.batch_norm) and examples < BATCH_NORM_MIN_EXAMPLES


def _rank_key(p: Prediction) -> tuple[float, float, int, int, str, str]:
    """Fastest first; then less memory, fewer stages, fewer micro-batches, by name."""
    c = p.config
    return (p.step_time, p.peak_memory, c.stages, c.micro_batches, c.schedule, c.remat)


def _profile_batches(
    devices: int,
    global_batch: int,
    micro_batches: Sequence[int] | None,
    cap: int,
    stages: Sequence[int] | None = None,
    keep: int | None = None,
) -> list[int]:
    """The micro-batch sizes to profile: every size a candidate runs, so each figure is a
    measured cost curve over the micro-batch size (a small micro-batch is slower per
    example: GEMMs too small to fill the device, weights streamed once per micro-batch),
    not a line through two points. More than ``keep`` (default :data:`PROFILED_SIZES`)
    sizes are thinned to that many, evenly on a log scale, the smallest and largest always
    kept."""
    sizes = set()
    for S in stages if stages is not None else _divisors(devices):
        R = devices // S
        if global_batch % R:
            continue
        per = global_batch // R
        sizes.add(per)  # (deferred weight gradients run at all micro-batches' rows)
        for M in _counts(per, micro_batches, cap):
            if per % M == 0:
                sizes.add(per // M)
    if not sizes:
        return [max(1, global_batch // devices)]
    return _thinned(sorted(sizes), keep or PROFILED_SIZES)


# At most this many micro-batch sizes are profiled (each costs one timing of every layer);
# of a model measured in runs of calls (more calls than profile.MAX_RUNS: every size
# compiles the whole model's programs, ~1.5 min for MobileNetV3Small on 2 cores), fewer.
PROFILED_SIZES = 4
PROFILED_SIZES_MANY_CALLS = 3


def sizes_kept(calls: int) -> int:
    """How many micro-batch sizes a model of ``calls`` layer calls is profiled at."""
    from hybrid.planning.profile import MAX_RUNS

    return PROFILED_SIZES if calls <= MAX_RUNS else PROFILED_SIZES_MANY_CALLS


def _thinned(sizes: list[int], keep: int) -> list[int]:
    """``keep`` of the increasing ``sizes`` (all when there are no more), the nearest on a
    log scale to evenly spaced points from the first to the last."""
    if len(sizes) <= keep:
        return sizes
    lo, hi = math.log(sizes[0]), math.log(sizes[-1])
    chosen: list[int] = []
    for i in range(keep):
        target = lo + (hi - lo) * i / (keep - 1)
        best = min((s for s in sizes if s not in chosen), key=lambda s: abs(math.log(s) - target))
        chosen.append(best)
    return sorted(chosen)


def host_hardware(devices: int, verbose: int = 0) -> Hardware:
    """The hardware a plan of a model profiled here assumes: this host's measured cost per
    step and per action and its replicas' all-reduce
    (:func:`hybrid.planning.host_calibration.calibrated` on up to ``devices`` of its
    devices; cached per host), for simulated CPU devices the cores they share, no memory
    limit. What :func:`plan`, ``hybrid-train --mesh=auto`` and ``--dry_run`` predict
    with, so the three say the same."""
    from hybrid.core.mesh import local_devices
    from hybrid.planning import host_calibration

    here = list(local_devices())[: max(1, devices)]
    found = host_calibration.calibrated(here, verbose=verbose)
    return found.hardware(host_cores=host_calibration.shared_cores(here))


def slots_of(optimizer: Callable[[], Any] | None) -> int:
    """The state one weight gets from the optimizers ``optimizer`` makes, in weights of its
    size, counted as the Pipeline counts it
    (:func:`hybrid.engine.model.optimizers.slots_per_weight`); 2 (Adam's) without one."""
    if optimizer is None:
        return 2
    from hybrid.engine.model.optimizers import optimizer_copies, slots_per_weight

    return slots_per_weight(optimizer_copies(optimizer))


def choose_mesh(
    layers: Sequence[Any] | CostProfile,
    input_spec: tuple[Sequence[int] | None, str] | None,
    devices: int,
    global_batch: int,
    memory_per_device: float | None = None,
    schedule: str | None = None,
    remat: str | None = None,
    *,
    hardware: Hardware | None = None,
    x: Any = None,
    loss: Any = None,
    optimizer: Callable[[], Any] | None = None,
    optimizer_slots: int | None = None,
    micro_batches: int | None = None,
    stages: int | None = None,
    device: str | None = None,
    defer_weight_gradients: bool | None = None,
    shard_optimizer_states: bool | None = None,
    verbose: int = 1,
) -> Prediction:
    """The fastest configuration of ``devices`` devices that fits.

    Returns its :class:`Prediction`: ``.config`` is the RunConfig (balance filled in) to
    build the Pipeline with, ``.step_time`` and ``.peak_memory`` what the cost model
    predicts.

    :func:`plan` over every mesh (only S = ``stages`` × R when given), with ``schedule``,
    ``remat``, ``micro_batches``, ``defer_weight_gradients`` and ``shard_optimizer_states``
    fixed when given (None: the planner chooses). On a
    given mesh (``stages`` and ``devices`` = S × R) with ``schedule`` and ``remat`` fixed,
    it is the choice of M alone: the fastest on the profiled cost curve of the model.

    Args:
      layers: the model (a Keras model or its layers, profiled on ``device``) or a
        :class:`CostProfile`.
      input_spec: (input shape without the batch dimension, dtype), e.g. ((64,), "int32");
        may be None with a CostProfile, and the shape None for a Keras model (its own
        ``keras.Input``, or ``x``: a sample batch, see :func:`plan`).

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
        x=x,
        loss=loss,
        optimizer=optimizer,
        optimizer_slots=optimizer_slots,
        schedules=[schedule] if schedule else None,
        remats=[remat] if remat else None,
        micro_batches=[micro_batches] if micro_batches else None,
        stages=[stages] if stages else None,
        device=device,
        deferrals=(False, True) if defer_weight_gradients is None else [defer_weight_gradients],
        shardings=None if shard_optimizer_states is None else [shard_optimizer_states],
        verbose=verbose,
    )
    best = result.best
    assert isinstance(best.config.balance, tuple)  # evaluate() always fills in the counts
    return best
