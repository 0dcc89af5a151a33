"""Trains a reference model with hybrid on a device mesh.

    hybrid-train                                   # Transformer on text, 2×2 CPU mesh
    hybrid-train --mesh=stage:4,replica:2 --schedule=1f1b --micro_batches=8 \\
        --model_dir=/tmp/run --checkpoint_every=50           # killed? the same command resumes
    hybrid-train --platform=gpu --mesh=stage:2,replica:4 ...
    hybrid-train --platform=tpu --tpu=my-node --tpu_zone=us-central2-b \\
        --gcp_project=my-project --model_dir=gs://bucket/run ...

Every flag combination is checked before any work; ``main`` freezes the flags into a
``TrainConfig`` and calls the flag-free ``hybrid.run.trainer.train``.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from absl import app, flags

from hybrid.core.quiet import quiet_cpp_info

quiet_cpp_info()  # before TensorFlow loads: its C++ INFO lines unless TF_CPP_MIN_LOG_LEVEL is set

from hybrid.launch import cloud_tpu, restarts, run_app, show_in_help, use_xla_cache  # noqa: E402
from hybrid.launch.interrupts import Interrupts, exit_code  # noqa: E402
from hybrid.launch.train_flags import (  # noqa: E402
    define_flags,
    parse_balance,
    parse_deadline,
    parse_memory,
    parse_micro_batches,
    parse_profile_steps,
)

FLAGS = flags.FLAGS

# Test hook: "STEP[,STEP...]:DIR" makes the run stop after each STEP (its checkpoint, if any,
# written before), create DIR/paused-STEP, and wait until DIR/resume-STEP exists. Tests that
# kill a process or a worker do it while the run is paused, so what the run has written when
# the fault lands is decided by the step, not by the machine's speed.
PAUSE_ENV = "HYBRID_PAUSE_AFTER_STEP"


def _run_on_cluster(
    config: Any, step_callback: Any = None, stop: Any = None, spec: Any = None
) -> Any:
    """Connects to the workers (``--cluster``, else ``spec``), lays the mesh over their
    devices and trains from the client; what the engine does not place on a device stays
    in this process (once connected, TensorFlow's default device is the first worker's).

    Raises SystemExit(3) with the task's name when a worker cannot be reached or is lost;
    a step that outlives ``--step_deadline`` ends the process with exit 4 (``_exit_hung``).
    """
    import tensorflow as tf

    from hybrid.core.mesh import parse_spec
    from hybrid.core.quiet import drop_lost_worker_unraisables
    from hybrid.engine.devices import client_cpu
    from hybrid.launch.worker import flag_terms  # the cluster library's words -> flags
    from hybrid.platforms import cluster as cluster_lib
    from hybrid.platforms import slurm
    from hybrid.platforms.step_deadline import StepDeadline
    from hybrid.run.trainer import train

    drop_lost_worker_unraisables()  # the guard names a lost worker; its executors need not
    if spec is None and slurm.is_slurm(FLAGS.cluster):
        spec = slurm.spec(FLAGS.cluster)
    elif spec is None:
        spec = None if FLAGS.cluster == "TF_CONFIG" else FLAGS.cluster
    stages, replicas = parse_spec(config.mesh)
    try:
        job = cluster_lib.connect(spec, timeout_s=FLAGS.cluster_timeout)
        try:
            mesh = cluster_lib.mesh(
                job, stages, replicas, order=FLAGS.mesh_order, device_type=config.platform.upper()
            )
        except ValueError as err:  # main() prints it (exit 1), in flag terms
            raise ValueError(flag_terms(str(err))) from err
        deadline = StepDeadline(
            job.workers,
            _exit_hung,
            parse_deadline(FLAGS.step_deadline),
            mesh_devices=mesh.devices,
        )
        try:
            with job.guard(), tf.device(client_cpu()):
                return train(
                    config,
                    devices=[d for row in mesh.devices for d in row],
                    checkpoint_io_device=f"/job:{job.client_job}/replica:0/task:0/device:CPU:0",
                    step_callback=_watched(step_callback, deadline),
                    stop=stop,
                )
        finally:
            deadline.close()  # what follows the last step (exports) is not a step
    except cluster_lib.ClusterError as err:
        print(f"error: {flag_terms(str(err))}", file=sys.stderr)
        sys.exit(restarts.LOST_WORKER)


def _watched(step_callback: Any, deadline: Any) -> Any:
    """The step callback that reports each step to ``deadline`` (a ``StepDeadline``), then
    calls ``step_callback`` (if any) with the deadline held: its time is not the step's."""

    def after_step(step: int, loss: float) -> None:
        deadline.progressed(step)
        if step_callback is not None:
            with deadline.held():
                step_callback(step, loss)

    return after_step


