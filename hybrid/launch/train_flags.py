"""The training launcher's flags and the checks across them, run before any work.

Every rule about a run (mesh, micro-batches, schedule, balance, batch) is the library's own
(``hybrid.core.config.validate_run``); this module only says which flags to change.
"""

from __future__ import annotations

import os
from typing import Any

from absl import flags

from hybrid.launch import cloud_tpu, define_xla_cache_flag, model_flags
from hybrid.platforms import slurm
from hybrid.run.data_sources import is_function_spec

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines the launcher's flags and their cross-flag validators."""
    _define_mesh_flags()
    model_flags.define_flags()
    _define_run_flags()
    _define_cluster_flags()
    cloud_tpu.define_flags()
    _register_validators()
    model_flags.register_late_validators()


def _define_mesh_flags() -> None:
    from hybrid.core import schedule  # no TensorFlow: safe before the device count is set
    from hybrid.core.config import BOUNDARY_DTYPES, REMAT_MODES

    flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu", "tpu"], "Device type of the mesh.")
    flags.DEFINE_string(
        "mesh",
        "stage:2;replica:2",
        "Mesh spec 'stage:S,replica:R' (';' also separates, but must be quoted in a shell), or "
        "'auto': the planner profiles the model and picks the "
        "fastest mesh, micro-batches, schedule and remat that fit (--simulated_devices or the "
        "local GPUs give the device count; flags given explicitly stay fixed).",
    )
    flags.DEFINE_string(
        "memory_per_device",
        None,
        "The memory each device has, e.g. '16GiB' or '512MiB' (default: unlimited). With "
        "--mesh=auto the plan keeps the fastest configuration (mesh, M, schedule, remat, cut) "
        "that fits. On --platform=cpu the limit is made real: each simulated device is its own "
        "local worker process with its CPU allocator capped at it (whole MiB), and a stage "
        "beyond it fails with a one-line out-of-memory error.",
    )
    flags.DEFINE_string(
        "micro_batches",
        "4",
        "Micro-batches per replica per step, or 'auto': the first step times the gradient step "
        "at every M the schedule accepts and keeps the fastest (not with --platform=tpu).",
    )
    flags.DEFINE_enum("schedule", "gpipe", schedule.names(), "Pipeline schedule.")
    flags.DEFINE_integer(
        "virtual_stages", 1, "Model stages per device (--schedule=interleaved).", lower_bound=1
    )
    flags.DEFINE_enum("remat", "except_last", list(REMAT_MODES), "Recompute mode.")
    flags.DEFINE_bool(
        "defer_weight_gradients",
        False,
        "Each stage computes its weight gradients once per step over all its micro-batches "
        "(exact; needs --remat=never; keeps every micro-batch's activations to the end).",
    )
    flags.DEFINE_bool(
        "shard_optimizer_states",
        False,
        "Each of a stage's replicas holds the optimizer state of, and updates, its share of "
        "the stage's variables (ZeRO-1: optimizer state / R per device; exact).",
    )
    flags.DEFINE_enum(
        "boundary_dtype",
        "float32",
        list(BOUNDARY_DTYPES),
        "What crosses a stage boundary in training: bfloat16 or int8 compress the "
        "activations and their gradients (inexact; for slow links between stages).",
    )
    flags.DEFINE_string(
        "balance",
        "compute",
        "Layers per stage: 'compute' (the estimated work of each layer, from shapes), "
        "'params', 'time' (profiled), 'memory' (the smallest largest stage peak memory) or "
        "counts '3,2'.",
    )


