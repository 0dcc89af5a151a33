"""What a data source spec means and which model can read it (no TensorFlow).

    "synthetic"          a learnable synthetic task for the model
    "text:PATH"          byte-level language modelling on a text file
    "text:python-docs"   the same on the Python manual that ships with CPython
    "package.module:fn"  your data: ``fn(global_batch_size)`` returns a ``tf.data.Dataset``
                         of (x, y) global batches (for any model, yours included)

``hybrid.data`` builds the datasets; the launcher checks its flags with this module before
the TensorFlow runtime starts.
"""

from __future__ import annotations

import dataclasses
import os
import re

__all__ = [
    "BUILTIN_TEXT",
    "VOCAB_SIZE",
    "DataSpec",
    "check_source",
    "is_function_spec",
    "parse_spec",
]

BUILTIN_TEXT = "python-docs"
VOCAB_SIZE = 256  # byte-level
TOKEN_MODELS = ("transformer",)  # the models that read token sequences


def is_function_spec(spec: str) -> bool:
    """``spec`` names a function of yours: ``package.module:function``."""
    module = spec.partition(":")[0]
    return module not in ("text", "tfrecord") and bool(
        re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", spec)
    )


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """A parsed data source spec: ``kind`` is "synthetic", "text" or "function"; ``path``:
    the text file, or the function's ``module:name``."""

    kind: str
    path: str = ""


def parse_spec(spec: str) -> DataSpec:
    """``"synthetic"``, ``"text:PATH"`` or ``"text:python-docs"`` -> DataSpec.

    Raises:
      ValueError: an unknown kind, or a text file that does not exist.
    """
    if spec == "synthetic":
        return DataSpec("synthetic")
    if is_function_spec(spec):
        return DataSpec("function", spec)
    kind, sep, path = spec.partition(":")
    if kind != "text" or not sep or not path:
        raise ValueError(
            f"unknown data source {spec!r}; use 'synthetic', 'text:PATH' (a text file), "
            f"'text:{BUILTIN_TEXT}' (the Python manual, present on every machine) or "
            "'package.module:function' (your function returning a tf.data.Dataset)"
        )
    if path != BUILTIN_TEXT and not os.path.isfile(path):
        raise ValueError(f"data file {path!r} (from {spec!r}) does not exist or is not a file")
    return DataSpec("text", path)


def check_source(spec: str, model: str) -> DataSpec:
    """Parses ``spec`` and checks that ``model`` can read it.

    Raises:
      ValueError: a bad spec, or a text corpus for a model that does not read tokens.
    """
    source = parse_spec(spec)
    if is_function_spec(model) and source.kind != "function":
        raise ValueError(
            f"model {model!r} is your own; give its data as 'package.module:function' "
            "returning a tf.data.Dataset of (x, y) global batches"
        )
    if source.kind == "text" and model not in TOKEN_MODELS:
        raise ValueError(
            f"data source {spec!r} is a language-modelling corpus, but model {model!r} "
            f"classifies vectors or images; use a model of {list(TOKEN_MODELS)} or the "
            "'synthetic' source"
        )
    return source