def _exit_hung(hang: Any) -> None:
    """``StepDeadline``'s report: one line (the silent tasks and devices, the newest
    checkpoint), then exit :data:`restarts.HUNG` at once (the step still blocks the main
    thread, and TensorFlow cannot cancel it)."""
    from hybrid.launch.worker import flag_terms
    from hybrid.run import run_lock
    from hybrid.run.checkpoint import latest_step

    step = latest_step(FLAGS.model_dir) if FLAGS.model_dir else None
    kept = (
        f"the newest checkpoint is ckpt-{step} in {FLAGS.model_dir}"
        if step is not None
        else "no checkpoint was saved"
    )
    said = hang.line(deadline=f"--step_deadline={FLAGS.step_deadline}")
    print(
        f"error: hung: {flag_terms(said)}; {kept}; exiting {restarts.HUNG} (--max_restarts "
        "starts a new client)",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    run_lock.release_all()  # the next client's, not a stale one to take over
    os._exit(restarts.HUNG)


def _planned(config: Any, devices: int) -> tuple[Any, Any]:
    """``config`` with the mesh, micro-batches, schedule, remat and balance the planner picks
    for ``devices`` devices (flags the user gave explicitly stay as given), and the chosen
    prediction."""
    import dataclasses

    from hybrid import planning as planner
    from hybrid.core.config import layout_of
    from hybrid.core.memory import format_bytes
    from hybrid.run.user_model import optimizer_for, profiled_layers

    profiled = profiled_layers(config)
    flags_given = (
        "schedule", "remat", "micro_batches", "defer_weight_gradients", "shard_optimizer_states"
    )  # fmt: skip
    given = {name: FLAGS[name].present for name in flags_given}
    micro = config.layout.micro_batches
    choice = planner.choose_mesh(
        profiled.model,
        (profiled.input_shape, profiled.input_dtype),
        devices=devices,
        global_batch=config.data.global_batch_size,
        memory_per_device=parse_memory(FLAGS.memory_per_device),
        schedule=config.layout.schedule if given["schedule"] else None,
        remat=config.layout.remat if given["remat"] else None,
        micro_batches=micro if given["micro_batches"] and micro != "auto" else None,
        defer_weight_gradients=config.layout.defer_weight_gradients
        if given["defer_weight_gradients"]
        else None,
        shard_optimizer_states=config.layout.shard_optimizer_states
        if given["shard_optimizer_states"] or config.platform == "tpu"
        else None,
        x=profiled.x,
        loss=profiled.loss,
        optimizer=lambda: optimizer_for(config),  # its update timed, its state counted
    )  # on this host's measured overheads (planner.host_hardware), as hybrid.plan's
    run = choice.config
    assert isinstance(run.balance, tuple)  # the plan's layer counts per stage
    print(
        f"planned: --mesh={run.mesh_spec.replace(';', ',')} --micro_batches={run.micro_batches} "
        f"--schedule={run.schedule} --remat={run.remat} --virtual_stages="
        f"{run.virtual_stages} --balance={','.join(map(str, run.balance))} "
        f"--defer_weight_gradients={run.defer_weight_gradients} "
        f"--shard_optimizer_states={run.shard_optimizer_states} (predicted "
        f"{choice.step_time * 1e3:.1f} ms/step, {format_bytes(choice.peak_memory)}/device)"
    )
    return dataclasses.replace(config, mesh=run.mesh_spec, layout=layout_of(run)), choice


def config_from_flags() -> Any:
    """The frozen TrainConfig the flags describe: every field is the flag of its name."""

    from hybrid.run.train_config import FIELDS, TrainConfig

    values: dict[str, Any] = {name: FLAGS[name].value for name in FIELDS}
    if values["mesh"] != "auto":  # one spelling, so a resumed run sees no change of form
        from hybrid.core.mesh import parse_spec

        stages, replicas = parse_spec(values["mesh"])
        values["mesh"] = f"stage:{stages};replica:{replicas}"
    values["balance"] = parse_balance(FLAGS.balance)
    values["micro_batches"] = parse_micro_batches(FLAGS.micro_batches)
    values["profile_steps"] = parse_profile_steps(FLAGS.profile_steps)
    return TrainConfig.of(**values)


def pause_hook(value: str | None = None) -> Any:
    """The ``train(step_callback=...)`` that :data:`PAUSE_ENV` asks for, or None."""
    value = os.environ.get(PAUSE_ENV) if value is None else value
    if not value:
        return None
    steps_text, _, directory = value.partition(":")
    if not directory or not all(t.isdigit() for t in steps_text.split(",")):
        raise app.UsageError(f"{PAUSE_ENV}={value!r} must be 'STEP[,STEP...]:DIR'")
    pause_at = {int(t) for t in steps_text.split(",")}

    def pause(step: int, loss: float) -> None:
        del loss
        if step not in pause_at:
            return
        import time

        marker = os.path.join(directory, f"paused-{step}")
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)  # appears whole, never half-written
        resume = os.path.join(directory, f"resume-{step}")
        while not os.path.exists(resume):
            time.sleep(0.02)

    return pause


