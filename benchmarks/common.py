"""Shared pieces of the benchmarks: environment header, side-by-side timing, result files.

Every benchmark is a named experiment: synthetic data, warm-up excluded, candidates timed
in alternation within one process (the machine is shared and noisy, so only ratios measured
side by side mean anything), results written as JSON and PNG under ``benchmarks/results/``,
and one parseable summary line at the end.

Every benchmark imports this module before anything else: importing it sets TensorFlow's
environment defaults (quiet C++ logs, no oneDNN rewrites) before TensorFlow loads (then loads
it without its start-up noise: ``hybrid.core.quiet``), and puts the source tree first on
``sys.path`` so that ``hybrid`` is this checkout's.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from hybrid.core.quiet import import_tensorflow  # noqa: E402  (this checkout's hybrid)

import_tensorflow()  # its start-up noise (no CUDA driver, CPU features) kept out of the output

# `bazel run` executes from the runfiles tree and names the source tree in this variable.
RESULTS = os.path.join(
    os.environ.get("BUILD_WORKSPACE_DIRECTORY") or ROOT,
    "benchmarks",
    "results",
)

# Flags defined here, by name, for ``config`` dicts and for passing on to child processes.
TIMING_FLAGS = ("rounds", "steps_per_round")
MODEL_FLAGS = ("width", "depth", "batch")
REFERENCE_MODEL_FLAGS = ("model", "width", "depth", "batch", "seq_len", "num_heads", "image_size")


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


def start(name: str, devices: int) -> dict[str, Any]:
    """Simulates ``devices`` CPU devices (before TensorFlow starts), then prints the
    environment header of the experiment ``name`` and returns it."""
    import hybrid

    hybrid.simulate_cpu_devices(devices)
    env = environment()
    print_header(name, env)
    return env


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


def time_steps(
    candidates: Mapping[str, Callable[[], Any]], warmup: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """:func:`time_alternating` with --rounds and --steps_per_round: the samples (seconds per
    step) of each candidate and their medians in milliseconds."""
    from absl import flags

    samples = time_alternating(
        candidates,
        rounds=flags.FLAGS.rounds,
        steps_per_round=flags.FLAGS.steps_per_round,
        warmup=warmup,
    )
    return samples, {name: 1e3 * median(v) for name, v in samples.items()}


def print_ms(ms: Mapping[str, float], width: int) -> None:
    """One line per candidate: its median milliseconds per step (names padded to ``width``)."""
    from absl import flags

    for name, value in ms.items():
        print(f"  {name:{width}s} {value:8.2f} ms/step (median of {flags.FLAGS.rounds} rounds)")


def train_step(pipe: Any, x: Any, y: Any) -> Callable[[], Any]:
    """A candidate for :func:`time_alternating`: one training step of ``pipe`` on (x, y)."""
    return lambda: pipe.train_step(x, y)


def independent_step(
    make_model: Callable[[], Any],
    make_loss: Callable[[], Any],
    make_optimizer: Callable[[], Any],
    x: Any,
    y: Any,
    devices: Sequence[str],
) -> Callable[[], float]:
    """The host's ceiling for a step on ``devices``: on each device its own copy of the model
    takes plain Keras's one-device step on its share of the batch (its gradients by one XLA
    program, its update by another), all in one ``tf.function``, with nothing exchanged. No
    step on those devices can beat it; busy cores share caches and memory bandwidth, so it is
    faster than one device by less than N×. (The gradient program takes the weights as
    arguments, as the engine's do: two XLA calls that each read and update variables are run
    one after the other by the function's automatic control dependencies.)"""
    import keras
    import tensorflow as tf

    shares = list(zip(tf.split(x, len(devices)), tf.split(y, len(devices)), strict=True))
    replicas = []
    for device in devices:
        with tf.device(device):
            model, loss, optimizer = make_model(), make_loss(), make_optimizer()
            optimizer.build(model.trainable_variables)

        def gradients(xr: Any, yr: Any, weights: list[Any], model: Any = model, loss=loss) -> Any:
            mapping = list(zip(model.trainable_variables, weights, strict=True))
            with tf.GradientTape() as tape:
                tape.watch(weights)
                with keras.StatelessScope(state_mapping=mapping):
                    value = loss(yr, model(xr, training=True))
            return tape.gradient(value, weights), value

        def update(grads: list[Any], model: Any = model, optimizer: Any = optimizer) -> None:
            optimizer.apply(grads, model.trainable_variables)

        programs = [tf.function(f, jit_compile=True) for f in (gradients, update)]
        replicas.append((device, model, *programs))

    @tf.function
    def step() -> Any:
        values = []
        for (device, model, gradients, update), (xr, yr) in zip(replicas, shares, strict=True):
            with tf.device(device):
                weights = [tf.convert_to_tensor(v) for v in model.trainable_variables]
                grads, value = gradients(xr, yr, weights)
                update(grads)
                values.append(value)
        return tf.add_n(values)

    return lambda: float(step())


def instrumented_step(
    pipe: Any, x: Any, y: Any
) -> tuple[list[Any], list[tuple[Any, float, float]]]:
    """The events of one instrumented step of ``pipe`` (after two that trace and warm it), and
    the same as (action, start, end) triples, the measured
    timeline ``hybrid.run.timeline`` takes."""
    for _ in range(2):
        pipe.timed_train_step(x, y)
    _, events = pipe.timed_train_step(x, y)
    return events, [(e.action, e.start, e.end) for e in events]


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


def flag_values(*names: str) -> dict[str, Any]:
    """The values of the flags ``names``, by name (a result file's ``config``)."""
    from absl import flags

    return {name: getattr(flags.FLAGS, name) for name in names}


def flag_args(*names: str) -> list[str]:
    """``--name=value`` for each flag in ``names``: this process's values, for a child (a
    list flag's items joined by commas)."""
    return [
        f"--{name}={','.join(map(str, value)) if isinstance(value, list) else value}"
        for name, value in flag_values(*names).items()
    ]


def dense_stack(width: int, depth: int, classes: int = 10, seed: int = 0) -> list[Any]:
    """The benchmark model: ``depth`` × Dense(width, relu), then Dense(classes); fixed seed."""
    import keras

    keras.utils.set_random_seed(seed)
    hidden = [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    return hidden + [keras.layers.Dense(classes)]


def dense_pipeline(
    width: int, depth: int, mesh: Any, optimizer: Any, loss: Any = None, **options: Any
) -> Any:
    """A built ``hybrid.Pipeline`` of :func:`dense_stack` on ``mesh``.

    ``loss`` defaults to a fresh sparse categorical cross-entropy on logits; ``options`` are
    the Pipeline's other arguments (micro_batches, schedule, remat, ...).
    """
    import keras

    import hybrid

    if loss is None:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compiling = {k: options.pop(k) for k in ("jit_compile", "metrics") if k in options}
    pipe = hybrid.Pipeline(dense_stack(width, depth), mesh=mesh, **options)
    pipe.compile(optimizer=optimizer, loss=loss, **compiling)
    pipe.build((None, width))
    return pipe


def schedule_pipeline(
    schedule: str, remat: str, micro_batches: int, learning_rate: float, **options: Any
) -> Any:
    """A built :func:`dense_pipeline` of --width and --depth on a 2-stage × 1-replica mesh,
    trained by SGD with ``schedule`` (interleaved: 2 virtual stages per device)."""
    import keras
    from absl import flags

    import hybrid

    return dense_pipeline(
        flags.FLAGS.width,
        flags.FLAGS.depth,
        hybrid.DeviceMesh.create(2, 1),
        keras.optimizers.SGD(learning_rate),
        micro_batches=micro_batches,
        schedule=schedule,
        remat=remat,
        virtual_stages=2 if schedule == "interleaved" else 1,
        **options,
    )


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


def save_figure(fig: Any, name: str, dpi: int = 100) -> str:
    """Writes ``fig`` to ``benchmarks/results/<name>.png``, closes it and returns the path."""
    import matplotlib.pyplot as plt

    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.png")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
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


def write_timed(
    name: str,
    env: Mapping[str, Any],
    config: Mapping[str, Any],
    samples: Mapping[str, list[float]],
    ms: Mapping[str, float],
    title: str,
    **results: Any,
) -> str:
    """The result files of a benchmark timed with :func:`time_steps`: ``<name>.json`` (the
    environment, config, ``ms_per_step``, ``samples_s`` and ``results``) and a bar chart of
    the milliseconds per step, ``<name>.png``. Prints and returns the JSON's path."""
    payload = {"environment": env, "config": config, "ms_per_step": ms, "samples_s": samples}
    path = write_json(name, {**payload, **results})
    bar_chart(name, ms, "ms / step", title)
    print(f"  wrote {path}")
    return path


def write_csv(name: str, rows: Sequence[Mapping[str, Any]]) -> str:
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
    import tensorflow as tf

    keras.utils.set_random_seed(seed)
    layers, shape, dtype, x, y = _reference_layers_and_batch(
        model, batch, width, depth, seq_len, num_heads, image_size, seed
    )
    return {
        "layers": layers,
        "input_shape": shape,
        "input_dtype": dtype,
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "x": tf.constant(x),
        "y": tf.constant(y),
    }


def _reference_layers_and_batch(
    model: str,
    batch: int,
    width: int,
    depth: int,
    seq_len: int,
    num_heads: int,
    image_size: int,
    seed: int,
) -> tuple[list[Any], tuple[int, ...], str, Any, Any]:
    """:func:`reference_model`'s layers, input shape and dtype, and batch (numpy x, y)."""
    import numpy as np

    from hybrid import models

    rng = np.random.default_rng(seed)
    shape: tuple[int, ...]
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
    return layers, shape, dtype, x, y


# The model zoo: Keras Applications CNNs (softmax outputs) and KerasHub task models (logits).
ZOO_MODELS = (
    "mobilenetv2",
    "resnet50",
    "densenet121",
    "efficientnetb0",
    "convnexttiny",
    "gpt2",
    "bert",
    "llama",
)


def zoo_logits(name: str) -> bool:
    """Whether the zoo model's outputs are logits (KerasHub's), not probabilities."""
    return name not in ZOO_MODELS[:5]


def zoo_model(name: str, batch: int, image_size: int, seq_len: int) -> tuple[Any, Any, Any]:
    """(model, x, y) of the named zoo model, seeded: the same weights every call; CNNs at
    ``image_size`` squared, KerasHub models small (4 blocks of width 64) at ``seq_len``
    tokens, both ``batch`` examples."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    n, size = batch, image_size
    applications = {
        "mobilenetv2": keras.applications.MobileNetV2,
        "resnet50": keras.applications.ResNet50,
        "densenet121": keras.applications.DenseNet121,
        "efficientnetb0": keras.applications.EfficientNetB0,
        "convnexttiny": keras.applications.ConvNeXtTiny,
    }
    if name in applications:
        model = applications[name](input_shape=(size, size, 3), weights=None, classes=10)
        x = rng.normal(size=(n, size, size, 3)).astype("float32")
        return model, x, rng.integers(0, 10, size=(n,)).astype("int32")
    import keras_hub

    seq, vocab = seq_len, 1024
    x = {
        "token_ids": rng.integers(1, vocab, size=(n, seq)).astype("int32"),
        "padding_mask": np.ones((n, seq), "int32"),
    }
    small = dict(num_layers=4, num_heads=4, hidden_dim=64, intermediate_dim=128)
    if name == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=vocab, max_sequence_length=seq, dropout=0.0, **small
        )
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        return model, x, rng.integers(0, vocab, size=(n, seq)).astype("int32")
    if name == "llama":
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=vocab,
            num_query_heads=4,
            num_key_value_heads=2,
            **{k: v for k, v in small.items() if k != "num_heads"},
        )
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
        return model, x, rng.integers(0, vocab, size=(n, seq)).astype("int32")
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocab, max_sequence_length=seq, dropout=0.0, **small
    )
    x["segment_ids"] = np.zeros((n, seq), "int32")
    model = keras_hub.models.BertTextClassifier(
        backbone=backbone, num_classes=4, preprocessor=None, dropout=0.0
    )
    return model, x, rng.integers(0, 4, size=(n,)).astype("int32")


def client_bytes_sent() -> int:
    """Bytes this process's TCP sockets have sent (the kernel's per-socket counters, read
    with ``ss -tin``; the client's sockets picked by pid)."""
    import re
    import subprocess

    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    lines, total = out.splitlines(), 0
    for i, line in enumerate(lines):
        if f"pid={os.getpid()}," in line and i + 1 < len(lines):
            found = re.search(r"bytes_sent:(\d+)", lines[i + 1])
            total += int(found.group(1)) if found else 0
    return total


def time_fits(
    runs: Mapping[str, tuple[Any, Any]], rounds: int, steps: int
) -> tuple[dict[str, float], dict[str, float]]:
    """``fit`` of each ``(pipeline, data)`` for 2 steps (compiling, the first iterators),
    then ``rounds`` alternating rounds of ``steps`` steps each: per run, the median seconds
    per step and the median bytes this process sent per step (:func:`client_bytes_sent`)."""
    import time

    seconds: dict[str, list[float]] = {k: [] for k in runs}
    sent: dict[str, list[float]] = {k: [] for k in runs}
    for pipe, data in runs.values():
        pipe.fit(data, epochs=1, steps_per_epoch=2, verbose=0)
    for _ in range(rounds):
        for name, (pipe, data) in runs.items():
            before, start = client_bytes_sent(), time.perf_counter()
            pipe.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
            seconds[name].append((time.perf_counter() - start) / steps)
            sent[name].append((client_bytes_sent() - before) / steps)
    return (
        {k: median(v) for k, v in seconds.items()},
        {k: median(v) for k, v in sent.items()},
    )
