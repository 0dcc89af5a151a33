"""Models users bring, on the mesh: Keras Applications CNNs and KerasHub task models (random
init, small inputs and configs), per model × mesh against plain Keras on one device.

Each (model, mesh) runs in its own process with 4 simulated CPU devices (1 intra-op thread
each) and a fresh XLA cache. Measured there, side by side:

    keras_first_s     the model made, compile(jit_compile=...), the first train_on_batch
    keras_step_ms     the next steps (median)
    build_first_s     the model made, Pipeline(...), the first train_step (cut, stage programs)
    step_ms           the pipeline's next steps (median), XLA stage programs
    examples_per_s    batch / step time, and its ratio to Keras's (speedup)

    keras_first_cpu_s, build_first_cpu_s   the process's CPU seconds in them (steadier)

    python benchmarks/zoo.py [--models=mobilenetv2,gpt2] [--meshes=2x1:1,2x2:2] [--batch=16]
    python benchmarks/zoo.py --models=resnet50 --meshes=2x2:2 --profile   # compiles, floor
    python benchmarks/zoo.py --models=resnet50 --step_ratio   # 2x1 and 2x2 steps alternated,
                                                              # cores busy, the host's floor

The CNNs train with BatchNormalization: at R·M > 1 each micro-batch is normalized with its own
statistics (warned); the timing is what this benchmark reports. Results: zoo.json, zoo.csv,
zoo.png (build + first step and step time per model, Keras beside each mesh).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from absl import app, flags

import common

MODELS = common.ZOO_MODELS
flags.DEFINE_list("models", ["mobilenetv2", "resnet50", "gpt2", "bert"], f"Of {MODELS}.")
flags.DEFINE_list("meshes", ["2x1:1", "2x2:2"], "Meshes as SxR:M (stages x replicas : M).")
flags.DEFINE_integer("batch", 16, "Global batch.")
flags.DEFINE_integer("image_size", 32, "CNN input height and width.")
flags.DEFINE_integer("seq_len", 32, "KerasHub models: tokens per example.")
flags.DEFINE_integer("steps", 5, "Timed steps after the first.")
flags.DEFINE_bool(
    "jit_compile",
    True,
    "XLA for both Keras's step and the stage programs (on a CPU, convolutions with few "
    "examples run several times faster without: MobileNetV2's Keras step 324 vs 57 ms).",
)
flags.DEFINE_bool(
    "profile",
    False,
    "Also profile build + first step: XLA compiles per program and device (TensorFlow's "
    "device_compiler log), cProfile of the Python side (zoo_profile_<model>_<mesh>.txt), "
    "and the step's floor on this host (the whole model's forward + backward on one "
    "micro-batch, R*M of them, as many at once as there are cores).",
)
flags.DEFINE_string(
    "xla_cache",
    None,
    "A persistent XLA cache directory every child shares (default: a fresh one each): run "
    "twice, the second run's build + first step has XLA's compiles loaded, not compiled.",
)
flags.DEFINE_bool(
    "step_ratio",
    False,
    "Instead: per model, the step times of the pipelines on --meshes built in one process "
    "and timed in alternation (the first mesh is the base; zoo_step_ratio.json), with each "
    "step's CPU time (cores busy) and the host's floor for its micro-batches.",
)
flags.DEFINE_string("child", None, "Internal: measure 'model,SxR:M' in this process.")
FLAGS = flags.FLAGS


def build(name: str) -> tuple[Any, Any, Any]:
    """(model, x, y) of the named model at this run's sizes, seeded (:func:`common.zoo_model`)."""
    return common.zoo_model(name, FLAGS.batch, FLAGS.image_size, FLAGS.seq_len)