def train_on_tpu(
    config: Any, system: Any, step_callback: Any = None, log: Any = print, stop: Any = None
) -> Any:
    """Trains on a connected TPU system (``tpu_node.TPUSystem``): the mesh placed on its
    topology (``tpu_mesh.layout``), each step one TPU program per replica under the
    layout's ``TPUStrategy`` (``Pipeline(strategy=)``)."""
    import tensorflow as tf

    from hybrid.core.mesh import parse_spec
    from hybrid.platforms import tpu_mesh
    from hybrid.run.trainer import train

    stages, replicas = parse_spec(config.mesh)
    job = tf.DeviceSpec.from_string(system.devices[0]).job if system.devices else None
    tpu = tpu_mesh.layout(system.topology, stages, replicas, job=job)
    strategy = tpu_mesh.tpu_strategy(system.resolver, tpu)
    devices = [device for row in tpu.devices for device in row]  # stage-major
    try:
        return train(config, log, step_callback, devices=devices, strategy=strategy, stop=stop)
    except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError) as err:
        if tf.config.list_logical_devices("TPU"):
            raise
        kinds = sorted({d.device_type for d in tf.config.list_logical_devices()})
        raise RuntimeError(
            f"the TPU step of mesh {config.mesh} ({tpu.placement}) was built, but this "
            f"process has no TPU device to run it on (TensorFlow lists {kinds}); connect to "
            "the TPU first: hybrid.platforms.cloud_tpu.resolve(), which --tpu does"
        ) from err


def _run_on_tpu(config: Any, step_callback: Any, stop: Any) -> Any:
    """Trains on the Cloud TPU node the flags name, through preemptions (the supervisor)."""
    from hybrid.platforms import cloud_tpu as tpu_lib

    def attempt(restart: int) -> Any:
        # After a preemption the TPU system must be connected and initialised again.
        system = tpu_lib.resolve(
            FLAGS.tpu, FLAGS.tpu_zone, FLAGS.gcp_project, discovery_url=FLAGS.tpu_discovery_url
        )
        return train_on_tpu(config, system, step_callback, stop=stop)

    return cloud_tpu.run_supervised(
        attempt, FLAGS.tpu, FLAGS.tpu_zone, FLAGS.gcp_project, log=print
    )