def _define_run_flags() -> None:
    flags.DEFINE_integer("global_batch_size", 32, "Examples per step, all replicas.", lower_bound=1)
    flags.DEFINE_integer("train_steps", 60, "Train up to this step.", lower_bound=1)
    flags.DEFINE_float(
        "learning_rate",
        3e-3,
        "The optimizer's learning rate (a resumed run applies it in place of the checkpoint's).",
        lower_bound=0.0,
    )
    flags.DEFINE_integer("seed", 0, "Seed for weights, data order and random layers.")
    flags.DEFINE_bool("jit_compile", True, "XLA-compile the stage programs.")
    flags.DEFINE_integer(
        "prefetch",
        2,
        "Executions (--steps_per_execution batches each) prepared (padded, split per "
        "replica) and copied onto the mesh's devices ahead of the step by a feeding "
        "thread; 0: each batch at its step.",
        lower_bound=0,
    )
    flags.DEFINE_integer("log_every", 10, "Log and write summaries every N steps.", lower_bound=1)
    flags.DEFINE_integer(
        "steps_per_execution",
        1,
        "Training steps per call of the traced step (Keras's compile(steps_per_execution=)): "
        "the host's fixed cost per step paid once per N; logs, checkpoints and the progress "
        "bar come every N steps (--log_every, --checkpoint_every and --timeline_every: "
        "multiples of N).",
        lower_bound=1,
    )
    flags.DEFINE_string("model_dir", None, "Checkpoints and TensorBoard events (resumes from it).")
    flags.DEFINE_integer(
        "checkpoint_every", 0, "Checkpoint every N steps (0: only at the end).", lower_bound=0
    )
    flags.DEFINE_integer("keep_checkpoints", 3, "Recent checkpoints kept.", lower_bound=1)
    flags.DEFINE_bool(
        "fresh_start",
        False,
        "Start from step 1 in --model_dir: its checkpoints and run record are moved into "
        "--model_dir/aside-<time> (never deleted) instead of being resumed.",
    )
    flags.DEFINE_bool(
        "take_over_lock",
        False,
        "Take --model_dir's lock even though it names a run on another host (that run is "
        "gone); a lock of this host whose process is gone is taken over anyway.",
    )
    flags.DEFINE_string(
        "profile_steps", None, "'FIRST,LAST': capture a TF profiler trace into --model_dir."
    )
    define_xla_cache_flag()
    flags.DEFINE_integer(
        "simulated_devices",
        None,
        "CPU only: logical devices to simulate (default: mesh size).",
        lower_bound=1,
    )
    flags.DEFINE_bool(
        "progress_bar",
        False,
        "Show Keras's progress bar (after the first, compiling, step) instead of log lines.",
    )
    flags.DEFINE_bool(
        "dry_run",
        False,
        "Print the plan for these flags (the stages table, and for a reference model the "
        "predicted step time and memory per device) and exit without training or writing.",
    )
    flags.DEFINE_integer(
        "timeline_every",
        0,
        "Time every N-th step (0: never): per device compute, transfers, all-reduce and idle "
        "to the log and TensorBoard (timeline/), a Gantt PNG in --model_dir/timeline, and a "
        "warning when communication passes 30% of the step.",
        lower_bound=0,
    )
    flags.DEFINE_string(
        "export_dir",
        None,
        "At the end, write a SavedModel for serving here (serve, serving_default) and one per "
        "stage under EXPORT_DIR/stages (hybrid.run.serving).",
    )
    flags.DEFINE_string(
        "keras_file",
        None,
        "At the end, save the trained model as a .keras file (a finished run in --model_dir "
        "just converts its last checkpoint).",
    )


def _define_cluster_flags() -> None:
    flags.DEFINE_string("tpu", None, "--platform=tpu: Cloud TPU node name (or grpc:// address).")
    flags.DEFINE_string("tpu_zone", None, "--platform=tpu: the node's zone.")
    flags.DEFINE_string("gcp_project", None, "--platform=tpu: the node's GCP project.")
    flags.DEFINE_string(
        "cluster",
        None,
        'Multi-host: the cluster spec as JSON (\'{"worker": ["host0:2222", ...]}\') or '
        "'TF_CONFIG' to read that variable, or 'SLURM' ('SLURM:PORT') for one task per SLURM "
        "task of this job; start each task with `python -m hybrid.launch.worker`.",
    )
    flags.DEFINE_float(
        "cluster_timeout", 60.0, "Multi-host: seconds to wait for every task.", lower_bound=1.0
    )
    flags.DEFINE_string(
        "step_deadline",
        "auto",
        "Multi-host: seconds a step may take after the previous one; past it every task is "
        "probed and the client exits 4 naming the silent tasks and their devices. 'auto': 10x "
        "the longest step so far, at least 60 s (armed by the first step, which compiles).",
    )
    flags.DEFINE_integer(
        "max_restarts",
        0,
        "Multi-host: after a lost worker (exit 3) or a hung step (exit 4), start a new client "
        "up to N times; each waits --cluster_timeout for the workers and resumes from the "
        "newest checkpoint in --model_dir.",
        lower_bound=0,
    )
    flags.DEFINE_enum(
        "mesh_order",
        "replica_groups_in_host",
        ["replica_groups_in_host", "pipelines_in_host"],
        "Multi-host: keep each stage's replica group inside a host (all-reduce on local links, "
        "activations cross hosts) or each replica's pipeline.",
    )


