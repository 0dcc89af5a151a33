"""The files of a run's ``--model_dir`` as a directory listing sees them, independent of the
``checkpoint`` state file that ``tf.train.CheckpointManager`` keeps::

    model_dir/
      checkpoint                 the state file: the newest checkpoint and the ones kept
      ckpt-<N>.index             checkpoint N (its index and data shards)
      ckpt-<N>.data-*-of-*
      ckpt-<N>_temp/             a save in progress (left behind by a failed one)
      run_config.json, LOCK      the run's record and its lock (hybrid.run.run_record, run_lock)
      train/, profile/, timeline/   TensorBoard events, traces, Gantt charts

Everything goes through ``tf.io.gfile``, so ``gs://`` directories work as local ones do.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

import tensorflow as tf

__all__ = [
    "STATE_FILE",
    "candidates",
    "checkpoint_files",
    "listed_checkpoints",
    "move_aside",
    "remove_partial_save",
    "remove_unfinished_saves",
    "rewrite_state",
    "state_file_problem",
]

STATE_FILE = "checkpoint"
_INDEX = re.compile(r"^ckpt-(\d+)\.index$")
_CHECKPOINT_FILE = re.compile(r"^ckpt-\d+(\.index|\.data-\d+-of-\d+|_temp)$")


def _join(directory: str, name: str) -> str:
    return directory.rstrip("/") + "/" + name


def _names(directory: str) -> list[str]:
    if not tf.io.gfile.isdir(directory):
        return []
    return [name.rstrip("/") for name in tf.io.gfile.listdir(directory)]


def listed_checkpoints(directory: str) -> list[str]:
    """The paths of every ``ckpt-<N>`` with an index file in ``directory``, oldest first
    (by N), whatever the state file says."""
    found = [(int(m.group(1)), name) for name in _names(directory) if (m := _INDEX.match(name))]
    return [_join(directory, f"ckpt-{step}") for step, _ in sorted(found)]


def checkpoint_files(directory: str, unfinished: bool = True) -> list[str]:
    """The names of the checkpoint files in ``directory``: the state file, every ``ckpt-<N>``
    index and data file, and (with ``unfinished``) leftover ``ckpt-<N>_temp`` folders."""
    return sorted(
        n
        for n in _names(directory)
        if n == STATE_FILE or (_CHECKPOINT_FILE.match(n) and (unfinished or "_temp" not in n))
    )


def remove_unfinished_saves(directory: str) -> list[str]:
    """Deletes the ``ckpt-<N>_temp`` folders of saves that never finished (a run killed
    while saving; call it only while holding the directory's lock) and returns them."""
    found = [n for n in checkpoint_files(directory) if n.endswith("_temp")]
    for name in found:
        tf.io.gfile.rmtree(_join(directory, name))
    return found


def state_file_problem(directory: str) -> str | None:
    """Why the state file cannot name the latest checkpoint ("missing", "unreadable", or
    "names no checkpoint"); None when it names one."""
    path = _join(directory, STATE_FILE)
    if not tf.io.gfile.exists(path):
        return "missing"
    try:
        state = tf.train.get_checkpoint_state(directory)
    except Exception:  # noqa: BLE001 - whatever the parser raises, the file is unusable
        state = None
    if state is None:
        return "unreadable"
    return None if state.model_checkpoint_path else "names no checkpoint"


def move_aside(directory: str, names: list[str]) -> str:
    """Moves ``names`` (files or folders of ``directory``) into a new folder
    ``directory/aside-<UTC time>`` and returns its path; nothing is deleted."""
    base = _join(directory, time.strftime("aside-%Y%m%d-%H%M%S", time.gmtime()))
    aside, suffix = base, 1
    while tf.io.gfile.exists(aside):  # twice in one second
        suffix += 1
        aside = f"{base}.{suffix}"
    tf.io.gfile.makedirs(aside)
    for name in names:
        tf.io.gfile.rename(_join(directory, name), _join(aside, name))
    return aside


def remove_partial_save(directory: str, step: int) -> None:
    """Deletes what a failed save of ``ckpt-<step>`` left: its ``_temp`` folder and any of
    its index or data files (the state file never named them)."""
    prefix = f"ckpt-{step}"
    for name in _names(directory):
        if name == prefix + "_temp" and tf.io.gfile.isdir(_join(directory, name)):
            tf.io.gfile.rmtree(_join(directory, name))
        elif name == prefix + ".index" or name.startswith(prefix + ".data-"):
            tf.io.gfile.remove(_join(directory, name))


def _step(path: str) -> int:
    return int(path.rsplit("-", 1)[1])


def candidates(directory: str, tracked: Sequence[str], log: Callable[[str], None]) -> list[str]:
    """Every checkpoint to try restoring, newest first: those the state file names
    (``tracked``) and those a listing finds; a missing or unreadable state file is reported
    through ``log`` with the newest checkpoint found instead."""
    listed = listed_checkpoints(directory)
    problem = state_file_problem(directory)
    if listed and problem is not None:
        log(
            f"WARNING the checkpoint state file {_join(directory, STATE_FILE)} is {problem}; "
            f"found {len(listed)} checkpoints by listing the directory, the newest {listed[-1]}"
        )
    paths = {p.rsplit("/", 1)[-1]: p for p in [*listed, *tracked]}
    return sorted(paths.values(), key=_step, reverse=True)


def rewrite_state(directory: str, latest: str, keep: int) -> None:
    """Rewrites the state file to name ``latest`` and the ``keep`` listed checkpoints up to
    it, so that the next save continues from there (``tf.train.CheckpointManager`` reads
    the file when it is made)."""
    kept = [p for p in listed_checkpoints(directory) if _step(p) <= _step(latest)][-keep:]
    times = [tf.io.gfile.stat(p + ".index").mtime_nsec / 1e9 for p in kept]
    tf.compat.v1.train.update_checkpoint_state(
        directory,
        latest,
        all_model_checkpoint_paths=kept,
        all_model_checkpoint_timestamps=times,
        last_preserved_timestamp=min(times) - 1,  # none kept forever: `keep` applies
    )