def _check_gpus(config: Any) -> None:
    """``--platform=gpu``: the mesh's GPUs must be there (a message in GPU terms, not in
    the CPU simulation's)."""
    import hybrid
    from hybrid.core.mesh import parse_spec

    stages, replicas = (1, 1) if config.mesh == "auto" else parse_spec(config.mesh)
    found = len(hybrid.local_devices("GPU"))
    if found < stages * replicas:
        import tensorflow as tf

        cuda = (
            ""
            if tf.test.is_built_with_cuda()
            else " (this TensorFlow has no CUDA: `make install TF=cuda`)"
        )
        raise ValueError(
            f"--platform=gpu --mesh={config.mesh} needs {stages * replicas} GPUs but TensorFlow "
            f"sees {found} on this host{cuda}; use a smaller --mesh, or --platform=cpu"
        )


def _dry_run(config: Any, planned: Any = None) -> None:
    """``--dry_run``: the plan of the run on this host's devices, then nothing (``planned``:
    the prediction of ``--mesh=auto``'s plan, shown instead of profiling again)."""
    import hybrid
    from hybrid.core.mesh import parse_spec
    from hybrid.run.dry_run import dry_run

    if FLAGS.cluster is not None or config.platform == "tpu":
        raise ValueError(
            "--dry_run plans on this host's devices; drop --cluster and --platform=tpu for "
            "it (the stages table and the prediction do not depend on where the devices are)"
        )
    if config.platform == "cpu":
        stages, replicas = parse_spec(config.mesh)
        hybrid.simulate_cpu_devices(FLAGS.simulated_devices or stages * replicas)
    dry_run(config, planned=planned)


def _run(config: Any, step_callback: Any, stop: Any = None) -> Any:
    """Trains where the flags say: a cluster, a Cloud TPU, or this host's devices."""
    import hybrid
    from hybrid.core.mesh import parse_spec
    from hybrid.run.trainer import train

    if config.platform == "gpu" and FLAGS.cluster is None:
        _check_gpus(config)
    planned = None
    if config.mesh == "auto":
        if config.platform == "cpu":
            hybrid.simulate_cpu_devices(FLAGS.simulated_devices)
        config, planned = _planned(config, len(hybrid.local_devices(config.platform.upper())))
    if FLAGS.dry_run:
        _dry_run(config, planned)
        return config, None
    if FLAGS.cluster is not None:
        return config, _run_on_cluster(config, step_callback, stop)
    if config.platform == "tpu":
        return config, _run_on_tpu(config, step_callback, stop)
    stages, replicas = parse_spec(config.mesh)
    devices = FLAGS.simulated_devices or stages * replicas
    if config.platform == "cpu" and FLAGS.memory_per_device is not None:
        return config, _run_on_capped_devices(config, devices, step_callback, stop)
    if config.platform == "cpu":
        hybrid.simulate_cpu_devices(devices)
    return config, train(config, step_callback=step_callback, stop=stop)


def _run_on_capped_devices(config: Any, devices: int, step_callback: Any, stop: Any) -> Any:
    """``--platform=cpu --memory_per_device``: each of the ``devices`` simulated devices is
    its own local worker process with its CPU allocator capped
    (``hybrid.platforms.local_workers``), and this process trains on them as a cluster's
    client. The workers end with this process."""
    import atexit
    import shutil

    from hybrid.core.memory import format_bytes
    from hybrid.platforms import local_workers

    workers = local_workers.start(
        devices, parse_memory(FLAGS.memory_per_device), xla_cache_dir=FLAGS.xla_cache_dir
    )
    atexit.register(shutil.rmtree, workers.log_dir, True)  # the workers outlive atexit
    cap = format_bytes(workers.memory_per_device or 0)
    print(f"{devices} simulated devices, one worker process each, capped at {cap}", flush=True)
    return _run_on_cluster(config, step_callback, stop, spec=workers.spec)