def _register_validators() -> None:
    flags.register_multi_flags_validator(
        [
            "mesh", "micro_batches", "global_batch_size", "schedule", "remat", "virtual_stages",
            "balance", "model", "depth", "simulated_devices", "platform",
            "defer_weight_gradients", "shard_optimizer_states",
        ],
        _check_run_config,
    )  # fmt: skip
    flags.register_validator("memory_per_device", lambda text: parse_memory(text) or True)
    flags.register_multi_flags_validator(
        [
            "model_dir", "checkpoint_every", "profile_steps", "train_steps", "fresh_start",
            "take_over_lock",
        ],
        _check_run,
    )  # fmt: skip
    flags.register_multi_flags_validator(
        ["model_dir", "export_dir", "keras_file"], _check_output_paths
    )
    flags.register_multi_flags_validator(["timeline_every", "model_dir"], _check_extras)
    flags.register_multi_flags_validator(
        ["steps_per_execution", "log_every", "checkpoint_every", "timeline_every"],
        _check_executions,
    )
    flags.register_multi_flags_validator(
        ["step_deadline", "max_restarts", "cluster", "model_dir", "memory_per_device"],
        _check_restarts,
    )
    flags.register_multi_flags_validator(
        [
            "platform",
            "tpu",
            "tpu_zone",
            "gcp_project",
            "simulated_devices",
            "cluster",
            "mesh",
            "micro_batches",
        ],
        _check_platform,
    )


# RunConfig field -> the flags that set it, to name them when hybrid.core.config refuses.
_FLAGS_OF_FIELD = {
    "stages": ("mesh",),
    "replicas": ("mesh",),
    "micro_batches": ("micro_batches",),
    "schedule": ("schedule",),
    "remat": ("remat",),
    "virtual_stages": ("virtual_stages",),
    "balance": ("balance",),
    "global_batch": ("global_batch_size",),
    "num_layers": ("model", "depth"),
    "defer_weight_gradients": ("defer_weight_gradients",),
    "shard_optimizer_states": ("shard_optimizer_states",),
}


def _mesh_of(values: dict[str, Any]) -> tuple[int, int] | None:
    """The mesh flag's (S, R); None for --mesh=auto (the planner checks its own choice)."""
    from hybrid.core.mesh import parse_spec

    if values["mesh"] == "auto":
        return None
    try:
        return parse_spec(values["mesh"])
    except ValueError as err:
        raise flags.ValidationError(f"--mesh: {err}") from err


def parse_memory(text: str | None) -> float | None:
    """``--memory_per_device``: ``"16GiB"`` -> bytes (None: unlimited)."""
    from hybrid.core.memory import parse_bytes

    if text is None:
        return None
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise flags.ValidationError(f"--memory_per_device: {err}") from None


def parse_balance(text: str) -> str | tuple[int, ...]:
    """``"compute"``/``"params"``/``"time"``/``"memory"`` or ``"3,2"`` -> the Pipeline's
    ``balance``."""
    from hybrid.core.config import BALANCE_MODES

    if text in BALANCE_MODES:
        return text
    try:
        return tuple(int(c) for c in text.split(","))
    except ValueError:
        raise flags.ValidationError(
            f"--balance={text} must be one of {list(BALANCE_MODES)} or layer counts per stage "
            "like '3,2'"
        ) from None


