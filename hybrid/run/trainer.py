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
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from hybrid.core.mesh import DeviceMesh, parse_spec
from hybrid.engine.api.pipeline import Pipeline
from hybrid.engine.api.strategy_pipeline import StrategyPipeline
from hybrid.run import data, resume
from hybrid.run.callbacks import NonFiniteLossError, StepCallback, Steps
from hybrid.run.checkpoint import Checkpointer
from hybrid.run.data_sources import is_function_spec
from hybrid.run.output_paths import check_output_paths
from hybrid.run.user_model import call_user, model_for, optimizer_for

__all__ = [
    "NonFiniteLossError",
    "TrainConfig",
    "TrainResult",
    "mesh_for",
    "pipeline_for",
    "train",
]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs.

    Attributes:
      model: "transformer", "resnet" or "mlp" (``hybrid.models``), or yours:
        "package.module:fn" (``hybrid.run.user_model``).
      data: "synthetic", "text:PATH", "text:python-docs" or "package.module:fn"
        (``hybrid.run.data``).
      tfrecord_features, tfrecord_label: a "tfrecord:PATTERN" source's feature spec (JSON)
        and the name of its label feature.
      validation_data, validation_steps: data in ``data``'s grammar evaluated at the end of
        the run (``fit``'s ``validation_data``; a reference source draws with ``seed + 1``),
        and how many batches of it; None: no validation.
      optimizer, optimizer_config: a Keras optimizer's name and its other arguments (JSON).
      precision: the Keras dtype policy the model is built under.
      mesh: mesh spec, e.g. "stage:2;replica:2".
      platform: "cpu", "gpu" or "tpu": the device type the mesh is made of.
      micro_batches: micro-batches per replica per step, or "auto": the first step times
        every M the schedule accepts and keeps the fastest (``Pipeline``'s "auto").
      schedule: pipeline schedule name.
      virtual_stages: model stages per device (interleaved schedule).
      remat: "never", "except_last" or "always".
      balance: layers per stage ("params", "time", or counts such as (3, 2)).
      global_batch_size: examples per step over all replicas.
      train_steps: the step to train up to (a resumed run continues to it).
      learning_rate: the optimizer's learning rate; a resumed run applies
        it (``hybrid.run.resume``).
      seed: initial weights, data order and random layers.
      width, depth: model width (d_model, channels, units) and depth (blocks).
      seq_len, num_heads, dropout: the Transformer's context, heads and dropout rate.
      tie_embeddings: the Transformer's output head reads the token embedding matrix.
      jit_compile: XLA-compile the stage programs.
      prefetch: batches prepared on the mesh's devices ahead of the step (0: none).
      boundary_dtype: what crosses a stage boundary in training (``Pipeline``'s
        ``boundary_dtype``: "bfloat16" and "int8" compress, inexactly).
      defer_weight_gradients: ``Pipeline``'s: weight gradients once per step and stage.
      timeline_every: time every this many steps: per device compute, transfers,
        all-reduce and idle to the log, TensorBoard and a PNG (0: never).
      log_every: log and write TensorBoard scalars every this many steps.
      model_dir: checkpoints and TensorBoard events; None keeps nothing.
      checkpoint_every: save every this many steps (0: only at the end).
      keep_checkpoints: how many recent checkpoints to keep.
      profile_steps: (first, last) steps to capture in a TF profiler trace, or None.
      progress_bar: show Keras's progress bar instead of the log lines.
      export_dir: at the end, a SavedModel of the model here and one per stage under
        ``export_dir/stages``; None writes none.
      keras_file: at the end, the trained model saved as this ``.keras`` file; None: none.
      fresh_start: move the model_dir's checkpoints aside (``aside-<time>/``) and start
        from step 1, instead of resuming (or stopping, when none can be restored).
      take_over_lock: take the model_dir's lock even when it names a run on another host.
    """

    model: str = "transformer"
    data: str = "text:" + data.BUILTIN_TEXT
    tfrecord_features: str | None = None
    tfrecord_label: str = "label"
    validation_data: str | None = None
    validation_steps: int | None = None
    optimizer: str = "adam"
    optimizer_config: str = "{}"
    precision: str = "float32"
    mesh: str = "stage:2;replica:2"
    platform: str = "cpu"
    micro_batches: int | str = 4
    schedule: str = "gpipe"
    virtual_stages: int = 1
    remat: str = "except_last"
    balance: str | tuple[int, ...] | None = None
    global_batch_size: int = 32
    train_steps: int = 60
    learning_rate: float = 3e-3
    seed: int = 0
    width: int = 64
    depth: int = 2
    seq_len: int = 64
    num_heads: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = False
    jit_compile: bool = True
    prefetch: int = 2
    boundary_dtype: str = "float32"
    defer_weight_gradients: bool = False
    timeline_every: int = 0
    log_every: int = 10
    model_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    profile_steps: tuple[int, int] | None = None
    progress_bar: bool = False
    export_dir: str | None = None
    keras_file: str | None = None
    fresh_start: bool = False
    take_over_lock: bool = False


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """The losses of the steps this call ran, where it started, and the trained pipeline.

    Attributes:
      losses: loss of each step run by this call (steps ``start_step + 1`` …).
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


def pipeline_for(
    config: TrainConfig, mesh: DeviceMesh, strategy: Any = None
) -> tuple[Pipeline, Any, tuple[list[str], str]]:
    """The pipeline of the config's model, built (a StrategyPipeline under ``strategy``);
    the input shape (one, without the batch) the reference data needs (None for a
    model of several inputs); the model's summary for the run's record."""
    model, loss, metrics, shape, dtype = model_for(config)
    kind = Pipeline if strategy is None else functools.partial(StrategyPipeline, strategy=strategy)
    pipe = kind(
        model,
        mesh,
        micro_batches=config.micro_batches,
        balance=config.balance,
        schedule=config.schedule,
        virtual_stages=config.virtual_stages,
        remat=config.remat,
        prefetch=config.prefetch,
        boundary_dtype=config.boundary_dtype,
        defer_weight_gradients=config.defer_weight_gradients,
    )
    pipe.compile(
        optimizer=optimizer_for(config), loss=loss, metrics=metrics, jit_compile=config.jit_compile
    )
    pipe.build(shape, dtype)
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
    """Trains ``config.model`` on ``config.data`` on ``config.mesh``; resumes from model_dir.

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
        strategy (a ``TPUStrategy`` on the layout of ``devices``: ``StrategyPipeline``).
      stop: once set, the step in flight finishes, is checkpointed (with a model_dir) and
        the run ends early (``TrainResult.interrupted_at``; nothing is exported).

    Raises:
      NonFiniteLossError: the loss became NaN or Inf.
      ValueError: an output path cannot be written (naming it), the model_dir holds
        another run (``ConfigDriftError``), your function raised (``UserFunctionError``).
      RunLockError: another run holds the model_dir.
      CheckpointError: no checkpoint there can be restored, or one cannot be written.
    """
    check_output_paths(config.model_dir, config.export_dir, config.keras_file)
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
            pipe, config.model_dir, config.keep_checkpoints, config.seed, checkpoint_io_device
        )
        if config.model_dir
        else None
    )
    restored = resume.resume(config, pipe, saver, summary, log)
    start = restored.step if restored else 0
    position = restored.data_position if restored else 0
    batches = _batches(config, config.data, config.seed, position, input_shape)
    validation = (
        _batches(config, config.validation_data, config.seed + 1, 0, input_shape)
        if config.validation_data
        else None
    )
    writer = (
        tf.summary.create_file_writer(os.path.join(config.model_dir, "train"))
        if config.model_dir
        else None
    )
    steps = Steps(config, pipe, start, saver, writer, log, step_callback, stop)
    steps.last_checkpoint = restored.path if restored else None
    if config.train_steps > start:
        pipe.fit(
            batches,
            epochs=1,
            steps_per_epoch=config.train_steps - start,
            verbose=0,  # the progress bar, if any, is the Steps callback's (after compiling)
            shuffle=False,  # the batches are a function of (seed, step)
            callbacks=[steps],
            validation_data=validation,
            validation_steps=config.validation_steps,
        )
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
    config: TrainConfig, spec: str, seed: int, position: int, input_shape: Any
) -> tf.data.Dataset:
    """The global batches ``spec`` names (``--data``'s grammar), from batch ``position`` on."""
    if is_function_spec(spec):  # yours: the batches after the ones already taken
        return call_user("data", spec, config.global_batch_size).skip(position)
    if spec.startswith("tfrecord:"):
        return data.tfrecord_dataset(
            spec.partition(":")[2],
            config.tfrecord_features or "",
            config.tfrecord_label,
            config.global_batch_size,
            position,
        )
    return data.dataset(
        spec,
        config.model,
        config.global_batch_size,
        seed,
        start_step=position,
        seq_len=config.seq_len,
        input_shape=input_shape,
    )


def _export(config: TrainConfig, pipe: Pipeline, log: Callable[[str], None]) -> None:
    """The trained model as SavedModels (whole and per stage) and as a .keras file."""
    if config.export_dir:
        pipe.export(config.export_dir)
        pipe.export(os.path.join(config.export_dir, "stages"), per_stage=True)
        log(f"exported SavedModels to {config.export_dir} (per stage: stages/)")
    if config.keras_file:
        pipe.save(config.keras_file)
        log(f"saved the Keras model to {config.keras_file}")
