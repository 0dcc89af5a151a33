"""What a data source spec means and which model can read it (no TensorFlow).

    "synthetic"          a learnable synthetic task for the model
    "text:PATH"          byte-level language modelling on a text file
    "text:python-docs"   the same on the Python manual that ships with CPython
    "package.module:fn"  your data: ``fn(global_batch_size)`` returns a ``tf.data.Dataset``
                         of (x, y) global batches (for any model, yours included)
    "tfrecord:PATTERN"   ``tf.train.Example`` records in the files matching PATTERN (in
                         sorted order, repeated), parsed by a feature spec: one feature is
                         the label, the others the inputs (``parse_features``)

``hybrid.run.data`` builds the datasets; the launcher checks its flags with this module before
the TensorFlow runtime starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

__all__ = [
    "BUILTIN_TEXT",
    "VOCAB_SIZE",
    "DataSpec",
    "check_source",
    "is_function_spec",
    "parse_features",
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
    if spec.startswith("tfrecord:") and spec.partition(":")[2]:
        return DataSpec("tfrecord", spec.partition(":")[2])
    kind, sep, path = spec.partition(":")
    if kind != "text" or not sep or not path:
        raise ValueError(
            f"unknown data source {spec!r}; use 'synthetic', 'text:PATH' (a text file), "
            f"'text:{BUILTIN_TEXT}' (the Python manual, present on every machine), "
            "'tfrecord:PATTERN' (tf.train.Example files) or 'package.module:function' (your "
            "function returning a tf.data.Dataset)"
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
    if is_function_spec(model) and source.kind not in ("function", "tfrecord"):
        raise ValueError(
            f"model {model!r} is your own; give its data as 'package.module:function' "
            "returning a tf.data.Dataset of (x, y) global batches, or 'tfrecord:PATTERN'"
        )
    if source.kind == "text" and model not in TOKEN_MODELS:
        raise ValueError(
            f"data source {spec!r} is a language-modelling corpus, but model {model!r} "
            f"classifies vectors or images; use a model of {list(TOKEN_MODELS)} or the "
            "'synthetic' source"
        )
    return source


# The dtypes a tf.train.Example feature holds.
FEATURE_DTYPES = ("float32", "int64", "string")


def parse_features(text: str, label: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A TFRecord feature spec, JSON ``{"name": ["dtype", [shape...]], ...}``, checked:
    every dtype one of :data:`FEATURE_DTYPES`, ``label`` among the names, at least one input.

    Raises:
      ValueError: naming what is wrong.
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"the feature spec {text!r} is not JSON: {err}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f'the feature spec {text!r} must be {{"name": ["dtype", [shape]], ...}}')
    features = {}
    for name, value in raw.items():
        if (
            not isinstance(value, list)
            or len(value) != 2
            or value[0] not in FEATURE_DTYPES
            or not isinstance(value[1], list)
            or not all(isinstance(d, int) and d > 0 for d in value[1])
        ):
            raise ValueError(
                f"feature {name!r}: {value!r} must be [dtype, [shape]] with dtype one of "
                f"{list(FEATURE_DTYPES)} and positive dimensions"
            )
        features[name] = (value[0], tuple(value[1]))
    if label not in features or len(features) < 2:
        raise ValueError(
            f"the feature spec names {sorted(features)}; it needs the label {label!r} and at "
            "least one input feature"
        )
    return features
