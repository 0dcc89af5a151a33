"""Checkpoints of a Pipeline, saved per model variable so they restore onto any mesh.

What one checkpoint holds (``tf.train.Checkpoint`` object graph)::

    model/v0007                        model variable 7 (``model.weights[7]``), owner's copy
    optimizer/v0007/momentum           that variable's optimizer slot(s), by slot name
    optimizer/iteration, learning_rate the optimizer's scalars (equal on every device; under
    optimizer/dynamic_scale, ...       a LossScaleOptimizer its scale, its inner's inner_*)
    meta/step, data_position, seed     optimizer steps taken, batches consumed, data seed

Keys name model variables, never devices or stages: a checkpoint written on a 2×2 mesh
restores onto a 4×1 mesh or a 1×2 mesh with another balance, because every device's copy is
found by its variable's index in the model. Replicas (and the copies of a tied variable) are
identical, so only the owning stage's replica-0 copy is written (a slot from the replica
that holds it when optimizer states are sharded: the form is the same, so a checkpoint moves
between sharded and unsharded runs); a restore fills it and copies it to the others.

Writing goes through ``tf.train.CheckpointManager``: the data and index files of
``ckpt-<step>`` are complete before the ``checkpoint`` state file names them (TensorFlow
writes that file atomically), so a process killed while saving leaves the previous
checkpoint as the latest. A checkpoint that turns out unreadable is skipped for the one
before it; the checkpoints are found by listing the directory too, so a missing or garbled
state file loses nothing (it is rewritten after the restore). A directory that holds
checkpoint files of which none can be restored raises :class:`UnreadableCheckpointsError`
rather than starting again over them; a save that fails (a full disk, permissions) removes
what it had written and raises :class:`CheckpointError`, the previous checkpoints intact.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from hybrid.engine.api.pipeline import Pipeline
from hybrid.engine.model.graph import graph_of
from hybrid.engine.step import optimizer_state
from hybrid.engine.step.stage import StageReplica
from hybrid.run import model_dir

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "Restored",
    "UnreadableCheckpointsError",
    "error_line",
    "to_keras",
]


class CheckpointError(RuntimeError):
    """A checkpoint that does not fit the pipeline (other model, other optimizer, seed), or
    one that could not be written."""


class UnreadableCheckpointsError(CheckpointError):
    """The directory holds checkpoint files, but none of them can be restored."""


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


def _variable_key(index: int) -> str:
    return f"v{index:04d}"


def _trackables(pipe: Pipeline, meta: dict[str, tf.Variable]) -> dict[str, Any]:
    """The object graph of replica 0: each model variable and its optimizer slots from the
    stage that owns it, the optimizer's scalars, meta."""
    indices = optimizer_state.global_indices(pipe.stages, pipe.placement)
    model: dict[str, Any] = {}
    slots: dict[str, Any] = {}
    for i, copies in enumerate(pipe.placement.holders):
        k, j = copies[0]
        model[_variable_key(i)] = pipe.stages[k][0].variables[j].value
    for k, row in enumerate(pipe.stages):
        for (i, slot), variable in optimizer_state.row_slots(row, indices[k]).items():
            if pipe.placement.holders[i][0][0] == k:
                slots.setdefault(_variable_key(i), {})[slot] = variable.value
    for path, variable in optimizer_state.scalars(pipe.stages[0][0]).items():
        slots[path] = variable.value
    return {"model": model, "optimizer": slots, "meta": meta}


