"""Checkpoints of a Pipeline, saved per model layer so they restore onto any mesh.

What one checkpoint holds (``tf.train.Checkpoint`` object graph)::

    model/layer_007/w1                 weight 1 of model layer 7 (replica 0's copy)
    optimizer/layer_007/w1/momentum    that weight's optimizer slot(s), by slot name
    optimizer/iteration, learning_rate the optimizer's scalars (equal on every device)
    meta/step, data_position, seed     optimizer steps taken, batches consumed, data seed

Keys name model layers and weights, never devices or stages: a checkpoint written on a 2×2
mesh restores onto a 4×1 mesh or a 1×2 mesh with another balance, because every device's
copy is found by its layers' global indices. Replicas are identical, so only replica 0's
copy is written; a restore fills replica 0 and copies it to the other replicas.

Writing goes through ``tf.train.CheckpointManager``: the data and index files of
``ckpt-<step>`` are complete before the ``checkpoint`` state file names them (TensorFlow
writes that file atomically), so a process killed while saving leaves the previous
checkpoint as the latest. A checkpoint that turns out unreadable is skipped for the one
before it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from hybrid.engine.pipeline import Pipeline
from hybrid.engine.stage import StageReplica

__all__ = ["CheckpointError", "Checkpointer", "Restored"]


class CheckpointError(RuntimeError):
    """A checkpoint that does not fit the pipeline (other model, other optimizer, seed)."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What a restore found: the checkpoint's path, its step and data position."""

    path: str
    step: int
    data_position: int


def _optimizer(stage: StageReplica) -> Any:
    if stage.optimizer is None:
        raise CheckpointError(f"stage {stage.index} on {stage.device} has no optimizer to save")
    return stage.optimizer


def _layer_key(index: int) -> str:
    return f"layer_{index:03d}"


def _stage_layers(pipe: Pipeline, replica: int) -> Iterator[tuple[int, Any, StageReplica]]:
    """(global layer index, layer copy, its StageReplica) over the model, for one replica."""
    index = 0
    for row in pipe.stages:
        stage = row[replica]
        for layer in stage.layers:
            yield index, layer, stage
            index += 1


def _slot_map(stage: StageReplica, first_layer: int) -> dict[int, tuple[str, str, str]]:
    """id(optimizer variable) -> (layer key, weight key, slot name) for one stage copy.

    Keras names a slot ``{variable.path with '/' -> '_'}_{slot}``; the longest matching
    prefix identifies its model variable (ties, from equal paths, are taken in order).
    """
    prefixes: dict[str, list[tuple[str, str]]] = {}
    for offset, layer in enumerate(stage.layers):
        for j, variable in enumerate(layer.weights):
            if variable.trainable:
                prefix = variable.path.replace("/", "_") + "_"
                prefixes.setdefault(prefix, []).append((_layer_key(first_layer + offset), f"w{j}"))
    taken: dict[tuple[str, str], int] = {}
    found = {}
    optimizer = _optimizer(stage)
    for variable in optimizer.variables:
        if _is_scalar(optimizer, variable):
            continue
        matches = [p for p in prefixes if variable.name.startswith(p)]
        if not matches:
            raise CheckpointError(
                f"optimizer variable {variable.path!r} of stage {stage.index} belongs to no "
                f"model weight; {type(optimizer).__name__} keeps state that cannot be saved "
                "per layer"
            )
        prefix = max(matches, key=len)
        slot = variable.name[len(prefix) :]
        count = taken.get((prefix, slot), 0)
        taken[(prefix, slot)] = count + 1
        layer_key, weight_key = prefixes[prefix][count]
        found[id(variable)] = (layer_key, weight_key, slot)
    return found


def _trackables(pipe: Pipeline, meta: dict[str, tf.Variable]) -> dict[str, Any]:
    """The object graph of replica 0: model weights, optimizer slots and scalars, meta."""
    model: dict[str, dict[str, Any]] = {}
    slots: dict[str, Any] = {}
    first = 0
    for row in pipe.stages:
        stage = row[0]
        for offset, layer in enumerate(stage.layers):
            model[_layer_key(first + offset)] = {
                f"w{j}": v.value for j, v in enumerate(layer.weights)
            }
        by_id = _slot_map(stage, first)
        for variable in _optimizer(stage).variables:
            if id(variable) in by_id:
                layer_key, weight_key, slot = by_id[id(variable)]
                slots.setdefault(layer_key, {}).setdefault(weight_key, {})[slot] = variable.value
        first += len(stage.layers)
    optimizer = _optimizer(pipe.stages[0][0])
    slots["iteration"] = optimizer.iterations.value
    for variable in optimizer.variables:
        if variable.name == "learning_rate":
            slots["learning_rate"] = variable.value
    return {"model": model, "optimizer": slots, "meta": meta}


def _is_scalar(optimizer: Any, variable: Any) -> bool:
    """The optimizer's own scalars (step count, learning rate), not a per-weight slot."""
    return variable is optimizer.iterations or variable.name == "learning_rate"


def _copy_replica_zero(pipe: Pipeline) -> None:
    """Every copy takes replica 0's weights and slots, every optimizer stage 0's scalars."""
    first = _optimizer(pipe.stages[0][0])
    scalars = {v.name: v for v in first.variables if _is_scalar(first, v)}
    for row in pipe.stages:
        source = row[0]
        for copy in row:
            optimizer = _optimizer(copy)
            for variable in optimizer.variables:
                if _is_scalar(optimizer, variable) and variable is not scalars[variable.name]:
                    variable.assign(scalars[variable.name])
            if copy is source:
                continue
            for a, b in zip(copy.layers, source.layers, strict=True):
                for va, vb in zip(a.weights, b.weights, strict=True):
                    va.assign(vb)
            for va, vb in zip(optimizer.variables, _optimizer(source).variables, strict=True):
                if not _is_scalar(optimizer, va):
                    va.assign(vb)


