"""A flag-free training loop: a frozen config in, a trained pipeline and its history out.

Conceptually::

    check every output path; hold model_dir's lock (hybrid.run.resume)
    pipe = Pipeline(model(config), mesh(config), ...)
    start = restore the newest checkpoint in model_dir (its step), else 0
            (its recorded config compared with this one first; hybrid.run.run_record)
    pipe.fit(batches from step start + 1 on,            # batch(step) depends only on (seed, step)
             epochs=1, steps_per_epoch=train_steps - start, callbacks=[after each step:
        stop with NonFiniteLossError if loss is NaN/Inf (the last good checkpoint stays)
        log / TensorBoard scalars every log_every steps; checkpoint every checkpoint_every;
        once `stop` is set: checkpoint this step and end])
    checkpoint at the end; export (unless stopped early)

The loop is ``Pipeline.fit``, Keras's own (``--progress_bar`` shows ``keras.utils.Progbar``),
and everything the launcher does per step is a Keras callback (``hybrid.run.callbacks``).

so a run killed at any point and started again with the same config finishes with exactly
the weights of an uninterrupted run, and a checkpoint restores onto any mesh.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hybrid.core.mesh import DeviceMesh, parse_spec
from hybrid.engine.api.per_host import PerHostDataset, input_hosts
from hybrid.engine.api.pipeline import Pipeline
from hybrid.run import data, event_files, resume
from hybrid.run.callbacks import NonFiniteLossError, StepCallback, Steps
from hybrid.run.checkpoint import Checkpointer
from hybrid.run.data_sources import is_function_spec
from hybrid.run.output_paths import check_output_paths, missing_extras
from hybrid.run.train_config import TrainConfig, execution_conflict
from hybrid.run.user_model import call_user, model_for, optimizer_for, takes_input_context

__all__ = [
    "NonFiniteLossError",
    "TrainResult",
    "mesh_for",
    "pipeline_for",
    "train",
]


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """The losses of the steps this call ran, where it started, and the trained pipeline.

    Attributes:
      losses: loss of each step run by this call (steps ``start_step + 1`` …); with
        ``steps_per_execution`` N > 1, of each execution's last step.
      start_step: the step restored from a checkpoint (0 for a fresh run).
      examples_per_second: throughput after the first (compiling) step of this call.
      pipeline: the trained pipeline.
      checkpoint: the last checkpoint written, if any.
      interrupted_at: the step after which ``stop`` ended the run early (None: it did not).
    """

    losses: tuple[float, ...]
    start_step: int
    examples_per_second: float
    pipeline: Pipeline
    checkpoint: str | None
    interrupted_at: int | None = None


def mesh_for(config: TrainConfig, devices: Sequence[str] | None = None) -> DeviceMesh:
    """The config's mesh on ``devices`` (stage-major), or on the local ``config.platform``
    devices."""
    stages, replicas = parse_spec(config.mesh)
    if devices is not None:
        return DeviceMesh.from_devices(devices, stages, replicas)
    return DeviceMesh.create(stages, replicas, config.platform.upper())


def _with_batch(shape: Any, batch: int) -> Any:
    """An input shape (or a list of them) with its batch dimension set to ``batch``: the
    pipeline then knows the batch it runs (its memory estimate, ``--balance=memory``)."""
    if isinstance(shape[0], (list, tuple)):
        return [(batch, *s[1:]) for s in shape]
    return (batch, *shape[1:])


def pipeline_for(
    config: TrainConfig, mesh: DeviceMesh, strategy: Any = None
) -> tuple[Pipeline, Any, tuple[list[str], str]]:
    """The pipeline of the config's model, built (its step under ``strategy`` when given);
    the input shape (one, without the batch) the reference data needs (None for a
    model of several inputs); the model's summary for the run's record."""
    model, loss, metrics, shape, dtype = model_for(config)
    pipe = Pipeline(
        model,
        mesh,
        strategy=strategy,
        **dataclasses.asdict(config.layout),
        prefetch=config.prefetch,
        boundary_dtype=config.boundary_dtype,
    )
    pipe.compile(
        optimizer=optimizer_for(config),
        loss=loss,
        metrics=metrics,
        jit_compile=config.jit_compile,
        steps_per_execution=config.steps_per_execution,
    )
    pipe.build(_with_batch(shape, config.data.global_batch_size), dtype)
    pipe.timeline_every = config.timeline_every
    summary = resume.describe_model(model, loss)
    return pipe, None if isinstance(dtype, list) else tuple(shape[1:]), summary


def train(
    config: TrainConfig,
    log: Callable[[str], None] = print,
    step_callback: StepCallback | None = None,
    devices: Sequence[str] | None = None,
    checkpoint_io_device: str | None = None,
    strategy: Any = None,
    stop: threading.Event | None = None,
) -> TrainResult:
    """Trains ``config.model.name`` on ``config.data.source`` on ``config.mesh``; resumes
    from ``config.outputs.model_dir``.

    Before any work the output paths are checked and the model_dir's lock is taken
    (``hybrid.run.resume``: one run per directory; the record of the run compared).

    Args:
      config: the run.
      log: receives the progress lines.
      step_callback: called as ``step_callback(step, loss)`` after every step, once the
        step's log line and checkpoint (if any) are written; whatever it raises ends the run
        (the supervisor and the tests inject failures through it).
      devices: the devices to lay the mesh on, stage-major (default: the local
        ``config.platform`` ones); e.g. a multi-host mesh's devices.
      checkpoint_io_device: the device whose host writes the checkpoint files (a
        multi-host client passes its own CPU).
      strategy: run each step as one program per replica under this ``tf.distribute``
        strategy (a ``TPUStrategy`` on the layout of ``devices``: ``Pipeline(strategy=)``).
      stop: once set, the step in flight finishes, is checkpointed (with a model_dir) and
        the run ends early (``TrainResult.interrupted_at``; nothing is exported).

    Raises:
      NonFiniteLossError: the loss became NaN or Inf.
      ValueError: an output path cannot be written (naming it), the model_dir holds
        another run (``ConfigDriftError``), your function raised (``UserFunctionError``).
      RunLockError: another run holds the model_dir.
      CheckpointError: no checkpoint there can be restored, or one cannot be written.
    """
    check_output_paths(
        config.outputs.model_dir, config.outputs.export_dir, config.outputs.keras_file
    )
    missing = missing_extras(config.timeline_every, config.outputs.model_dir)
    if missing:
        raise ValueError(missing)
    conflict = execution_conflict(
        config.steps_per_execution,
        config.log_every,
        config.outputs.checkpoint_every,
        config.timeline_every,
    )
    if conflict:
        raise ValueError(conflict)
    with resume.lock(config, log):
        resume.start_afresh(config, log)
        return _train(config, log, step_callback, devices, checkpoint_io_device, strategy, stop)


def _train(
    config: TrainConfig,
    log: Callable[[str], None],
    step_callback: StepCallback | None,
    devices: Sequence[str] | None,
    checkpoint_io_device: str | None,
    strategy: Any,
    stop: threading.Event | None,
) -> TrainResult:
    pipe, input_shape, summary = pipeline_for(config, mesh_for(config, devices), strategy)
    saver = (
        Checkpointer(
            pipe,
            config.outputs.model_dir,
            config.outputs.keep_checkpoints,
            config.seed,
            checkpoint_io_device,
        )
        if config.outputs.model_dir
        else None
    )
    restored = resume.resume(config, pipe, saver, summary, log)
    start = restored.step if restored else 0
    position = restored.data_position if restored else 0
    batches = _batches(config, pipe, config.data.source, config.seed, position, input_shape)
    if isinstance(batches, PerHostDataset):
        hosts = ", ".join(f"{cpu} (replicas {replicas})" for cpu, replicas in batches.hosts)
        log(f"data read per host, {len(batches.hosts)} input host(s): {hosts}")
    validation = (
        _batches(config, pipe, config.data.validation_data, config.seed + 1, 0, input_shape)
        if config.data.validation_data
        else None
    )
    writer = None
    if config.outputs.model_dir:
        events = os.path.join(config.outputs.model_dir, "train")
        if event_files.drop_after(events, start):
            log(f"TensorBoard: dropped the events a stopped run logged after step {start}")
        writer = tf.summary.create_file_writer(events)
    steps = Steps(config, pipe, start, saver, writer, log, step_callback, stop)
    steps.last_checkpoint = restored.path if restored else None
    if config.train_steps > start:
        if config.steps_per_execution > 1:  # a last execution of fewer steps, not past the end
            batches = batches.take(config.train_steps - start)  # (a per-host one's steps)
        try:
            pipe.fit(
                batches,
                epochs=1,
                steps_per_epoch=config.train_steps - start,
                verbose=0,  # the progress bar, if any, is the Steps callback's (after compiling)
                shuffle=False,  # the batches are a function of (seed, step)
                callbacks=[steps],
                validation_data=validation,
                validation_steps=config.data.validation_steps,
            )
        except Exception as err:
            steps.save_before_failing(err)
            raise
    if writer is not None:
        writer.flush()
    if steps.interrupted_at is None:
        _export(config, pipe, log)
    return TrainResult(
        tuple(steps.losses),
        start,
        steps.progress.examples_per_second,
        pipe,
        steps.last_checkpoint,
        steps.interrupted_at,
    )


def _batches(
    config: TrainConfig, pipe: Pipeline, spec: str, seed: int, position: int, input_shape: Any
) -> Any:
    """The global batches ``spec`` names (``--data``'s grammar), from batch ``position`` on:
    a ``tf.data.Dataset``, or for your function with an ``input_context`` parameter the
    per-host dataset it makes on every input host (each skipping the elements its replicas
    took before ``position``)."""
    if is_function_spec(spec) and takes_input_context(spec):
        firsts = [pipe.mesh.device(0, r) for r in range(pipe.mesh.num_replicas)]
        fed = [len(replicas) for _, replicas in input_hosts(firsts)]

        def per_host(context: tf.distribute.InputContext) -> tf.data.Dataset:
            made = call_user("data", spec, config.data.global_batch_size, input_context=context)
            return made.skip(position * fed[context.input_pipeline_id])

        return pipe.distribute_datasets_from_function(per_host)
    if is_function_spec(spec):  # yours: the batches after the ones already taken
        return call_user("data", spec, config.data.global_batch_size).skip(position)
    if spec.startswith("tfrecord:"):
        return data.tfrecord_dataset(
            spec.partition(":")[2],
            config.data.tfrecord_features or "",
            config.data.tfrecord_label,
            config.data.global_batch_size,
            position,
        )
    return data.dataset(
        spec,
        config.model.name,
        config.data.global_batch_size,
        seed,
        start_step=position,
        seq_len=config.model.seq_len,
        input_shape=input_shape,
    )


def _export(config: TrainConfig, pipe: Pipeline, log: Callable[[str], None]) -> None:
    """The trained model as SavedModels (whole and per stage) and as a .keras file."""
    if config.outputs.export_dir:
        pipe.export(config.outputs.export_dir)
        pipe.export(os.path.join(config.outputs.export_dir, "stages"), per_stage=True)
        log(f"exported SavedModels to {config.outputs.export_dir} (per stage: stages/)")
    if config.outputs.keras_file:
        pipe.save(config.outputs.keras_file)
        log(f"saved the Keras model to {config.outputs.keras_file}")