def _copy_owners(pipe: Pipeline) -> None:
    """Every copy of a variable (other replicas, other stages of a tied one) and its slots
    take the owner's replica-0 values; every optimizer takes stage 0's scalars."""
    scalars = optimizer_state.scalars(pipe.stages[0][0])
    indices = optimizer_state.global_indices(pipe.stages, pipe.placement)
    slots = [
        [optimizer_state.slots(copy, indices[k]) for copy in row]
        for k, row in enumerate(pipe.stages)
    ]
    for row in pipe.stages:
        for copy in row:
            for path, variable in optimizer_state.scalars(copy).items():
                if variable is not scalars[path]:
                    variable.assign(scalars[path])
    for i, ((k0, j0), *_) in enumerate(pipe.placement.holders):
        source = pipe.stages[k0][0].variables[j0]
        held = optimizer_state.row_slots(pipe.stages[k0], indices[k0])
        source_slots = {s: v for (n, s), v in held.items() if n == i}
        for k, j in pipe.placement.holders[i]:
            for r, copy in enumerate(pipe.stages[k]):
                if copy.variables[j] is not source:
                    copy.variables[j].assign(source)
                for (n, slot), variable in slots[k][r].items():
                    if n == i and variable is not source_slots[slot]:
                        variable.assign(source_slots[slot])


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
                "variables": tf.Variable(
                    len(pipe.placement.variables), dtype=tf.int64, trainable=False
                ),
            }
        try:
            trackables = _trackables(pipe, self._meta)
        except ValueError as err:  # optimizer state that belongs to no model variable
            raise CheckpointError(f"the pipeline cannot be checkpointed: {err}") from err
        self._bytes = sum(
            v.shape.num_elements() * v.dtype.size for v in tf.nest.flatten(trackables)
        )
        self._slot_names = {
            k.split("/")[1] for k in _flat_keys(trackables["optimizer"]) if "/" in k
        }
        self._checkpoint = tf.train.Checkpoint(**trackables)
        self._keep = keep
        self._manager = self._new_manager()

    def _new_manager(self) -> tf.train.CheckpointManager:
        return tf.train.CheckpointManager(
            self._checkpoint, self.directory, max_to_keep=self._keep, checkpoint_name="ckpt"
        )

    @property
    def latest(self) -> str | None:
        return self._manager.latest_checkpoint

    def save(self, step: int, data_position: int | None = None) -> str:
        """Writes ``ckpt-<step>``: the pipeline now, after ``step`` optimizer steps."""
        self._meta["step"].assign(step)
        self._meta["data_position"].assign(step if data_position is None else data_position)
        self._meta["seed"].assign(self.seed)
        try:
            return str(self._manager.save(checkpoint_number=step, options=self._options))
        except (tf.errors.OpError, OSError) as err:
            if f"ckpt-{step}" not in [os.path.basename(p) for p in self._manager.checkpoints]:
                model_dir.remove_partial_save(self.directory, step)
            raise CheckpointError(self._save_failure(step, err)) from err

    def _save_failure(self, step: int, err: Exception) -> str:
        """One line: which checkpoint failed where, why, the bytes it needs, what is kept."""
        reason = error_line(err)
        try:
            free = f", {shutil.disk_usage(self.directory).free} bytes free there"
        except OSError:  # not a local directory (gs://...)
            free = ""
        kept = self.latest or "none"
        return (
            f"could not write checkpoint ckpt-{step} in {self.directory} ({reason}); it needs "
            f"about {self._bytes} bytes{free}; the previous checkpoints are intact (newest: "
            f"{kept}); free space or fix the permissions, then run the same command to resume"
        )

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
            raise CheckpointError(self._mismatch(path)) from err
        seed = int(self._meta["seed"].numpy())
        if seed != self.seed:
            raise CheckpointError(
                f"checkpoint {path} was written by a run with seed {seed}, this run has seed "
                f"{self.seed}; resume with seed={seed} or start in a new directory"
            )
        _copy_owners(self.pipe)
        step = int(self._meta["step"].numpy())
        self.pipe.step_counter.assign(step)
        return Restored(path, step, int(self._meta["data_position"].numpy()))

    def _mismatch(self, path: str) -> str:
        """Why a checkpoint's object graph differs from this pipeline's: the optimizer slots
        each holds per weight (their names, no protobuf dump)."""
        keys = tf.train.load_checkpoint(path).get_variable_to_shape_map()
        saved = {m.group(1) for k in keys if (m := _SLOT_KEY.match(k))}
        optimizer = type(_optimizer(self.pipe.stages[0][0])).__name__
        return (
            f"checkpoint {path} does not match this pipeline's optimizer or model: it holds "
            f"the optimizer slots {sorted(saved)} per weight, this pipeline's {optimizer} keeps "
            f"{sorted(self._slot_names)}; restore "
            "it with the optimizer and model it was written with"
        )

    def restore_latest(self, log: Callable[[str], None] = lambda _: None) -> Restored | None:
        """Restores the newest readable checkpoint in the directory; None if there is none.

        The checkpoints are the state file's and those a listing of the directory finds (a
        missing or unreadable state file is reported through ``log`` and rewritten after the
        restore). An unreadable checkpoint (a truncated file) is reported through ``log``
        and the one before it is tried; a checkpoint of another model raises at once.

        Raises:
          UnreadableCheckpointsError: the directory holds checkpoint files, none restorable.
          CheckpointError: the newest readable checkpoint is of another model or seed.
        """
        failures = []
        for path in model_dir.candidates(self.directory, self._manager.checkpoints, log):
            try:
                restored = self.restore(path)
            except (tf.errors.OpError, IndexError) as err:  # how the reader reports torn files
                failures.append(f"{os.path.basename(path)}: {type(err).__name__}")
                log(f"checkpoint {path} is unreadable ({type(err).__name__}); trying an older one")
                continue
            if model_dir.state_file_problem(self.directory) is not None or failures:
                model_dir.rewrite_state(self.directory, path, self._keep)
                self._manager = self._new_manager()  # it reads the state file when made
            return restored
        files = model_dir.checkpoint_files(self.directory, unfinished=False)
        if files:
            found = "; ".join(failures[:3]) + (
                f"; ... {len(failures)} in all" * (len(failures) > 3)
            )
            found = found or f"no ckpt-<N>.index among {files}"
            raise UnreadableCheckpointsError(
                f"{self.directory} holds checkpoint files but none can be restored ({found}); "
                "repair or remove them, point --model_dir at another directory, or pass "
                "--fresh_start to move them aside (into an aside-<time> folder there) and "
                "start from step 1"
            )
        return None

    def _check_layout(self, path: str) -> None:
        """Clear errors for a checkpoint of another model, before TensorFlow's own."""
        _check_model(
            tf.train.load_checkpoint(path),
            path,
            self.pipe.placement.variables,
            "this pipeline's model",
            "restore with the model it was written with or start in a new directory",
        )