class Checkpointer:
    """Saves and restores one Pipeline's state in ``directory``, ``keep`` checkpoints kept.

    Args:
      pipe: a built Pipeline with optimizers.
      directory: where ``ckpt-<step>`` files and the ``checkpoint`` state file live.
      keep: how many recent checkpoints to keep.
      seed: the data seed of the run; a checkpoint written with another one is refused.
      io_device: the device whose host reads and writes the files (default: each variable's
        own host). A client of a multi-host job passes its own CPU, so the files land on
        the client's file system whichever task holds the variables.
    """

    def __init__(
        self,
        pipe: Pipeline,
        directory: str,
        keep: int = 3,
        seed: int = 0,
        io_device: str | None = None,
    ) -> None:
        if not pipe.built:
            raise ValueError("build the pipeline before creating its Checkpointer")
        if keep < 1:
            raise ValueError(f"keep must be at least 1 checkpoint, got {keep}")
        self.pipe, self.directory, self.seed = pipe, directory, seed
        self._options = tf.train.CheckpointOptions(experimental_io_device=io_device)
        with tf.device("/device:CPU:0"):
            self._meta = {
                "step": tf.Variable(0, dtype=tf.int64, trainable=False),
                "data_position": tf.Variable(0, dtype=tf.int64, trainable=False),
                "seed": tf.Variable(seed, dtype=tf.int64, trainable=False),
                "layers": tf.Variable(
                    sum(len(row[0].layers) for row in pipe.stages), dtype=tf.int64, trainable=False
                ),
            }
        self._checkpoint = tf.train.Checkpoint(**_trackables(pipe, self._meta))
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, directory, max_to_keep=keep, checkpoint_name="ckpt"
        )

    @property
    def latest(self) -> str | None:
        return self._manager.latest_checkpoint

    def save(self, step: int, data_position: int | None = None) -> str:
        """Writes ``ckpt-<step>``: the pipeline now, after ``step`` optimizer steps."""
        self._meta["step"].assign(step)
        self._meta["data_position"].assign(step if data_position is None else data_position)
        self._meta["seed"].assign(self.seed)
        return str(self._manager.save(checkpoint_number=step, options=self._options))

    def restore(self, path: str) -> Restored:
        """Loads ``path`` into every replica; sets the pipeline's step counter.

        Raises:
          CheckpointError: the checkpoint holds another model, optimizer or seed.
        """
        self._check_layout(path)
        status = self._checkpoint.restore(path, options=self._options)
        try:
            status.assert_consumed()
        except AssertionError as err:
            raise CheckpointError(
                f"checkpoint {path} does not match this pipeline's optimizer or model "
                f"({err}); restore it with the optimizer and model it was written with"
            ) from err
        seed = int(self._meta["seed"].numpy())
        if seed != self.seed:
            raise CheckpointError(
                f"checkpoint {path} was written by a run with seed {seed}, this run has seed "
                f"{self.seed}; resume with seed={seed} or start in a new directory"
            )
        _copy_replica_zero(self.pipe)
        step = int(self._meta["step"].numpy())
        self.pipe.step_counter.assign(step)
        return Restored(path, step, int(self._meta["data_position"].numpy()))

    def restore_latest(self, log: Callable[[str], None] = lambda _: None) -> Restored | None:
        """Restores the newest readable checkpoint in the directory; None if there is none.

        An unreadable checkpoint (a truncated file) is reported through ``log`` and the one
        before it is tried; a checkpoint of another model raises at once.
        """
        for path in reversed(self._manager.checkpoints):
            try:
                return self.restore(path)
            except (tf.errors.OpError, IndexError) as err:  # how the reader reports torn files
                log(f"checkpoint {path} is unreadable ({type(err).__name__}); trying an older one")
        return None

    def _check_layout(self, path: str) -> None:
        """Clear errors for a checkpoint of another model, before TensorFlow's own."""
        reader = tf.train.load_checkpoint(path)
        shapes = reader.get_variable_to_shape_map()
        saved: dict[str, list[int]] = {}
        for key, shape in shapes.items():
            parts = key.split("/")
            if parts[0] == "model" and len(parts) > 2:
                saved[f"{parts[1]}/{parts[2]}"] = shape
        mine = {
            f"{_layer_key(i)}/w{j}": list(v.shape)
            for i, layer, _ in _stage_layers(self.pipe, 0)
            for j, v in enumerate(layer.weights)
        }
        layers_saved = int(reader.get_tensor("meta/layers/.ATTRIBUTES/VARIABLE_VALUE"))
        layers_mine = int(self._meta["layers"].numpy())
        if layers_saved != layers_mine:
            raise CheckpointError(
                f"checkpoint {path} holds a model of {layers_saved} layers, this pipeline's "
                f"model has {layers_mine}; restore with the model it was written with or start in "
                "a new directory"
            )
        for key, shape in mine.items():
            if saved.get(key) != shape:
                raise CheckpointError(
                    f"checkpoint {path}: weight {key} has shape {saved.get(key)}, this model's "
                    f"has {shape}; restore with the model it was written with or start in a "
                    "new directory"
                )


def latest_step(directory: str) -> int | None:
    """The step of the newest checkpoint in ``directory`` (None when there is none)."""
    path = tf.train.latest_checkpoint(directory) if os.path.isdir(directory) else None
    return int(path.rsplit("-", 1)[1]) if path else None
