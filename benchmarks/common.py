"""Shared pieces of the benchmarks: environment header, side-by-side timing, result files.

Every benchmark is a named experiment: synthetic data, warm-up excluded, candidates timed
in alternation within one process (the machine is shared and noisy, so only ratios measured
side by side mean anything), results written as JSON and PNG under ``benchmarks/results/``,
and one parseable summary line at the end.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

# `bazel run` executes from the runfiles tree and names the source tree in this variable.
RESULTS = os.path.join(
    os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    or os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "benchmarks",
    "results",
)


def environment() -> dict[str, Any]:
    import tensorflow as tf

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tensorflow": tf.__version__,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "devices": [d.name for d in tf.config.list_logical_devices()],
        "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op_threads": tf.config.threading.get_inter_op_parallelism_threads(),
    }


def print_header(name: str, env: Mapping[str, Any]) -> None:
    print(f"== {name} ==")
    for key, value in env.items():
        print(f"  {key}: {value}")


def time_alternating(
    candidates: Mapping[str, Callable[[], Any]], rounds: int, steps_per_round: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds per step of each candidate, measured round-robin so noise hits all alike.

    Each candidate runs ``warmup`` untimed steps first; then, ``rounds`` times, each runs
    ``steps_per_round`` steps in turn and the mean time per step of that round is recorded.
    Each callable must block until its step is done.
    """
    for step in candidates.values():
        for _ in range(warmup):
            step()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, step in candidates.items():
            start = time.perf_counter()
            for _ in range(steps_per_round):
                step()
            samples[name].append((time.perf_counter() - start) / steps_per_round)
    return samples


def define_model_flags(depth: int = 4, batch: int = 256, width: int = 1024) -> None:
    """The absl flags every benchmark shares: the model (--width, --depth) and --batch."""
    from absl import flags

    flags.DEFINE_integer("width", width, "Dense width.")
    flags.DEFINE_integer("depth", depth, "Dense(width) layers.")
    flags.DEFINE_integer("batch", batch, "Global batch.")


def define_timing_flags(rounds: int, steps_per_round: int) -> None:
    """The absl flags of benchmarks timed with :func:`time_alternating`."""
    from absl import flags

    flags.DEFINE_integer("rounds", rounds, "Timed rounds per candidate.")
    flags.DEFINE_integer("steps_per_round", steps_per_round, "Steps per round.")


def dense_stack(width: int, depth: int, classes: int = 10, seed: int = 0) -> list[Any]:
    """The benchmark model: ``depth`` × Dense(width, relu), then Dense(classes); fixed seed."""
    import keras

    keras.utils.set_random_seed(seed)
    hidden = [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    return hidden + [keras.layers.Dense(classes)]


def synthetic_batch(batch: int, width: int, classes: int = 10, seed: int = 0) -> tuple[Any, Any]:
    """A fixed random batch (x: float32 [batch, width], y: int32 labels) as tensors."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(batch, width)).astype("float32"))
    y = tf.constant(rng.integers(0, classes, size=(batch,)).astype("int32"))
    return x, y


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_json(name: str, payload: Mapping[str, Any]) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
    return path


def bar_chart(name: str, values: Mapping[str, float], ylabel: str, title: str) -> str:
    """A PNG bar chart of ``values`` in ``benchmarks/results/<name>.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.png")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(values)), 4))
    ax.bar(list(values), list(values.values()), color="#4c72b0")
    for i, v in enumerate(values.values()):
        ax.text(i, v, f"{v:.3g}", ha="center", va="bottom")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_csv(name: str, rows: list[Mapping[str, Any]]) -> str:
    """``rows`` as ``benchmarks/results/<name>.csv`` (columns: the union of their keys, in
    first-seen order; lists and dicts are written as JSON)."""
    import csv

    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.csv")
    fields: list[str] = []
    for row in rows:
        fields += [k for k in row if k not in fields]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {
                    k: json.dumps(v) if isinstance(v, list | tuple | dict) else v
                    for k, v in row.items()
                }
            )
    return path


def run_child(
    argv: list[str], env: Mapping[str, str] | None = None, timeout: int = 1800
) -> list[Any]:
    """Runs ``python argv...`` in a fresh process (TensorFlow's devices are fixed per process)
    and returns the JSON values it printed on lines starting with ``RESULT ``.

    Raises:
      RuntimeError: the child failed or printed no result; with the end of its stderr.
    """
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        env={**os.environ, **(env or {})},
        text=True,
        timeout=timeout,
    )
    results = [
        json.loads(line[len("RESULT ") :])
        for line in child.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    if child.returncode or not results:
        raise RuntimeError(
            f"{' '.join(argv)} failed (exit {child.returncode}):\n{child.stderr[-3000:]}"
        )
    return results


def define_reference_model_flags(
    model: str = "transformer", width: int = 64, depth: int = 2, batch: int = 32
) -> None:
    """Flags of the reference models (``hybrid.models``): --model, --width (d_model,
    channels or Dense width), --depth (blocks), --batch, --seq_len, --num_heads, --image_size."""
    from absl import flags

    flags.DEFINE_enum("model", model, ["transformer", "mlp", "resnet"], "Reference model.")
    define_model_flags(depth=depth, batch=batch, width=width)
    flags.DEFINE_integer("seq_len", 32, "Transformer: tokens per example.")
    flags.DEFINE_integer("num_heads", 4, "Transformer: attention heads.")
    flags.DEFINE_integer("image_size", 16, "ResNet: image height and width.")


def reference_model(
    model: str,
    batch: int,
    width: int,
    depth: int,
    seq_len: int = 32,
    num_heads: int = 4,
    image_size: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """A reference model from ``hybrid.models`` and a fixed synthetic batch for it.

    Returns a dict with ``layers``, ``input_shape`` (without batch), ``input_dtype``,
    ``loss`` (a fresh Keras loss), ``x``, ``y`` (tensors with ``batch`` examples):

      transformer  vocab 256, ``seq_len`` tokens, d_model ``width``, ``depth`` blocks;
                   ids (B, T) -> logits (B, T, 256), labels ids (B, T)
      mlp          ``depth`` blocks of Dense(width) on ``width`` features, 10 classes
      resnet       ``depth`` residual blocks of ``width`` channels on 3-channel images
    """
    import keras
    import numpy as np
    import tensorflow as tf

    from hybrid import models

    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    if model == "transformer":
        layers = models.transformer(256, seq_len, width, num_heads, depth, seed=seed)
        shape, dtype = (seq_len,), "int32"
        x = rng.integers(0, 256, size=(batch, seq_len)).astype("int32")
        y = rng.integers(0, 256, size=(batch, seq_len)).astype("int32")
    elif model == "mlp":
        layers = models.mlp(10, width, depth, seed=seed)
        shape, dtype = (width,), "float32"
        x = rng.normal(size=(batch, width)).astype("float32")
        y = rng.integers(0, 10, size=(batch,)).astype("int32")
    elif model == "resnet":
        layers = models.resnet(10, width, depth, seed=seed)
        shape, dtype = (image_size, image_size, 3), "float32"
        x = rng.normal(size=(batch, *shape)).astype("float32")
        y = rng.integers(0, 10, size=(batch,)).astype("int32")
    else:
        raise ValueError(f"unknown model {model!r}; choose transformer, mlp or resnet")
    return {
        "layers": layers,
        "input_shape": shape,
        "input_dtype": dtype,
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "x": tf.constant(x),
        "y": tf.constant(y),
    }