def measure(name: str, mesh: str) -> dict[str, Any]:
    """In this process (4 simulated devices): Keras's and the pipeline's first and later
    steps of the named model on ``mesh`` ("SxR:M")."""
    log = _capture_compile_log() if FLAGS.profile else None
    import hybrid

    hybrid.simulate_cpu_devices(4)
    import keras
    import numpy as np

    shape, micro = mesh.split(":")
    stages, replicas = map(int, shape.split("x"))

    def loss() -> Any:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=common.zoo_logits(name))

    def timed(setup: Any) -> tuple[float, float, float]:
        """Seconds of ``setup()`` (which returns the step) and the first step, the process's
        CPU seconds in them (all threads; steadier than wall time on a shared host), then the
        median milliseconds of --steps more steps."""
        profiler = _profiler() if FLAGS.profile else None
        start, cpu = time.perf_counter(), time.process_time()
        step = setup()
        step()
        first, first_cpu = time.perf_counter() - start, time.process_time() - cpu
        if profiler is not None:
            profiler.disable()
            profiles.append((profiler, _compiles(log)))
        times = []
        for _ in range(FLAGS.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return first, first_cpu, 1e3 * float(np.median(times))

    def keras_step() -> Any:
        model, x, y = build(name)
        model.compile(keras.optimizers.Adam(1e-3), loss(), jit_compile=FLAGS.jit_compile)
        return lambda: model.train_on_batch(x, y)

    pipes: list[Any] = []
    profiles: list[Any] = []

    def pipeline_step() -> Any:
        model, x, y = build(name)
        pipe = hybrid.Pipeline(
            model,
            hybrid.DeviceMesh.create(stages, replicas),
            micro_batches=int(micro),
            schedule="1f1b",
            remat="never",
        )
        pipe.compile(keras.optimizers.Adam(1e-3), loss(), jit_compile=FLAGS.jit_compile)
        pipes.append(pipe)
        return lambda: pipes[0].train_step(x, y)

    keras_first, keras_cpu, keras_ms = timed(keras_step)
    build_first, build_cpu, step_ms = timed(pipeline_step)
    pipe = pipes[0]
    extra = _profile(name, mesh, profiles, replicas * int(micro)) if FLAGS.profile else {}
    return extra | {
        "model": name,
        "mesh": mesh,
        "balance": list(pipe.balance),
        "parameters": int(sum(w.size for w in pipe.get_weights())),
        "keras_first_s": keras_first,
        "keras_step_ms": keras_ms,
        "build_first_s": build_first,
        "step_ms": step_ms,
        "examples_per_s": FLAGS.batch / step_ms * 1e3,
        "keras_examples_per_s": FLAGS.batch / keras_ms * 1e3,
        "speedup": keras_ms / step_ms,
        "build_over_keras_first": build_first / keras_first,
        "keras_first_cpu_s": keras_cpu,
        "build_first_cpu_s": build_cpu,
        "build_over_keras_first_cpu": build_cpu / keras_cpu,
    }


def step_ratio(name: str, meshes: list[str]) -> dict[str, Any]:
    """In this process (4 simulated devices): the pipeline's step on each of ``meshes``,
    timed in alternation so the host's noise hits all alike; ratios to the first mesh. For
    each mesh also its CPU milliseconds a step (all threads: the work; over the wall time,
    the cores it kept busy) and the host's floor (:func:`_floor_ms` at its R·M micro-batches)
    over the first mesh's step: the ratio no pipeline could beat here."""
    import hybrid

    hybrid.simulate_cpu_devices(4)
    import keras
    import numpy as np

    steps, parts = {}, {}
    for mesh in meshes:
        shape, micro = mesh.split(":")
        stages, replicas = map(int, shape.split("x"))
        parts[mesh] = replicas * int(micro)
        model, x, y = build(name)
        pipe = hybrid.Pipeline(
            model,
            hybrid.DeviceMesh.create(stages, replicas),
            micro_batches=int(micro),
            schedule="1f1b",
            remat="never",
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=common.zoo_logits(name))
        pipe.compile(keras.optimizers.Adam(1e-3), loss, jit_compile=FLAGS.jit_compile)
        steps[mesh] = lambda pipe=pipe, x=x, y=y: pipe.train_step(x, y)
    times = common.time_alternating(steps, rounds=FLAGS.steps, steps_per_round=2, warmup=2)
    ms = {mesh: 1e3 * float(np.median(t)) for mesh, t in times.items()}
    cpu_ms = {}
    for mesh, step in steps.items():
        start = time.process_time()
        for _ in range(FLAGS.steps):
            step()
        cpu_ms[mesh] = 1e3 * (time.process_time() - start) / FLAGS.steps
    floor_ms = {mesh: _floor_ms(name, count) for mesh, count in parts.items()}
    base = ms[meshes[0]]
    return {
        "model": name,
        "step_ms": ms,
        "ratio": {m: v / base for m, v in ms.items()},
        "cpu_ms": cpu_ms,
        "cores_busy": {m: cpu_ms[m] / ms[m] for m in meshes},
        "floor_ms": floor_ms,
        "floor_ratio": {m: v / base for m, v in floor_ms.items()},
    }


def _capture_compile_log() -> str:
    """Before TensorFlow loads: its C++ log (stderr) goes to a file, with the XLA device
    compiler's lines per compile ("Instantly compiling for signature: <program>", then on
    the same thread "Compilation of XLA executable time: ... (<T> us)")."""
    import sys

    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    os.environ["TF_CPP_VMODULE"] = "device_compiler=2"
    path = os.path.join(tempfile.mkdtemp(), "tf.log")
    sys.stderr.flush()
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    return path


_read = [0]  # how much of the compile log was read


def _compiles(path: str | None) -> list[tuple[str, float]]:
    """(program, seconds) of each XLA compile logged since the last call."""
    import re

    assert path is not None
    with open(path, errors="replace") as f:
        f.seek(_read[0])
        text = f.read()
        _read[0] = f.tell()
    program: dict[str, str] = {}  # thread -> the program it compiles
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or "device_compiler.h" not in line:
            continue
        if match := re.search(r"Instantly compiling for signature: (\S+)", line):
            program[parts[2]] = match.group(1)
        elif match := re.search(r"Compilation of XLA executable time: .* \((\d+) us\)", line):
            found.append((program.get(parts[2], "?"), int(match.group(1)) / 1e6))
    return found


def _profiler() -> Any:
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _profile(name: str, mesh: str, profiles: list[Any], micro_batches: int) -> dict[str, Any]:
    """What build + first step spent (Keras's, then the pipeline's): XLA compiles (count,
    seconds, the largest), Python tracing (cProfile, the top functions written to a text
    file), and the step's floor on this host (:func:`_floor_ms`)."""
    import io
    import pstats

    out: dict[str, Any] = {}
    report = io.StringIO()
    for who, (profiler, compiles) in zip(("keras", "pipeline"), profiles, strict=True):
        stats = pstats.Stats(profiler, stream=report)
        traced = [v for k, v in stats.stats.items() if k[2] == "func_graph_from_py_func"]  # type: ignore[attr-defined]
        out[f"{who}_traces"] = sum(v[1] for v in traced)  # primitive calls
        out[f"{who}_xla_compiles"] = len(compiles)
        out[f"{who}_xla_compile_s"] = sum(s for _, s in compiles)
        out[f"{who}_largest_compiles"] = sorted(compiles, key=lambda c: -c[1])[:8]
        report.write(
            f"==== {who}: {len(compiles)} XLA compiles, {out[f'{who}_xla_compile_s']:.1f} s\n"
        )
        for program, seconds in compiles:
            report.write(f"  {seconds:8.2f} s  {program}\n")
        stats.sort_stats("cumulative").print_stats(45)
    path = os.path.join(common.RESULTS, f"zoo_profile_{name}_{mesh.replace(':', '_')}.txt")
    os.makedirs(common.RESULTS, exist_ok=True)
    with open(path, "w") as f:
        f.write(report.getvalue())
    out["floor_ms"] = _floor_ms(name, micro_batches)
    return out


def _floor_ms(name: str, micro_batches: int) -> float:
    """Milliseconds any pipeline of ``micro_batches`` micro-batches in all (R·M) needs on
    this host for the same global batch, with no bubble, transfer, all-reduce or update:
    the whole model's forward and backward (one XLA program, as Keras's step computes its
    gradients) on one micro-batch's examples, ``micro_batches`` of them run as evenly as
    they can over as many devices at once as the host has cores (one thread each), with
    depthwise filter gradients in the stage programs' form (``depthwise.py``)."""
    import threading

    import keras
    import numpy as np
    import tensorflow as tf

    from hybrid.engine.programs.depthwise import cheap_filter_gradients

    lanes = min(os.cpu_count() or 1, micro_batches)
    size = FLAGS.batch // micro_batches
    runs = []
    for lane in range(lanes):
        with tf.device(f"/CPU:{lane}"):
            model, x, y = build(name)
            from_logits = common.zoo_logits(name)
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)

            def gradients(x: Any, y: Any, model: Any = model, loss: Any = loss) -> Any:
                with tf.GradientTape() as tape:
                    value = loss(y, model(x, training=True))
                with cheap_filter_gradients(FLAGS.jit_compile):  # as the stage programs
                    return tape.gradient(value, model.trainable_variables)

            program = tf.function(gradients, jit_compile=FLAGS.jit_compile, autograph=False)
            part = tf.nest.map_structure(lambda a: tf.constant(a[:size]), x), tf.constant(y[:size])
            count = -(-micro_batches // lanes) if lane == 0 else micro_batches // lanes

            def run(program: Any = program, part: Any = part, count: int = count, lane: int = lane):
                with tf.device(f"/CPU:{lane}"):
                    for _ in range(count):
                        out = program(*part)
                    [t.numpy() for t in tf.nest.flatten(out, expand_composites=True)]  # done

            run()  # compiled
            runs.append(run)
    times = []
    for _ in range(FLAGS.steps):
        threads = [threading.Thread(target=run) for run in runs]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def plot(rows: list[dict[str, Any]]) -> str:
    """Build + first step and step time per model: Keras, then each mesh."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    meshes = list(dict.fromkeys(r["mesh"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(models)), 4))
    width = 0.8 / (len(meshes) + 1)
    for ax, (keras_key, key, label) in zip(
        axes,
        [
            ("keras_first_s", "build_first_s", "build + first step (s)"),
            ("keras_step_ms", "step_ms", "step (ms)"),
        ],
        strict=True,
    ):
        for i, model in enumerate(models):
            mine = [r for r in rows if r["model"] == model]
            ax.bar(i, mine[0][keras_key], width, color="grey", label="Keras" if i == 0 else None)
            for j, mesh in enumerate(meshes):
                found = [r[key] for r in mine if r["mesh"] == mesh]
                ax.bar(
                    i + (j + 1) * width,
                    found[0] if found else 0,
                    width,
                    color=f"C{j}",
                    label=mesh if i == 0 else None,
                )
        ax.set_xticks([i + width * len(meshes) / 2 for i in range(len(models))], models)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    xla = "XLA" if FLAGS.jit_compile else "no XLA"
    fig.suptitle(f"Model zoo, batch {FLAGS.batch}, {xla}: plain Keras (one device) vs pipeline")
    fig.tight_layout()
    name = ("zoo" if FLAGS.jit_compile else "zoo_no_xla") + ("_profile" if FLAGS.profile else "")
    path = os.path.join(common.RESULTS, f"{name}.png")
    os.makedirs(common.RESULTS, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.child:
        name, mesh = FLAGS.child.split(",")
        if FLAGS.step_ratio:
            print("RESULT " + json.dumps(step_ratio(name, FLAGS.meshes)))
            return
        print("RESULT " + json.dumps(measure(name, mesh)))
        return
    if FLAGS.step_ratio:
        env = common.start("zoo_step_ratio", devices=1)
        rows = []
        for name in FLAGS.models:
            (row,) = common.run_child(
                [os.path.abspath(__file__), f"--child={name},-", "--step_ratio"]
                + [f"--meshes={','.join(FLAGS.meshes)}"]
                + common.flag_args("batch", "image_size", "seq_len", "steps", "jit_compile")
            )
            rows.append(row)
            print(
                f"  {name:14s} "
                + "  ".join(
                    f"{m} {v:7.1f} ms ({row['ratio'][m]:.2f}x; {row['cores_busy'][m]:.1f} cores"
                    f" busy; floor {row['floor_ratio'][m]:.2f}x)"
                    for m, v in row["step_ms"].items()
                )
            )
        common.write_json("zoo_step_ratio", {"environment": env, "rows": rows})
        print(
            "SUMMARY zoo_step_ratio "
            + " ".join(f"{r['model']}={max(r['ratio'].values()):.2f}" for r in rows)
        )
        return
    env = common.start("zoo", devices=1)  # the header; each child has its own devices
    rows = []
    for name in FLAGS.models:
        if name not in MODELS:
            raise app.UsageError(f"--models: unknown model {name!r}; choose from {MODELS}")
        for mesh in FLAGS.meshes:
            with tempfile.TemporaryDirectory() as fresh:
                cache = FLAGS.xla_cache or fresh
                (row,) = common.run_child(
                    [os.path.abspath(__file__), f"--child={name},{mesh}"]
                    + common.flag_args(
                        "batch", "image_size", "seq_len", "steps", "jit_compile", "profile"
                    ),
                    env={"TF_XLA_FLAGS": f"--tf_xla_persistent_cache_directory={cache}"},
                )
            rows.append(row)
            if FLAGS.profile:
                print(
                    f"  {name:14s} {mesh:6s} XLA compiles: Keras {row['keras_xla_compiles']}"
                    f" in {row['keras_xla_compile_s']:.1f} s, pipeline"
                    f" {row['pipeline_xla_compiles']} in {row['pipeline_xla_compile_s']:.1f} s;"
                    " traces: Keras"
                    f" {row['keras_traces']}, pipeline {row['pipeline_traces']}; step floor"
                    f" {row['floor_ms']:.1f} ms"
                )
            print(
                f"  {name:14s} {mesh:6s} balance {str(tuple(row['balance'])):12s} "
                f"build+first {row['build_first_s']:6.1f} s (Keras {row['keras_first_s']:5.1f} s,"
                f" {row['build_over_keras_first']:.2f}x;"
                f" CPU {row['build_over_keras_first_cpu']:.2f}x)  step {row['step_ms']:7.1f} ms "
                f"(Keras {row['keras_step_ms']:7.1f} ms, speedup {row['speedup']:.2f})"
            )
    name = ("zoo" if FLAGS.jit_compile else "zoo_no_xla") + ("_profile" if FLAGS.profile else "")
    common.write_json(name, {"environment": env, "jit_compile": FLAGS.jit_compile, "rows": rows})
    common.write_csv(name, rows)
    print(f"  wrote {plot(rows)}")
    worst = max(rows, key=lambda r: r["build_over_keras_first"])
    print(
        "SUMMARY zoo "
        + " ".join(f"{r['model']}@{r['mesh']}={r['speedup']:.2f}" for r in rows)
        + f" worst_build_over_keras={worst['build_over_keras_first']:.2f}"
        f"({worst['model']}@{worst['mesh']})"
    )


if __name__ == "__main__":
    app.run(main)
