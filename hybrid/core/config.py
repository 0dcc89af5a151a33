"""A run configuration and the one function that decides whether it is valid.

``Pipeline``, the planner and the launcher all describe a run by the same values (the mesh
shape, micro-batches, schedule, virtual stages, balance, remat, and, when known, the global
batch and the model's layer count) and all ask :func:`validate_run` whether it can run. A
rule lives here and nowhere else, so the planner never proposes what ``Pipeline`` refuses,
and the launcher refuses exactly what ``Pipeline`` would.

Errors speak the library's language: argument names, their values and the fix. Each
:class:`ConfigError` also names the arguments involved, so a front end (the launcher) can
say which of its own options to change.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import Any

from hybrid.core import schedule as schedule_lib
from hybrid.core.mesh import DeviceMesh, parse_spec
from hybrid.core.partition import check_balance

__all__ = [
    "BATCH_NORM_MIN_EXAMPLES",
    "BOUNDARY_DTYPES",
    "BALANCE_MODES",
    "REMAT_MODES",
    "ArgumentTypeError",
    "ConfigError",
    "RunConfig",
    "as_mesh",
    "Layout",
    "check_switches",
    "layout_of",
    "pipeline_arguments",
    "check_global_batch",
    "least_micro_batches",
    "validate_run",
]

REMAT_MODES = ("never", "except_last", "always")
# What crosses a stage boundary in training (hybrid.engine.step.compression); float32: as it is.
BOUNDARY_DTYPES = ("float32", "bfloat16", "int8")
# How a cut is chosen when no counts are given; "compute" (the estimated work of each layer
# call, from shapes) is the engine's default.
BALANCE_MODES = ("compute", "params", "time", "memory")
# The fewest examples a training-mode BatchNormalization should normalize over: Keras
# Applications CNNs (ResNet50, DenseNet121, EfficientNetB0) diverged to non-finite outputs
# in two steps at 4 examples per micro-batch. The planner ranks candidates below it last;
# the engine's warning recommends it.
BATCH_NORM_MIN_EXAMPLES = 16

Balance = str | tuple[int, ...] | None


class ConfigError(ValueError):
    """A run configuration that cannot run.

    Attributes:
      kind: what is wrong, without the values (stable; the planner's rejection reasons).
      arguments: the RunConfig fields involved, for a front end to name its own options.
    """

    def __init__(self, kind: str, message: str, arguments: Sequence[str]) -> None:
        super().__init__(message)
        self.kind = kind
        self.arguments = tuple(arguments)


class ArgumentTypeError(ConfigError, TypeError):
    """An argument of the wrong type (a string where a bool goes, ...)."""


def as_mesh(mesh: object) -> DeviceMesh:
    """``mesh`` as a DeviceMesh: one as it is, or a spec string as the launcher's --mesh
    (``"stage:2;replica:4"``) laid on this process's first S × R devices.

    Raises:
      ArgumentTypeError: neither a DeviceMesh nor a string.
      ConfigError: a string that is not a mesh spec.
    """
    if isinstance(mesh, DeviceMesh):
        return mesh
    if isinstance(mesh, str):
        try:
            stages, replicas = parse_spec(mesh)
        except ValueError as err:
            raise ConfigError("bad mesh spec", f"mesh={mesh!r}: {err}", ["mesh"]) from None
        return DeviceMesh.create(stages, replicas)
    raise ArgumentTypeError(
        "mesh of the wrong type",
        f"mesh={mesh!r} ({type(mesh).__name__}): give a hybrid.DeviceMesh or a spec string "
        "such as 'stage:2;replica:4'",
        ["mesh"],
    )


def check_switches(**switches: object) -> None:
    """Raises :class:`ArgumentTypeError` for a switch (``jit_compile=...``) that is not a
    bool: a string such as "no" would otherwise be taken as true."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise ArgumentTypeError(
                "switch not a bool",
                f"{name}={value!r} ({type(value).__name__}): give True or False",
                [name],
            )


@dataclasses.dataclass(frozen=True)
class Layout:
    """The parallel layout a Pipeline takes as keywords, or whole as a :class:`RunConfig`;
    each field's default is the Pipeline's (fields as in RunConfig; ``micro_batches`` may
    also be "auto")."""

    micro_batches: int | str = 1
    schedule: str = "gpipe"
    remat: str = "except_last"
    balance: Any = None
    virtual_stages: int = 1
    defer_weight_gradients: bool = False
    shard_optimizer_states: bool = False


