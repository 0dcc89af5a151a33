"""Every path a run writes, checked before any work (no TensorFlow).

    model_dir     a directory (made if absent) with train/ (TensorBoard), profile/,
                  timeline/ (Gantt charts) in it
    export_dir    a directory made at the end: must not hold files yet
    keras_file    a file written at the end: must not exist yet

Each must be creatable: not a regular file where a directory goes, not under a regular
file, in a directory this process may write. Object-store paths (``gs://...``) are left to
the store. A refusal is a ``ValueError`` naming the option (``--name=value``) and the fix.
What draws an output must be installed too (:func:`missing_extras`: the timeline charts'
matplotlib), so a run never fails at its first timed step after minutes of work.
"""

from __future__ import annotations

import os

from hybrid.core.lazy import missing_extra

__all__ = ["MODEL_DIR_FOLDERS", "check_output_paths", "missing_extras"]

MODEL_DIR_FOLDERS = ("train", "profile", "timeline")  # what a run writes besides checkpoints


def _existing_ancestor(path: str) -> str:
    """The nearest path at or above ``path`` that exists."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def _check_creatable(option: str, path: str, directory: bool) -> None:
    """Raises ValueError unless ``path`` (a directory or a file) can be written."""
    given = f"--{option}={path}"
    if os.path.lexists(path):
        if directory and not os.path.isdir(path):
            raise ValueError(f"{given} is a regular file, not a directory; choose another path")
        if not directory and os.path.isdir(path):
            raise ValueError(f"{given} is a directory, not a file; choose another path")
        writable = os.path.dirname(os.path.abspath(path)) if not directory else path
    else:
        writable = _existing_ancestor(path)
        if not os.path.isdir(writable):
            raise ValueError(
                f"{given} is under {writable}, a regular file: no directory can be made "
                "there; choose a path outside it"
            )
    if not os.access(writable, os.W_OK | os.X_OK):
        raise ValueError(
            f"{given}: {writable} is not writable by this user; fix its permissions or "
            "choose another path"
        )


def check_output_paths(
    model_dir: str | None = None, export_dir: str | None = None, keras_file: str | None = None
) -> None:
    """Raises ValueError (naming the option and the fix) unless every output path given can
    be written, and no earlier export would be overwritten."""
    if model_dir and "://" not in model_dir:
        _check_creatable("model_dir", model_dir, directory=True)
        for folder in MODEL_DIR_FOLDERS:
            inner = os.path.join(model_dir, folder)
            if os.path.lexists(inner) and not os.path.isdir(inner):
                raise ValueError(
                    f"--model_dir={model_dir}: {inner} is a regular file, but the run writes "
                    f"its {folder}/ folder there; move it away"
                )
    if export_dir and "://" not in export_dir:
        _check_creatable("export_dir", export_dir, directory=True)
        if os.path.isdir(export_dir) and os.listdir(export_dir):
            raise ValueError(
                f"--export_dir={export_dir} holds files already (an earlier export?); the "
                "export would overwrite them: remove them or choose another --export_dir"
            )
    if keras_file and "://" not in keras_file:
        _check_creatable("keras_file", keras_file, directory=False)
        if os.path.exists(keras_file):
            raise ValueError(
                f"--keras_file={keras_file} exists already; saving would overwrite it: remove "
                "it or choose another --keras_file"
            )


def missing_extras(timeline_every: int, model_dir: str | None) -> str | None:
    """Why the outputs asked for cannot be drawn (one line naming the flag and the install),
    or None: ``--timeline_every`` with a ``--model_dir`` draws Gantt charts (matplotlib)."""
    if not (timeline_every and model_dir):
        return None
    return missing_extra(
        "matplotlib", f"--timeline_every={timeline_every} (its Gantt charts in --model_dir)"
    )