def parse_micro_batches(text: str) -> int | str:
    """``"8"`` -> 8; ``"auto"`` stays (the Pipeline times every M at its first step)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise flags.ValidationError(
            f"--micro_batches={text} must be a positive integer, or 'auto' (the fastest, timed "
            "at the first step)"
        )
    return value


def _check_run_config(values: dict[str, Any]) -> bool:
    """The run the flags describe, checked by the rule the library itself applies
    (``hybrid.core.config.validate_run``); its error is reported with the flags to change."""
    from hybrid.core.config import ConfigError, RunConfig, least_micro_batches, validate_run
    from hybrid.models import catalog

    mesh = _mesh_of(values)
    if mesh is None:
        return True
    stages, replicas = mesh
    micro_batches = parse_micro_batches(values["micro_batches"])
    if micro_batches == "auto":  # checked as built until the first step chooses
        micro_batches = least_micro_batches(values["schedule"], stages)
    config = RunConfig(
        stages=stages,
        replicas=replicas,
        micro_batches=int(micro_batches),
        schedule=values["schedule"],
        remat=values["remat"],
        virtual_stages=values["virtual_stages"],
        balance=parse_balance(values["balance"]),
        global_batch=values["global_batch_size"],
        defer_weight_gradients=values["defer_weight_gradients"],
        shard_optimizer_states=values["shard_optimizer_states"],
        num_layers=None
        if is_function_spec(values["model"])
        else catalog.num_layers(values["model"], values["depth"]),
    )
    try:
        validate_run(config)
    except ConfigError as err:
        named = dict.fromkeys(f for a in err.arguments for f in _FLAGS_OF_FIELD.get(a, ()))
        given = " ".join(f"--{name}={values[name]}" for name in named)
        raise flags.ValidationError(f"{given}: {err}") from None
    if values["platform"] == "tpu" and values["shard_optimizer_states"]:
        raise flags.ValidationError(
            "--shard_optimizer_states: the TPU step's optimizer is one mirrored copy per "
            "replica, which cannot be split yet; leave --shard_optimizer_states off"
        )
    if values["platform"] == "tpu" and values["defer_weight_gradients"]:
        raise flags.ValidationError(
            "--defer_weight_gradients needs stage programs of their own, but --platform=tpu "
            "compiles the whole step as one program; leave --defer_weight_gradients off"
        )
    devices = values["simulated_devices"]
    if values["platform"] == "cpu" and devices is not None and devices < stages * replicas:
        raise flags.ValidationError(
            f"--mesh={values['mesh']} needs {stages * replicas} devices but "
            f"--simulated_devices={devices}; raise --simulated_devices or shrink --mesh"
        )
    return True


def parse_profile_steps(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        first, last = (int(v) for v in text.split(","))
    except ValueError:
        raise flags.ValidationError(
            f"--profile_steps={text} must be 'FIRST,LAST', e.g. '10,12'"
        ) from None
    return first, last


def _check_run(values: dict[str, Any]) -> bool:
    if values["checkpoint_every"] and not values["model_dir"]:
        raise flags.ValidationError(
            f"--checkpoint_every={values['checkpoint_every']} needs --model_dir to write to"
        )
    for name in ("fresh_start", "take_over_lock"):
        if values[name] and not values["model_dir"]:
            raise flags.ValidationError(f"--{name} applies to a --model_dir; none is given")
    steps = parse_profile_steps(values["profile_steps"])
    if steps is not None:
        first, last = steps
        if not 1 <= first <= last <= values["train_steps"]:
            raise flags.ValidationError(
                f"--profile_steps={values['profile_steps']} must satisfy 1 <= FIRST <= LAST <= "
                f"--train_steps ({values['train_steps']})"
            )
        if not values["model_dir"]:
            raise flags.ValidationError("--profile_steps needs --model_dir to write the trace to")
    return True


def _check_executions(values: dict[str, Any]) -> bool:
    """The periods of the launcher's work after a step fit ``--steps_per_execution``."""
    from hybrid.run.train_config import execution_conflict

    conflict = execution_conflict(
        values["steps_per_execution"],
        values["log_every"],
        values["checkpoint_every"],
        values["timeline_every"],
    )
    if conflict:
        raise flags.ValidationError(conflict)
    return True


def _check_output_paths(values: dict[str, Any]) -> bool:
    """Every output path writable, none under a regular file, no export overwritten
    (``hybrid.run.output_paths``, which ``train`` applies too)."""
    from hybrid.run.output_paths import check_output_paths

    try:
        check_output_paths(values["model_dir"], values["export_dir"], values["keras_file"])
    except ValueError as err:
        raise flags.ValidationError(str(err)) from None
    return True


def _check_extras(values: dict[str, Any]) -> bool:
    """The optional packages the outputs asked for are installed (before any work)."""
    from hybrid.run.output_paths import missing_extras

    missing = missing_extras(values["timeline_every"], values["model_dir"])
    if missing:
        raise flags.ValidationError(missing)
    return True