def layout_of(config: RunConfig | None, **given: Any) -> Layout:
    """The pipeline's :class:`Layout` from ``config`` or from the keywords ``given`` (None:
    not given, the default).

    Raises:
      ArgumentTypeError: ``config`` is not a RunConfig, or comes with layout keywords.
    """
    fields = [f.name for f in dataclasses.fields(Layout)]
    named = {k: v for k, v in given.items() if v is not None}
    if config is None:
        return Layout(**named)
    if not isinstance(config, RunConfig):
        raise ArgumentTypeError(
            "config of the wrong type",
            f"config={config!r} ({type(config).__name__}): give a hybrid.RunConfig (a "
            "planner's Prediction holds one as .config)",
            ["config"],
        )
    if named:
        raise ArgumentTypeError(
            "config and layout keywords together",
            f"config={config} comes with {sorted(named)}; give the layout once: either "
            f"the config alone, or dataclasses.replace(config, {next(iter(named))}=...)",
            ["config", *sorted(named)],
        )
    return Layout(**{k: getattr(config, k) for k in fields})


def pipeline_arguments(mesh: object, balance: object = None) -> DeviceMesh:
    """Checks the ``Pipeline`` arguments before a RunConfig holds them: ``balance`` None, a
    string or layer counts; returns ``mesh`` as a DeviceMesh (:func:`as_mesh`)."""
    counts = isinstance(balance, list | tuple) and all(
        isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in balance
    )
    if not (balance is None or isinstance(balance, str) or counts):
        raise ArgumentTypeError(
            "balance of the wrong type",
            f"balance={balance!r} ({type(balance).__name__}): give None, one of "
            f"{list(BALANCE_MODES)}, or layer counts per stage such as [3, 2]",
            ["balance"],
        )
    return as_mesh(mesh)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """How one training step runs on the mesh.

    Attributes:
      stages: S, devices along each pipeline.
      replicas: R, data-parallel copies of the pipeline.
      micro_batches: M, micro-batches each replica's shard of the batch is split into.
      schedule: a name in ``hybrid.core.schedule.names()``.
      remat: one of :data:`REMAT_MODES`.
      virtual_stages: model stages per device (the interleaved schedule), so the model is
        cut into ``stages × virtual_stages`` model stages.
      balance: layers per model stage: None (the engine's default, "compute"; the planner
        balances measured time), "compute" (balance the estimated work per layer call,
        from shapes), "params" (balance parameter counts), "time" (balance measured time),
        "memory" (make the largest stage's predicted peak memory as small as possible,
        :mod:`hybrid.core.memory`), or explicit counts.
      global_batch: examples per step over all replicas; None when not known yet (it is
        then checked per batch with :func:`check_global_batch`).
      num_layers: the layers the model is cut along; None when not known yet.
      defer_weight_gradients: compute each stage's weight gradients once per step over
        all its micro-batches (``hybrid.engine.programs.deferral``); needs ``remat="never"``.
      shard_optimizer_states: each of a stage's R replicas holds the optimizer state of,
        and updates, its share of the stage's variables, then sends them to the other
        replicas (ZeRO-1: optimizer state ÷ R per device; ``hybrid.engine.step.sharding``).
    """

    stages: int
    replicas: int = 1
    micro_batches: int = 1
    schedule: str = "gpipe"
    remat: str = "except_last"
    virtual_stages: int = 1
    balance: Balance = None
    global_batch: int | None = None
    num_layers: int | None = None
    defer_weight_gradients: bool = False
    shard_optimizer_states: bool = False

    @property
    def devices(self) -> int:
        return self.stages * self.replicas

    @property
    def model_stages(self) -> int:
        """How many pieces the model is cut into: S × virtual stages."""
        return self.stages * self.virtual_stages

    @property
    def mesh_spec(self) -> str:
        """The mesh as ``hybrid.core.mesh.parse_spec`` reads it: ``"stage:S;replica:R"``."""
        return f"stage:{self.stages};replica:{self.replicas}"

    def label(self) -> str:
        """Short form for tables: ``2x1 M=8 interleaved(v=2) except_last``."""
        sched = self.schedule + (f"(v={self.virtual_stages})" if self.virtual_stages > 1 else "")
        defer = " deferred-W" if self.defer_weight_gradients else ""
        defer += " sharded-optimizer" if self.shard_optimizer_states else ""
        return f"{self.stages}x{self.replicas} M={self.micro_batches} {sched} {self.remat}{defer}"


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(
            "not a positive integer", f"{name} must be a positive integer, got {value!r}", [name]
        )