def error_line(err: BaseException) -> str:
    """A TensorFlow (or OS) error as one line: its first line, without the op's
    ``{{function_node ...}}`` prefix and ``[Op:...]`` suffix."""
    text = (getattr(err, "message", None) or str(err)).strip()
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\]", "", text)
    return text.splitlines()[0] if text else type(err).__name__


_SLOT_KEY = re.compile(r"^optimizer/v\d+/([^/]+)/")


def _flat_keys(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """The '/'-joined paths of a nested dict's leaves."""
    keys = []
    for name, value in tree.items():
        if isinstance(value, dict):
            keys += _flat_keys(value, f"{prefix}{name}/")
        else:
            keys.append(prefix + name)
    return keys


def _check_model(reader: Any, path: str, variables: Sequence[Any], whose: str, remedy: str) -> None:
    """Raises CheckpointError unless the checkpoint holds as many model variables as
    ``variables`` (``whose`` they are), each of the same shape; the message ends in ``remedy``."""
    count = int(reader.get_tensor("meta/variables/.ATTRIBUTES/VARIABLE_VALUE"))
    if count != len(variables):
        raise CheckpointError(
            f"checkpoint {path} holds a model of {count} variables, {whose} has "
            f"{len(variables)}; {remedy}"
        )
    shapes = reader.get_variable_to_shape_map()
    for i, variable in enumerate(variables):
        key, shape = _variable_key(i), list(variable.shape)
        saved = shapes.get(f"model/{key}/.ATTRIBUTES/VARIABLE_VALUE")
        if saved != shape:
            raise CheckpointError(
                f"checkpoint {path}: weight {key} ({variable.path}) has shape {saved}, this "
                f"model's has {shape}; {remedy}"
            )


def latest_step(directory: str) -> int | None:
    """The step of the newest checkpoint in ``directory`` (None when there is none)."""
    path = tf.train.latest_checkpoint(directory) if os.path.isdir(directory) else None
    return int(path.rsplit("-", 1)[1]) if path else None


def to_keras(directory: str, model: keras.Model, save_to: str | None = None) -> keras.Model:
    """The model weights of the latest checkpoint in ``directory`` (or of the checkpoint
    ``directory`` names) written into ``model``, a built Keras model of the same
    architecture; no mesh or pipeline is needed. Saved as a ``.keras`` file when
    ``save_to`` is given.

    Raises:
      CheckpointError: the checkpoint holds another number or shape of variables.
    """
    path = tf.train.latest_checkpoint(directory) or directory
    reader = tf.train.load_checkpoint(path)
    variables = graph_of(model).variables()
    _check_model(reader, path, variables, "the model given", "build the model it was written from")
    for i, variable in enumerate(variables):
        variable.assign(reader.get_tensor(f"model/{_variable_key(i)}/.ATTRIBUTES/VARIABLE_VALUE"))
    if save_to is not None:
        model.save(save_to)
    return model
