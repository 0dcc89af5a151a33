"""A flag-free training loop: a frozen config in, a trained pipeline and its history out.

Conceptually::

    pipe = Pipeline(model(config), mesh(config), ...)
    start = restore the newest checkpoint in model_dir (its step), else 0
    pipe.fit(batches from step start + 1 on,            # batch(step) depends only on (seed, step)
             epochs=1, steps_per_epoch=train_steps - start, callbacks=[after each step:
        stop with NonFiniteLossError if loss is NaN/Inf (the last good checkpoint stays)
        log / TensorBoard scalars every log_every steps; checkpoint every checkpoint_every])
    checkpoint at the end

The loop is ``Pipeline.fit``, Keras's own (``--progress_bar`` shows Keras's progress bar),
and everything the launcher does per step is a Keras callback (``hybrid.train_steps``).

so a run killed at any point and started again with the same config finishes with exactly
the weights of an uninterrupted run, and a checkpoint restores onto any mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from hybrid import data, models
from hybrid.checkpoint import Checkpointer, Restored
from hybrid.core.mesh import DeviceMesh, parse_spec
from hybrid.data_sources import is_function_spec
from hybrid.engine.pipeline import Pipeline
from hybrid.engine.strategy_pipeline import StrategyPipeline
from hybrid.train_steps import NonFiniteLossError, StepCallback, Steps

__all__ = [
    "NonFiniteLossError",
    "TrainConfig",
    "TrainResult",
    "build_model",
    "load_function",
    "optimizer_class",
    "optimizer_for",
    "train",
]

_IMAGE_SHAPE = (16, 16, 3)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs.

    Attributes:
      model: "transformer", "resnet" or "mlp" (``hybrid.models``), or yours:
        "package.module:fn" (:func:`_user_model`).
      data: "synthetic", "text:PATH", "text:python-docs" or "package.module:fn"
        (``hybrid.data``).
      tfrecord_features, tfrecord_label: a "tfrecord:PATTERN" source's feature spec (JSON)
        and the name of its label feature.
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
      learning_rate: Adam learning rate.
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
    """

    model: str = "transformer"
    data: str = "text:" + data.BUILTIN_TEXT
    tfrecord_features: str | None = None
    tfrecord_label: str = "label"
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


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """The losses of the steps this call ran, where it started, and the trained pipeline.

    Attributes:
      losses: loss of each step run by this call (steps ``start_step + 1`` …).
      start_step: the step restored from a checkpoint (0 for a fresh run).
      examples_per_second: throughput after the first (compiling) step of this call.
      pipeline: the trained pipeline.
      checkpoint: the last checkpoint written, if any.
    """

    losses: tuple[float, ...]
    start_step: int
    examples_per_second: float
    pipeline: Pipeline
    checkpoint: str | None


def build_model(config: TrainConfig) -> tuple[list[keras.layers.Layer], tuple[int, ...], str]:
    """The reference model's layers, its input shape (without batch) and input dtype."""
    if config.model == "transformer":
        layers = models.transformer(
            vocab_size=data.VOCAB_SIZE,
            seq_len=config.seq_len,
            d_model=config.width,
            num_heads=config.num_heads,
            num_blocks=config.depth,
            dropout=config.dropout,
            seed=config.seed,
            tie_embeddings=config.tie_embeddings,
        )
        return layers, (config.seq_len,), "int32"
    if config.model == "resnet":
        return (
            models.resnet(10, config.width, config.depth, seed=config.seed),
            _IMAGE_SHAPE,
            ("float32"),
        )
    if config.model == "mlp":
        return models.mlp(10, config.width, config.depth, seed=config.seed), (64,), "float32"
    raise ValueError(f"unknown model {config.model!r}; choose one of {list(models.MODEL_NAMES)}")


def _mesh(config: TrainConfig, devices: Sequence[str] | None) -> DeviceMesh:
    stages, replicas = parse_spec(config.mesh)
    if devices is not None:
        return DeviceMesh.from_devices(devices, stages, replicas)
    return DeviceMesh.create(stages, replicas, config.platform.upper())


def load_function(spec: str) -> Callable[..., Any]:
    """The function ``package.module:name`` names (``--model``, ``--data``).

    Raises:
      ValueError: the module cannot be imported or has no such function.
    """
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{spec}: cannot import {module_name!r} ({err}); is it on PYTHONPATH?"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"{spec}: module {module_name!r} has no function {name!r}")
    return function


def _user_model(config: TrainConfig) -> tuple[keras.Model, Any, Any]:
    """Your model, loss and metrics from ``config.model`` (``package.module:fn``): fn()
    returns a dict ``{"model", "loss", "metrics"}`` or a model compiled with its loss."""
    made = load_function(config.model)()
    if isinstance(made, dict):
        model, loss, metrics = made.get("model"), made.get("loss"), made.get("metrics")
    else:
        model, loss, metrics = made, getattr(made, "loss", None), None
    if not isinstance(model, keras.Model) or loss is None:
        raise ValueError(
            f"--model={config.model} must return a Keras model compiled with its loss, or "
            f"{{'model': ..., 'loss': ..., 'metrics': ...}}; got {type(made).__name__}"
        )
    return model, loss, metrics


def optimizer_class(name: str) -> type:
    """The ``keras.optimizers`` class named ``name``, case-insensitively ("adamw": AdamW)."""
    for attribute, cls in vars(keras.optimizers).items():
        if attribute.lower() == name.lower() and isinstance(cls, type):
            return cls
    raise ValueError(f"keras.optimizers has no optimizer {name!r}")