def _check_platform(values: dict[str, Any]) -> bool:
    platform = values["platform"]
    missing = [f"--{n}" for n in ("tpu", "tpu_zone", "gcp_project") if not values[n]]
    if platform == "tpu" and missing:
        raise flags.ValidationError(
            f"--platform=tpu needs {', '.join(missing)}: the Cloud TPU node's name, zone and "
            "project (the supervisor asks the Cloud TPU API about that node)"
        )
    if platform != "tpu":
        given = [f"--{n}" for n in ("tpu", "tpu_zone", "gcp_project") if values[n]]
        if given:
            raise flags.ValidationError(
                f"{', '.join(given)} only apply with --platform=tpu (got --platform={platform})"
            )
    if values["micro_batches"] == "auto" and platform == "tpu":
        raise flags.ValidationError(
            "--micro_batches=auto times a Pipeline's gradient step at each M; the TPU step "
            "runs under TPUStrategy: give --micro_batches=M with --platform=tpu"
        )
    if values["mesh"] == "auto":
        if platform == "tpu" or values["cluster"] is not None:
            raise flags.ValidationError(
                "--mesh=auto plans for the local devices; give --mesh explicitly with "
                "--platform=tpu or --cluster"
            )
        if platform == "cpu" and values["simulated_devices"] is None:
            raise flags.ValidationError(
                "--mesh=auto on --platform=cpu needs --simulated_devices=N (the device budget)"
            )
    if values["cluster"] is not None:
        if platform == "tpu":
            raise flags.ValidationError(
                "--cluster is for CPU/GPU tasks started with launch.worker; with --platform=tpu "
                "the TPU resolver finds the hosts"
            )
        if values["simulated_devices"] is not None:
            raise flags.ValidationError(
                "--simulated_devices does not apply with --cluster: each worker simulates its "
                "own devices (python -m hybrid.launch.worker --simulated_devices=N)"
            )
        _check_cluster_spec(values["cluster"])
    if platform != "cpu" and values["simulated_devices"] is not None:
        raise flags.ValidationError(
            f"--simulated_devices only applies with --platform=cpu (got --platform={platform})"
        )
    return True


def parse_deadline(text: str) -> float | None:
    """``--step_deadline``: seconds, or None for 'auto'.

    Raises:
      flags.ValidationError: neither 'auto' nor positive seconds.
    """
    if text == "auto":
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise flags.ValidationError(
            f"--step_deadline={text} must be positive seconds (e.g. 600) or 'auto'"
        )
    return seconds


def _check_restarts(values: dict[str, Any]) -> bool:
    deadline = parse_deadline(values["step_deadline"])
    on_cluster = values["cluster"] is not None or values["memory_per_device"] is not None
    if deadline is not None and not on_cluster:
        raise flags.ValidationError(
            f"--step_deadline={values['step_deadline']} watches a cluster job's workers; it "
            "applies with --cluster (or --memory_per_device's local workers)"
        )
    if values["max_restarts"] and values["cluster"] is None:
        raise flags.ValidationError(
            f"--max_restarts={values['max_restarts']} restarts a --cluster job's client after "
            "a lost or hung worker; give --cluster (a one-host run has no workers to lose)"
        )
    if values["max_restarts"] and not values["model_dir"]:
        raise flags.ValidationError(
            f"--max_restarts={values['max_restarts']} needs --model_dir: a restarted client "
            "resumes from the newest checkpoint there (with none it would start over)"
        )
    return True


def _check_cluster_spec(text: str) -> None:
    import json

    if text == "TF_CONFIG":
        if not os.environ.get("TF_CONFIG"):
            raise flags.ValidationError("--cluster=TF_CONFIG but the TF_CONFIG variable is unset")
        return
    if slurm.is_slurm(text):
        try:
            slurm.port_of(text)
            slurm.check_environment()
        except ValueError as err:
            raise flags.ValidationError(str(err)) from None
        return
    try:
        spec = json.loads(text)
    except ValueError as err:
        raise flags.ValidationError(
            f"--cluster={text} is not JSON ({err}); e.g. "
            '--cluster=\'{"worker": ["host0:2222", "host1:2222"]}\' or --cluster=TF_CONFIG'
        ) from None
    if not isinstance(spec, dict) or not spec.get("worker"):
        raise flags.ValidationError(
            f"--cluster={text} needs a 'worker' job listing the task addresses"
        )
