"""How a run takes over its model directory and continues what is in it.

Conceptually (``train`` does this before its first step)::

    with RunLock(model_dir):                     # one run per directory (hybrid.run.run_lock)
        fresh_start? move every checkpoint file and the record into model_dir/aside-<time>
        build the pipeline
        checkpoints there and a record? compare it with this run (hybrid.run.run_record):
            a change of what is trained -> ConfigDriftError naming each field
            other changes -> logged
        restore the newest readable checkpoint (hybrid.run.checkpoint: all unreadable -> error)
        set the learning rate to this run's (the rule: the configuration's value applies)
        write this run's record
        ... train ...
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf

from hybrid.engine.api.pipeline import Pipeline
from hybrid.run import model_dir, run_record
from hybrid.run.checkpoint import Checkpointer, Restored
from hybrid.run.output_paths import MODEL_DIR_FOLDERS
from hybrid.run.run_lock import RunLock

if TYPE_CHECKING:
    from hybrid.run.train_config import TrainConfig

__all__ = [
    "describe_model",
    "learning_rate",
    "lock",
    "resume",
    "set_learning_rate",
    "start_afresh",
]


@contextlib.contextmanager
def lock(config: TrainConfig, log: Callable[[str], None]) -> Iterator[None]:
    """Holds the model directory's lock for the body (no lock without a model_dir)."""
    if not config.outputs.model_dir:
        yield
        return
    with RunLock(config.outputs.model_dir, take_over=config.outputs.take_over_lock, log=log):
        yield


def start_afresh(config: TrainConfig, log: Callable[[str], None]) -> None:
    """``fresh_start``: moves the directory's checkpoint files, record and the folders of
    the run's other outputs (TensorBoard events, timelines, profiles) aside."""
    directory = config.outputs.model_dir
    if not (directory and config.outputs.fresh_start):
        return
    names = model_dir.checkpoint_files(directory)
    if run_record.read(directory) is not None:
        names.append(run_record.RECORD_FILE)
    folders = [f for f in MODEL_DIR_FOLDERS if tf.io.gfile.isdir(os.path.join(directory, f))]
    if names or folders:
        aside = model_dir.move_aside(directory, names + folders)
        also = f" and {', '.join(f + '/' for f in folders)}" if folders else ""
        log(f"--fresh_start: moved {len(names)} files{also} to {aside}; starting from step 1")


def describe_model(model: Any, loss: Any) -> tuple[list[str], str]:
    """The record's layer summary of a built model (a Keras model or a list of layers):
    each layer's class, dtype policy and weight shapes; and the loss by name."""
    layers = model.layers if isinstance(model, keras.Model) else list(model)
    summary = [
        f"{type(layer).__name__} {layer.dtype_policy.name} "
        + str([list(w.shape) for w in layer.weights])
        for layer in layers
    ]
    name = getattr(loss, "__name__", None) or (loss if isinstance(loss, str) else None)
    return summary, str(name or type(loss).__name__)


def _fields(config: TrainConfig) -> dict[str, Any]:
    """The config by its flat names (``TrainConfig.flat``) as JSON values (tuples as
    lists): the run record's form."""
    return json.loads(json.dumps(config.flat()))


def set_learning_rate(pipe: Pipeline, rate: float) -> None:
    """Every optimizer copy's learning rate (a restore sets the checkpoint's) to ``rate``."""
    for row in pipe.stages:
        for copy in row:
            if copy.optimizer is not None:
                copy.optimizer.learning_rate = rate


def learning_rate(pipe: Pipeline) -> float:
    """The learning rate the optimizer uses now (stage 0, replica 0)."""
    optimizer = pipe.stages[0][0].optimizer
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate)) if optimizer else 0.0


def _check_record(config: TrainConfig, summary: tuple[list[str], str]) -> run_record.Changes:
    """The changes from the directory's record to this run (none without checkpoints).

    Raises:
      ConfigDriftError: a change of what is trained, each field named.
    """
    assert config.outputs.model_dir
    record = run_record.read(config.outputs.model_dir)
    if record is None or not model_dir.checkpoint_files(config.outputs.model_dir, unfinished=False):
        return run_record.Changes()
    changes = run_record.compare(record, _fields(config), *summary)
    if changes.refused:
        raise run_record.ConfigDriftError(
            f"--model_dir={config.outputs.model_dir} was trained as another run: "
            + "; ".join(changes.refused)
            + ". Resume with the checkpoint's values, or start another run: another "
            "--model_dir, or --fresh_start (moves these checkpoints aside)"
        )
    return changes


def resume(
    config: TrainConfig,
    pipe: Pipeline,
    saver: Checkpointer | None,
    summary: tuple[list[str], str],
    log: Callable[[str], None],
) -> Restored | None:
    """Checks the record, restores the newest checkpoint (if any), applies the learning
    rate and writes this run's record; logs the layout and where training starts.

    Raises:
      ConfigDriftError: the checkpoints were trained as something else (each field named).
    """
    changes, restored = run_record.Changes(), None
    if saver is not None and config.outputs.model_dir:
        changes = _check_record(config, summary)
        for name in model_dir.remove_unfinished_saves(config.outputs.model_dir):
            log(f"removed {config.outputs.model_dir}/{name}, a save an earlier run did not finish")
        restored = saver.restore_latest(log)
    mesh = pipe.mesh
    log(
        f"mesh {mesh.spec} devices {[d for row in mesh.devices for d in row]} "
        f"balance {pipe.balance} micro_batches {config.layout.micro_batches} "
        f"schedule {config.layout.schedule} remat {config.layout.remat}"
        + " deferred weight gradients"
        * config.layout.defer_weight_gradients
    )
    if restored:
        set_learning_rate(pipe, config.optimizer.learning_rate)  # the rule: this run's rate applies
        for change in changes.applied:
            log(f"resuming with a change: {change}")
        if changes.learning_rate is not None:
            old, new = changes.learning_rate
            log(f"learning rate {new} (--learning_rate) applies; the checkpoint's run used {old}")
        log(f"restored {restored.path}: resuming at step {restored.step + 1}")
    if saver is not None and config.outputs.model_dir:
        run_record.write(config.outputs.model_dir, _fields(config), *summary)
    return restored
