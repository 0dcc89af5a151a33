"""The training launcher's flags and the checks across them, run before any work.

Every rule about a run (mesh, micro-batches, schedule, balance, batch) is the library's own
(``hybrid.core.config.validate_run``); this module only says which flags to change.
"""

from __future__ import annotations

import os
from typing import Any

from absl import flags

from hybrid.data_sources import is_function_spec
from hybrid.launch import cloud_tpu

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defines the launcher's flags and their cross-flag validators."""
    _define_mesh_flags()
    _define_model_flags()
    _define_run_flags()
    _define_cluster_flags()
    cloud_tpu.define_flags()
    _register_validators()


def _define_mesh_flags() -> None:
    from hybrid.core import schedule  # no TensorFlow: safe before the device count is set
    from hybrid.core.config import REMAT_MODES

    flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu", "tpu"], "Device type of the mesh.")
    flags.DEFINE_string(
        "mesh",
        "stage:2;replica:2",
        "Mesh spec 'stage:S;replica:R', or 'auto': the planner profiles the model and picks the "
        "fastest mesh, micro-batches, schedule and remat that fit (--simulated_devices or the "
        "local GPUs give the device count; flags given explicitly stay fixed).",
    )
    flags.DEFINE_float(
        "memory_per_device_gib",
        None,
        "--mesh=auto: memory per device the plan must fit in (default: unlimited).",
        lower_bound=0.0,
    )
    flags.DEFINE_integer("micro_batches", 4, "Micro-batches per replica per step.", lower_bound=1)
    flags.DEFINE_enum("schedule", "gpipe", schedule.names(), "Pipeline schedule.")
    flags.DEFINE_integer(
        "virtual_stages", 1, "Model stages per device (--schedule=interleaved).", lower_bound=1
    )
    flags.DEFINE_enum("remat", "except_last", list(REMAT_MODES), "Recompute mode.")
    flags.DEFINE_string(
        "balance", "params", "Layers per stage: 'params', 'time' (profiled) or counts '3,2'."
    )


def _define_model_flags() -> None:
    from hybrid.models import catalog

    flags.DEFINE_string(
        "model",
        "transformer",
        f"A reference model ({', '.join(catalog.MODEL_NAMES)}) or yours: 'package.module:fn', "
        "fn() returning a Keras model, or a dict {'model': ..., 'loss': ..., 'metrics': ...}.",
    )
    flags.register_validator(
        "model",
        lambda value: value in catalog.MODEL_NAMES or is_function_spec(value),
        message=f"value should be one of {list(catalog.MODEL_NAMES)} or 'package.module:function'",
    )
    flags.DEFINE_string(
        "data",
        "text:python-docs",
        "'synthetic', 'text:PATH' (byte-level LM on a text file), 'text:python-docs' (the "
        "Python manual shipped with CPython) or 'package.module:fn', fn(global_batch_size) "
        "returning a tf.data.Dataset of (x, y) global batches.",
    )
    flags.DEFINE_string(
        "optimizer",
        "adam",
        "Any Keras optimizer by name (adam, adamw, sgd, lion, ...), at --learning_rate.",
    )
    flags.DEFINE_string(
        "optimizer_config",
        "{}",
        "The optimizer's other arguments as JSON, e.g. '{\"weight_decay\": 0.01}'.",
    )
    flags.DEFINE_enum(
        "precision",
        "float32",
        ["float32", "mixed_bfloat16", "mixed_float16"],
        "Keras dtype policy of the model (mixed_float16 adds a LossScaleOptimizer).",
    )
    flags.DEFINE_integer("width", 64, "d_model / channels / units of the model.", lower_bound=1)
    flags.DEFINE_integer("depth", 2, "Blocks of the model.", lower_bound=1)
    flags.DEFINE_integer("seq_len", 64, "Transformer context length (tokens).", lower_bound=2)
    flags.DEFINE_integer("num_heads", 4, "Transformer attention heads.", lower_bound=1)
    flags.DEFINE_float(
        "dropout", 0.0, "Transformer dropout rate.", lower_bound=0.0, upper_bound=0.9
    )
    flags.DEFINE_boolean(
        "tie_embeddings",
        False,
        "Transformer: the output head reads the token embedding matrix (one variable on the "
        "first and the last stage, its gradients summed across them).",
    )


