"""Trains a reference model with hybrid on a device mesh.

    python -m launch.train                                   # Transformer on text, 2×2 CPU mesh
    python -m launch.train --mesh="stage:4;replica:2" --schedule=1f1b --micro_batches=8 \\
        --model_dir=/tmp/run --checkpoint_every=50           # killed? the same command resumes
    python -m launch.train --platform=gpu --mesh="stage:2;replica:4" ...
    python -m launch.train --platform=tpu --tpu=my-node --tpu_zone=us-central2-b \\
        --gcp_project=my-project --model_dir=gs://bucket/run ...

Every flag combination is checked before any work; ``main`` freezes the flags into a
``TrainConfig`` and calls the flag-free ``hybrid.trainer.train``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from typing import Any  # noqa: E402

from absl import app, flags  # noqa: E402

from launch import cloud_tpu  # noqa: E402

FLAGS = flags.FLAGS

# Test hook: "STEP:DIR" makes the run stop after step STEP (its checkpoint, if any, written
# before), create DIR/paused-STEP, and wait until DIR/resume exists. Tests that kill a
# process or a worker do it while the run is paused, so what the run has written when the
# fault lands is decided by the step, not by the machine's speed.
PAUSE_ENV = "HYBRID_PAUSE_AFTER_STEP"


def define_flags() -> None:
    """Defines the launcher's flags and their cross-flag validators."""
    from hybrid.core import schedule  # no TensorFlow: safe before the device count is set
    from hybrid.models import catalog

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
    flags.DEFINE_enum("remat", "except_last", ["never", "except_last", "always"], "Recompute mode.")
    flags.DEFINE_string(
        "balance", "params", "Layers per stage: 'params', 'time' (profiled) or counts '3,2'."
    )
    flags.DEFINE_enum("model", "transformer", list(catalog.MODEL_NAMES), "Reference model.")
    flags.DEFINE_string(
        "data",
        "text:python-docs",
        "'synthetic', 'text:PATH' (byte-level LM on a text file) or 'text:python-docs' (the "
        "Python manual shipped with CPython).",
    )
    flags.DEFINE_integer("width", 64, "d_model / channels / units of the model.", lower_bound=1)
    flags.DEFINE_integer("depth", 2, "Blocks of the model.", lower_bound=1)
    flags.DEFINE_integer("seq_len", 64, "Transformer context length (tokens).", lower_bound=2)
    flags.DEFINE_integer("num_heads", 4, "Transformer attention heads.", lower_bound=1)
    flags.DEFINE_float(
        "dropout", 0.0, "Transformer dropout rate.", lower_bound=0.0, upper_bound=0.9
    )
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
    flags.DEFINE_string("tpu", None, "--platform=tpu: Cloud TPU node name (or grpc:// address).")
    flags.DEFINE_string("tpu_zone", None, "--platform=tpu: the node's zone.")
    flags.DEFINE_string("gcp_project", None, "--platform=tpu: the node's GCP project.")
    flags.DEFINE_string(
        "cluster",
        None,
        'Multi-host: the cluster spec as JSON (\'{"worker": ["host0:2222", ...]}\') or '
        "'TF_CONFIG' to read that variable; start each task with `python -m launch.worker`.",
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
    cloud_tpu.define_flags()

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
        num_layers=catalog.num_layers(values["model"], values["depth"]),
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
                "own devices (python -m launch.worker --simulated_devices=N)"
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


def _run_on_cluster(config: Any, step_callback: Any = None) -> Any:
    """Connects to the workers, lays the mesh over their devices and trains from the client.

    Raises SystemExit(3) with the task's name when a worker cannot be reached or is lost.
    """
    from hybrid.core.mesh import parse_spec
    from hybrid.platforms import cluster as cluster_lib
    from hybrid.trainer import train

    spec = None if FLAGS.cluster == "TF_CONFIG" else FLAGS.cluster
    stages, replicas = parse_spec(config.mesh)
    try:
        job = cluster_lib.connect(spec, timeout_s=FLAGS.cluster_timeout)
        mesh = cluster_lib.mesh(
            job, stages, replicas, order=FLAGS.mesh_order, device_type=config.platform.upper()
        )
        with job.guard():
            return train(
                config,
                devices=[d for row in mesh.devices for d in row],
                checkpoint_io_device=f"/job:{job.client_job}/replica:0/task:0/device:CPU:0",
                step_callback=step_callback,
            )
    except cluster_lib.ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(3)


def _planned(config: Any, devices: int) -> Any:
    """``config`` with the mesh, micro-batches, schedule, remat and balance the planner picks
    for ``devices`` devices; flags the user gave explicitly stay as given."""
    import dataclasses

    import keras

    from hybrid.planning import planner
    from hybrid.trainer import build_model

    layers, shape, dtype = build_model(config)
    given = {name: FLAGS[name].present for name in ("schedule", "remat", "micro_batches")}
    memory = FLAGS.memory_per_device_gib
    choice = planner.choose_mesh(
        layers,
        (shape, dtype),
        devices=devices,
        global_batch=config.global_batch_size,
        memory_per_device=memory * 2**30 if memory else None,
        schedule=config.schedule if given["schedule"] else None,
        remat=config.remat if given["remat"] else None,
        micro_batches=config.micro_batches if given["micro_batches"] else None,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=lambda: keras.optimizers.Adam(config.learning_rate),
        hardware=planner.Hardware(host_cores=os.cpu_count() or 1)
        if config.platform == "cpu"
        else None,
    )
    print(
        f"planned: --mesh={choice.mesh_spec} --micro_batches={choice.micro_batches} "
        f"--schedule={choice.schedule} --remat={choice.remat} --virtual_stages="
        f"{choice.virtual_stages} --balance={','.join(map(str, choice.balance))} (predicted "
        f"{choice.step_time * 1e3:.1f} ms/step, {choice.memory_per_device / 2**20:.0f} MiB/device)"
    )
    return dataclasses.replace(
        config,
        mesh=choice.mesh_spec,
        micro_batches=choice.micro_batches,
        schedule=choice.schedule,
        remat=choice.remat,
        virtual_stages=choice.virtual_stages,
        balance=choice.balance,
    )


def config_from_flags() -> Any:
    """The frozen TrainConfig the flags describe."""
    from hybrid.trainer import TrainConfig

    return TrainConfig(
        model=FLAGS.model,
        data=FLAGS.data,
        mesh=FLAGS.mesh,
        platform=FLAGS.platform,
        micro_batches=FLAGS.micro_batches,
        schedule=FLAGS.schedule,
        virtual_stages=FLAGS.virtual_stages,
        remat=FLAGS.remat,
        balance=parse_balance(FLAGS.balance),
        global_batch_size=FLAGS.global_batch_size,
        train_steps=FLAGS.train_steps,
        learning_rate=FLAGS.learning_rate,
        seed=FLAGS.seed,
        width=FLAGS.width,
        depth=FLAGS.depth,
        seq_len=FLAGS.seq_len,
        num_heads=FLAGS.num_heads,
        dropout=FLAGS.dropout,
        jit_compile=FLAGS.jit_compile,
        log_every=FLAGS.log_every,
        model_dir=FLAGS.model_dir,
        checkpoint_every=FLAGS.checkpoint_every,
        keep_checkpoints=FLAGS.keep_checkpoints,
        profile_steps=parse_profile_steps(FLAGS.profile_steps),
    )


def pause_hook(value: str | None = None) -> Any:
    """The ``train(step_callback=...)`` that :data:`PAUSE_ENV` asks for, or None."""
    value = os.environ.get(PAUSE_ENV) if value is None else value
    if not value:
        return None
    step_text, _, directory = value.partition(":")
    if not step_text.isdigit() or not directory:
        raise app.UsageError(f"{PAUSE_ENV}={value!r} must be 'STEP:DIR'")
    pause_at = int(step_text)

    def pause(step: int, loss: float) -> None:
        del loss
        if step != pause_at:
            return
        import time

        marker = os.path.join(directory, f"paused-{step}")
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)  # appears whole, never half-written
        resume = os.path.join(directory, "resume")
        while not os.path.exists(resume):
            time.sleep(0.02)

    return pause


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import logging

    import hybrid
    from hybrid.checkpoint import CheckpointError
    from hybrid.core.mesh import parse_spec
    from hybrid.trainer import NonFiniteLossError, train

    logging.getLogger("tensorflow").setLevel(logging.ERROR)  # retracing notes while profiling
    config = config_from_flags()
    pause = pause_hook()
    try:
        if config.mesh == "auto":
            if config.platform == "cpu":
                hybrid.simulate_cpu_devices(FLAGS.simulated_devices)
            config = _planned(config, len(hybrid.local_devices(config.platform.upper())))
        stages, replicas = parse_spec(config.mesh)
        if FLAGS.cluster is not None:
            result = _run_on_cluster(config, pause)
        elif config.platform == "tpu":
            from hybrid.platforms import cloud_tpu as tpu_lib

            def attempt(restart: int) -> Any:
                # After a preemption the TPU system must be connected and initialised again.
                system = tpu_lib.resolve(
                    FLAGS.tpu,
                    FLAGS.tpu_zone,
                    FLAGS.gcp_project,
                    discovery_url=FLAGS.tpu_discovery_url,
                )
                return train(config, devices=system.devices, step_callback=pause)

            result = cloud_tpu.run_supervised(
                attempt,
                FLAGS.tpu,
                FLAGS.tpu_zone,
                FLAGS.gcp_project,
                log=print,
            )
        else:
            if config.platform == "cpu":
                hybrid.simulate_cpu_devices(FLAGS.simulated_devices or stages * replicas)
            result = train(config, step_callback=pause)
    except NonFiniteLossError as err:
        print(f"error: {err} (--learning_rate)", file=sys.stderr)
        sys.exit(1)
    except (CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    if result.losses:
        print(
            f"done: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} over steps "
            f"{result.start_step + 1}-{config.train_steps}, "
            f"{result.examples_per_second:.1f} examples/s"
        )
    else:
        print(f"done: already trained to step {config.train_steps} ({result.checkpoint})")


if __name__ == "__main__":
    define_flags()
    app.run(main)