# TensorFlow's errors about files (a path, its permissions, its space, its bytes); the last
# two also report other things, so they count only when their message is about a file.
_FILE_ERRORS = ("NotFoundError", "PermissionDeniedError", "AlreadyExistsError", "DataLossError")
_FILE_ERRORS_IF_SAID = ("OutOfRangeError", "FailedPreconditionError", "ResourceExhaustedError")


def _is_file_error(err: BaseException) -> bool:
    """Whether ``err`` is TensorFlow's report of a file problem (a user's, not a bug)."""
    name, text = type(err).__name__, str(err).lower()
    if "tensorflow" not in type(err).__module__:
        return False
    said = any(word in text for word in ("file", "directory", "space left", "permission"))
    return name in _FILE_ERRORS or (name in _FILE_ERRORS_IF_SAID and said)


def _flag_of(text: str) -> str:
    """``--flag: `` for the output flag whose path ``text`` mentions, else ''."""
    for name in ("model_dir", "export_dir", "keras_file"):
        value = FLAGS[name].value if name in FLAGS else None
        if value and value.rstrip("/") in text:
            return f"--{name}={value}: "
    return ""


def report_error(err: BaseException) -> int:
    """Prints one line for a user's error (the exit code 1); a traceback and a line saying
    so for an internal bug (exit code 2)."""
    import traceback

    from hybrid.core.lazy import missing_dependency

    if isinstance(err, ModuleNotFoundError) and missing_dependency("", err) is not None:
        print(f"error: {missing_dependency('hybrid-train', err)}", file=sys.stderr)
        return 1
    from hybrid.engine.api.out_of_memory import OutOfMemoryError
    from hybrid.run.checkpoint import CheckpointError, error_line
    from hybrid.run.run_lock import RunLockError
    from hybrid.run.trainer import NonFiniteLossError

    lines = str(err).strip().splitlines() or [type(err).__name__]
    if isinstance(err, OutOfMemoryError):
        print(f"error: {err.line(flags=True)}", file=sys.stderr)
        return 1
    if isinstance(err, NonFiniteLossError):
        print(f"error: {lines[0]} (--learning_rate)", file=sys.stderr)
        return 1
    if isinstance(err, CheckpointError | RunLockError | ValueError):
        flag = "" if lines[0].startswith("--") else _flag_of(lines[0])
        print(f"error: {flag}{lines[0]}", file=sys.stderr)
        return 1
    if isinstance(err, OSError) or _is_file_error(err):
        print(
            f"error: {_flag_of(str(err))}{type(err).__name__}: {error_line(err)}", file=sys.stderr
        )
        return 1
    traceback.print_exception(err)
    print(
        f"error: internal error ({type(err).__name__}) in hybrid, not in your flags: this is a "
        "bug; please report it with the traceback above",
        file=sys.stderr,
    )
    return 2


def _finish(config: Any, result: Any, interrupts: Interrupts) -> None:
    """The run's last line: done, already done, or interrupted (then exit 128 + signal)."""
    if result.interrupted_at is not None:
        saved = (
            f"saved {os.path.basename(result.checkpoint)}; run the same command to resume"
            if result.checkpoint
            else "nothing saved (no --model_dir)"
        )
        print(f"interrupted at step {result.interrupted_at}; {saved}")
        sys.exit(exit_code(interrupts.received or signal.SIGINT))
    if result.losses:
        speed = "examples/s not measured (every step compiled, traced or was timed)"
        if result.examples_per_second:
            speed = f"{result.examples_per_second:.1f} examples/s"
            speed += " (timed steps left out)" if config.timeline_every else ""
        print(
            f"done: loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} over steps "
            f"{result.start_step + 1}-{config.train_steps}, {speed}"
        )
    else:
        print(
            f"done: already trained to step {config.train_steps} ({result.checkpoint}); "
            + os.environ.get(  # `make demo` names its own variables
                "HYBRID_RERUN_HINT",
                "--train_steps higher to go on, or --fresh_start to train again",
            )
        )
    for line in outputs(config):
        print(line)