def _define_run_flags() -> None:
    flags.DEFINE_integer("global_batch_size", 32, "Examples per step, all replicas.", lower_bound=1)
    flags.DEFINE_integer("train_steps", 60, "Train up to this step.", lower_bound=1)
    flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.", lower_bound=0.0)
    flags.DEFINE_integer("seed", 0, "Seed for weights, data order and random layers.")
    flags.DEFINE_bool("jit_compile", True, "XLA-compile the stage programs.")
    flags.DEFINE_integer("log_every", 10, "Log and write summaries every N steps.", lower_bound=1)
    flags.DEFINE_string("model_dir", None, "Checkpoints and TensorBoard events (resumes from it).")
    flags.DEFINE_integer(
        "checkpoint_every", 0, "Checkpoint every N steps (0: only at the end).", lower_bound=0
    )
    flags.DEFINE_integer("keep_checkpoints", 3, "Recent checkpoints kept.", lower_bound=1)
    flags.DEFINE_string(
        "profile_steps", None, "'FIRST,LAST': capture a TF profiler trace into --model_dir."
    )
    flags.DEFINE_integer(
        "simulated_devices", None, "CPU only: logical devices to simulate (default: mesh size)."
    )
    flags.DEFINE_bool("progress_bar", False, "Show Keras's progress bar instead of log lines.")
    flags.DEFINE_string(
        "export_dir",
        None,
        "At the end, write a SavedModel for serving here (serve, serving_default) and one per "
        "stage under EXPORT_DIR/stages (hybrid.serving).",
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
        "'TF_CONFIG' to read that variable; start each task with `python -m hybrid.launch.worker`.",
    )
    flags.DEFINE_float(
        "cluster_timeout", 60.0, "Multi-host: seconds to wait for every task.", lower_bound=1.0
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
        ],
        _check_run_config,
    )  # fmt: skip
    flags.register_multi_flags_validator(
        ["model", "data", "width", "num_heads"], _check_model_and_data
    )
    flags.register_multi_flags_validator(["keras_file", "tie_embeddings"], _check_keras_file)
    flags.register_multi_flags_validator(["optimizer", "optimizer_config"], _check_optimizer)
    flags.register_multi_flags_validator(["model", "mesh"], _check_user_model)
    flags.register_multi_flags_validator(
        ["model_dir", "checkpoint_every", "profile_steps", "train_steps"], _check_run
    )
    flags.register_multi_flags_validator(
        ["platform", "tpu", "tpu_zone", "gcp_project", "simulated_devices", "cluster", "mesh"],
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


def parse_balance(text: str) -> str | tuple[int, ...]:
    """``"params"``/``"time"`` or ``"3,2"`` -> the Pipeline's ``balance`` argument."""
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


def _check_run_config(values: dict[str, Any]) -> bool:
    """The run the flags describe, checked by the rule the library itself applies
    (``hybrid.core.config.validate_run``); its error is reported with the flags to change."""
    from hybrid.core.config import ConfigError, RunConfig, validate_run
    from hybrid.models import catalog

    mesh = _mesh_of(values)
    if mesh is None:
        return True
    stages, replicas = mesh
    config = RunConfig(
        stages=stages,
        replicas=replicas,
        micro_batches=values["micro_batches"],
        schedule=values["schedule"],
        remat=values["remat"],
        virtual_stages=values["virtual_stages"],
        balance=parse_balance(values["balance"]),
        global_batch=values["global_batch_size"],
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
    devices = values["simulated_devices"]
    if values["platform"] == "cpu" and devices is not None and devices < stages * replicas:
        raise flags.ValidationError(
            f"--mesh={values['mesh']} needs {stages * replicas} devices but "
            f"--simulated_devices={devices}; raise --simulated_devices or shrink --mesh"
        )
    return True


def _check_model_and_data(values: dict[str, Any]) -> bool:
    from hybrid.data_sources import check_source

    try:
        check_source(values["data"], values["model"])
    except ValueError as err:
        raise flags.ValidationError(
            f"--data={values['data']} --model={values['model']}: {err}"
        ) from None
    if values["model"] == "transformer" and values["width"] % values["num_heads"]:
        raise flags.ValidationError(
            f"--width={values['width']} must be divisible by --num_heads={values['num_heads']}"
        )
    return True


def _check_optimizer(values: dict[str, Any]) -> bool:
    import json

    import keras  # imports TensorFlow without starting its runtime: no optimizer is made

    names = {
        name.lower()
        for name, cls in vars(keras.optimizers).items()
        if isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)
    } - {"optimizer", "lossscaleoptimizer"}
    if values["optimizer"].lower() not in names:
        raise flags.ValidationError(
            f"--optimizer={values['optimizer']}: not a Keras optimizer; one of {sorted(names)}"
        )
    try:
        config = json.loads(values["optimizer_config"])
    except json.JSONDecodeError as err:
        raise flags.ValidationError(
            f"--optimizer_config={values['optimizer_config']} is not JSON: {err}"
        ) from None
    if not isinstance(config, dict) or "learning_rate" in config:
        raise flags.ValidationError(
            f"--optimizer_config={values['optimizer_config']} must be a JSON object of the "
            "optimizer's arguments (the learning rate is --learning_rate)"
        )
    return True


def _check_user_model(values: dict[str, Any]) -> bool:
    if is_function_spec(values["model"]) and values["mesh"] == "auto":
        raise flags.ValidationError(
            f"--mesh=auto --model={values['model']}: the planner profiles the reference "
            "models only; give --mesh='stage:S;replica:R' for your model"
        )
    return True


def _check_keras_file(values: dict[str, Any]) -> bool:
    if values["keras_file"] and values["tie_embeddings"]:
        raise flags.ValidationError(
            f"--keras_file={values['keras_file']} --tie_embeddings: the tied head holds the "
            "embedding layer itself, which a .keras file cannot describe; use --export_dir "
            "(SavedModels) for a tied model"
        )
    if values["keras_file"] and not values["keras_file"].endswith(".keras"):
        raise flags.ValidationError(f"--keras_file={values['keras_file']} must end in .keras")
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


def _check_cluster_spec(text: str) -> None:
    import json

    if text == "TF_CONFIG":
        if not os.environ.get("TF_CONFIG"):
            raise flags.ValidationError("--cluster=TF_CONFIG but the TF_CONFIG variable is unset")
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