def optimizer_for(config: TrainConfig) -> keras.optimizers.Optimizer:
    """``--optimizer`` at ``--learning_rate`` with ``--optimizer_config``'s arguments, under
    a LossScaleOptimizer for ``mixed_float16`` (as ``compile`` wraps it: a list of layers
    carries no model policy for the Pipeline to see)."""
    cls = optimizer_class(config.optimizer)
    made = cls(learning_rate=config.learning_rate, **json.loads(config.optimizer_config))
    if config.precision == "mixed_float16":
        return keras.optimizers.LossScaleOptimizer(made)
    return made


def _model(config: TrainConfig) -> tuple[Any, Any, Any, Any, Any]:
    """The config's model built under its dtype policy (the global policy is restored after),
    its loss, metrics, input shape(s) with the batch and dtype(s)."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(config.precision)
    try:
        if is_function_spec(config.model):
            model, loss, metrics = _user_model(config)
            shapes = [(None, *t.shape[1:]) for t in model.inputs]
            dtypes = [t.dtype for t in model.inputs]
            if len(shapes) == 1:
                return model, loss, metrics, shapes[0], dtypes[0]
            return model, loss, metrics, shapes, dtypes
        layers, input_shape, dtype = build_model(config)
    finally:
        keras.mixed_precision.set_global_policy(previous)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return layers, loss, None, (None, *input_shape), dtype


def _pipeline(config: TrainConfig, mesh: DeviceMesh, strategy: Any = None) -> tuple[Pipeline, Any]:
    """The pipeline of the config's model, built (a StrategyPipeline under ``strategy``);
    and the input shape (one, without the batch) the reference data needs (None for a
    model of several inputs)."""
    model, loss, metrics, shape, dtype = _model(config)
    kind = Pipeline if strategy is None else functools.partial(StrategyPipeline, strategy=strategy)
    pipe = kind(
        model,
        mesh=mesh,
        loss=loss,
        optimizer=optimizer_for(config),
        micro_batches=config.micro_batches,
        balance=config.balance,
        schedule=config.schedule,
        virtual_stages=config.virtual_stages,
        remat=config.remat,
        jit_compile=config.jit_compile,
        metrics=metrics,
        prefetch=config.prefetch,
        boundary_dtype=config.boundary_dtype,
        defer_weight_gradients=config.defer_weight_gradients,
    )
    pipe.build(shape, dtype)
    pipe.timeline_every = config.timeline_every
    return pipe, None if isinstance(dtype, list) else tuple(shape[1:])


def train(
    config: TrainConfig,
    log: Callable[[str], None] = print,
    step_callback: StepCallback | None = None,
    devices: Sequence[str] | None = None,
    checkpoint_io_device: str | None = None,
    strategy: Any = None,
) -> TrainResult:
    """Trains ``config.model`` on ``config.data`` on ``config.mesh``; resumes from model_dir.

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

    Raises:
      NonFiniteLossError: the loss became NaN or Inf.
    """
    pipe, input_shape = _pipeline(config, _mesh(config, devices), strategy)
    saver = (
        Checkpointer(
            pipe, config.model_dir, config.keep_checkpoints, config.seed, checkpoint_io_device
        )
        if config.model_dir
        else None
    )
    restored = _resume(config, pipe, saver, log)
    start = restored.step if restored else 0
    position = restored.data_position if restored else 0
    if is_function_spec(config.data):  # yours: the batches after the ones already taken
        batches = load_function(config.data)(config.global_batch_size).skip(position)
    elif config.data.startswith("tfrecord:"):
        batches = data.tfrecord_dataset(
            config.data.partition(":")[2],
            config.tfrecord_features or "",
            config.tfrecord_label,
            config.global_batch_size,
            position,
        )
    else:
        batches = data.dataset(
            config.data,
            config.model,
            config.global_batch_size,
            config.seed,
            start_step=position,
            seq_len=config.seq_len,
            input_shape=input_shape,
        )
    writer = (
        tf.summary.create_file_writer(os.path.join(config.model_dir, "train"))
        if config.model_dir
        else None
    )
    steps = Steps(config, pipe, start, saver, writer, log, step_callback)
    steps.last_checkpoint = restored.path if restored else None
    if config.train_steps > start:
        pipe.fit(
            batches,
            epochs=1,
            steps_per_epoch=config.train_steps - start,
            verbose=1 if config.progress_bar else 0,
            shuffle=False,  # the batches are a function of (seed, step)
            callbacks=[steps],
        )
    if writer is not None:
        writer.flush()
    _export(config, pipe, log)
    return TrainResult(
        tuple(steps.losses),
        start,
        steps.progress.examples_per_second,
        pipe,
        steps.last_checkpoint,
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


def _resume(
    config: TrainConfig,
    pipe: Pipeline,
    saver: Checkpointer | None,
    log: Callable[[str], None],
) -> Restored | None:
    """Restores the newest checkpoint (if any) and logs the layout and where training starts."""
    restored = saver.restore_latest(log) if saver else None
    mesh = pipe.mesh
    log(
        f"mesh {mesh.spec} devices {[d for row in mesh.devices for d in row]} "
        f"balance {pipe.balance} micro_batches {config.micro_batches} schedule {config.schedule} "
        f"remat {config.remat}" + " deferred weight gradients" * config.defer_weight_gradients
    )
    if restored:
        log(f"restored {restored.path}: resuming at step {restored.step + 1}")
    return restored