def outputs(config: Any) -> list[str]:
    """Where the run's outputs are, one line each, and the command that shows its curves."""
    lines = []
    if config.outputs.model_dir:
        lines.append(
            f"  model_dir   {config.outputs.model_dir} (checkpoints ckpt-<step>, run_config.json; "
            "TensorBoard events in train/)"
        )
    if config.outputs.export_dir:
        lines.append(
            f"  export_dir  {config.outputs.export_dir} (SavedModel; per stage: "
            f"{os.path.join(config.outputs.export_dir, 'stages')}, hybrid.run.serving.load)"
        )
    if config.outputs.keras_file:
        lines.append(
            f"  keras_file  {config.outputs.keras_file} ({_loads_with(config.model.name)})"
        )
    if config.outputs.model_dir:
        lines.append(f"  tensorboard --logdir {config.outputs.model_dir}")
    return ["outputs:", *lines] if lines else ["outputs: none (give --model_dir to keep the run)"]


def _loads_with(model: str) -> str:
    """How a fresh process loads the model's .keras file: the module that registers its
    custom layers with Keras imported first (the reference models', or yours)."""
    if ":" in model:  # yours: "package.module:function"
        module = model.partition(":")[0]
    elif model in ("transformer", "resnet"):
        module = f"hybrid.models.{model}"
    else:
        return "keras.saving.load_model"
    return f"import {module}; keras.saving.load_model"


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.max_restarts and not FLAGS.dry_run:  # a supervisor: no TensorFlow here
        sys.exit(restarts.supervise(sys.argv[1:], FLAGS.max_restarts))
    import logging

    from hybrid.core.quiet import import_tensorflow

    try:  # before TensorFlow loads: it reads its XLA flags once
        use_xla_cache(FLAGS.xla_cache_dir)
    except ValueError as err:
        sys.exit(report_error(err))
    if FLAGS.platform == "cpu" and (FLAGS.mesh == "auto" or FLAGS.dry_run):
        # The planner's profile measures each layer's bytes (kept for its backward, its
        # working peak) with the allocator's statistics, which on a CPU only TensorFlow's BFC
        # allocator keeps: without it the figures fall back to the layers' outputs.
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    import_tensorflow()  # without its start-up noise (no CUDA driver on a CPU host, ...)

    logging.getLogger("tensorflow").setLevel(logging.ERROR)  # retracing notes while profiling
    if not FLAGS["verbosity"].present:  # absl INFO of TensorFlow's saving code: not asked for
        from hybrid.core.quiet import hide_library_info

        hide_library_info()
    interrupts = Interrupts()
    try:
        with interrupts.installed():
            config, result = _run(config_from_flags(), pause_hook(), interrupts.stop)
    except KeyboardInterrupt:
        from hybrid.run.checkpoint import latest_step

        step = latest_step(FLAGS.model_dir) if FLAGS.model_dir else None
        kept = (
            f"the newest checkpoint is ckpt-{step}; run the same command to resume"
            if step is not None
            else "no checkpoint was saved"
        )
        print(f"interrupted again: stopped at once; {kept}")
        sys.exit(exit_code(interrupts.received or signal.SIGINT))
    except Exception as err:  # noqa: BLE001 - every error ends here, as one line or a bug report
        sys.exit(report_error(err))
    if FLAGS.dry_run:
        print("dry run: nothing trained (drop --dry_run to train)")
        return
    _finish(config, result, interrupts)


def run() -> None:
    """The ``hybrid-train`` command: defines the flags, parses argv and runs :func:`main`;
    ``--help`` prints the flags and exits 0."""
    define_flags()
    show_in_help(
        "hybrid.launch.train_flags",
        "hybrid.launch.model_flags",
        "hybrid.launch.cloud_tpu",
        "hybrid.launch",
    )
    run_app(main, "hybrid-train")


if __name__ == "__main__":
    run()