def _check_names(config: RunConfig) -> None:
    names = schedule_lib.names()
    if config.schedule not in names:
        raise ConfigError(
            "unknown schedule",
            f"unknown schedule {config.schedule!r}; choose one of {names}",
            ["schedule"],
        )
    if config.remat not in REMAT_MODES:
        raise ConfigError(
            "unknown remat mode",
            f"unknown remat mode {config.remat!r}; choose one of {list(REMAT_MODES)}",
            ["remat"],
        )
    if isinstance(config.balance, str) and config.balance not in BALANCE_MODES:
        raise ConfigError(
            "unknown balance",
            f"unknown balance {config.balance!r}; use None, one of {list(BALANCE_MODES)}, or "
            "a list of layer counts per stage",
            ["balance"],
        )
    if config.defer_weight_gradients and config.remat != "never":
        raise ConfigError(
            "deferred weight gradients need remat='never'",
            f"defer_weight_gradients=True keeps every micro-batch's activations for one "
            f"weight-gradient pass at the end of the step, but remat={config.remat!r} drops "
            "them; use remat='never', or defer_weight_gradients=False",
            ["defer_weight_gradients", "remat"],
        )


def _check_schedule(config: RunConfig) -> None:
    S, M, v = config.stages, config.micro_batches, config.virtual_stages
    if v != 1 and config.schedule not in schedule_lib.VIRTUAL_SCHEDULES:
        raise ConfigError(
            "virtual stages need the interleaved schedule",
            f"schedule {config.schedule!r} runs one stage per device; virtual_stages={v} "
            f"needs one of {sorted(schedule_lib.VIRTUAL_SCHEDULES)}",
            ["virtual_stages", "schedule"],
        )
    problem = schedule_lib.interleaved_problem(S, M) if config.schedule == "interleaved" else None
    if problem:
        raise ConfigError(
            "interleaved needs M % S == 0", problem, ["micro_batches", "stages", "schedule"]
        )


def _check_model(config: RunConfig) -> None:
    if config.num_layers is None:
        return
    _positive("num_layers", config.num_layers)
    K, v, L = config.model_stages, config.virtual_stages, config.num_layers
    if K > L:
        per = f" ({config.stages} devices × {v} virtual stages)" if v > 1 else ""
        raise ConfigError(
            "more stages than layers",
            f"more stages than layers: the run has {K} model stages{per} but the model has "
            f"only {L} layers; use at most {L} stages",
            ["stages", "virtual_stages", "num_layers"],
        )
    if config.balance is not None and not isinstance(config.balance, str):
        try:
            check_balance(config.balance, L, K)
        except ValueError as err:
            raise ConfigError(
                "bad balance", str(err), ["balance", "stages", "virtual_stages", "num_layers"]
            ) from None


def least_micro_batches(schedule: str, stages: int) -> int:
    """The fewest micro-batches ``schedule`` runs on ``stages`` pipeline stages (1; S for
    the interleaved schedule, which needs M % S == 0): what a Pipeline with
    ``micro_batches="auto"`` is built with until its first batch chooses."""
    return stages if schedule == "interleaved" else 1


def check_global_batch(config: RunConfig, global_batch: int) -> None:
    """Raises :class:`ConfigError` unless ``global_batch`` splits into R × M equal parts."""
    _positive("global_batch", global_batch)
    R, M = config.replicas, config.micro_batches
    if global_batch % (R * M):
        raise ConfigError(
            "batch not divisible by R × M",
            f"global batch {global_batch} is not divisible by replicas ({R}) × micro_batches "
            f"({M}) = {R * M}; use a batch that is a multiple of {R * M}",
            ["global_batch", "replicas", "micro_batches"],
        )


def validate_run(config: RunConfig) -> RunConfig:
    """Checks every rule a run configuration must satisfy; returns it unchanged.

    The rules: S, R, M and virtual stages are positive integers, defer_weight_gradients a
    bool; the schedule and remat mode exist; deferred weight gradients only with
    ``remat="never"``; virtual stages only with a schedule that has them; interleaved needs M
    to be a multiple of S; with the layer count known, at most one model stage per layer and
    an explicit balance that gives every model stage at least one layer and sums to the
    layers; with the global batch known, a batch that splits into R × M equal parts.

    Raises:
      ConfigError: the first rule broken, naming the values and the fix.
    """
    for name in ("stages", "replicas", "micro_batches", "virtual_stages"):
        _positive(name, getattr(config, name))
    check_switches(
        defer_weight_gradients=config.defer_weight_gradients,
        shard_optimizer_states=config.shard_optimizer_states,
    )
    _check_names(config)
    _check_schedule(config)
    _check_model(config)
    if config.global_batch is not None:
        check_global_batch(config, config.global_batch)
    return config
