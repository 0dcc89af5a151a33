"""Scaling across mesh shapes: every S × R = N, micro-batch count and schedule, measured
against what the user would run instead: the same model trained by plain Keras on one device.

For each device budget N in ``--devices`` one child process simulates N CPU devices (TF's
logical devices are fixed per process) and runs, on the reference model, every
configuration of that budget:

    for S × R = N (every factorization), M in --micro_batches, schedule in --schedules
    (one stage: --single_stage_schedule only, the schedules coincide), remat in --remats:
        build the Pipeline; first step (traces and compiles)         -> compile_s
    then, all configurations of the process and plain Keras's one-device step
    (compile(jit_compile=True) + train_on_batch) timed in alternation -> step_ms (median)
    for each: one step after resetting the allocator's peak          -> peak memory
    for each pipelined one: one instrumented step                    -> measured bubble

Two curves: the default model is sized so compute dominates (4 × Dense(1024), batch 2048:
GEMMs of 256 rows and more even at M = 8), as on the accelerators users train on; the same
sweep then runs on ``--small_model`` (the tiny Transformer, batch 32), where launching
programs and exchanging data weigh as much as the compute. Each row has ``speedup`` and
``efficiency`` (over the best 1×1 of its process; ÷ N) and ``speedup_vs_keras`` (over plain
Keras's one-device step timed beside it).

With ``--baseline`` (default) the 1×1 configurations run in the same process, so speedups
are ratios measured side by side. Configurations that cannot run (a batch not divisible by
R × M, interleaved with M % S != 0, more stages than layers) are listed as skipped.

Memory: the simulated devices share one BFC allocator (TF_CPU_ALLOCATOR_USE_BFC=true), so the
measured figure is per configuration: its resident bytes (weights and optimizer state of
all its devices, from before its build to after its first step) plus the peak one step
allocates on top. ``peak_mib_per_device`` is that total divided by the S × R devices: exact
for replicas (identical copies), the mean over the stages of a pipeline.

    python benchmarks/mesh_scaling.py          # N = 2: 1x1, 1x2, 2x1; M in {1, 2, 8}; 2 curves
    python benchmarks/mesh_scaling.py --devices=2,4 --micro_batches=1,2,4,8 --small_model=

Writes benchmarks/results/mesh_scaling.{csv,json,png} (the small model's rows under
``small_model`` in the JSON, labelled by ``curve`` in the CSV); ends with one SUMMARY line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from absl import app, flags

import common  # first: it sets TensorFlow's environment and puts the source tree on sys.path

# isort: split
from hybrid.core import schedule as sched

common.define_timing_flags(rounds=5, steps_per_round=3)
# Compute dominates by default, as on the accelerators users train on: GEMMs of 256 rows
# and more even at M = 8, against which launching programs and exchanging data is small.
common.define_reference_model_flags(model="mlp", width=1024, depth=4, batch=2048)
flags.DEFINE_string(
    "small_model",
    "transformer:64:2:32",
    "A second, labelled curve: the same sweep on a small model (model:width:depth:batch, "
    "the other reference-model flags as given), where launching programs and exchanging "
    "data weigh as much as the compute; '' runs none.",
)
flags.DEFINE_list("devices", ["2"], "Device budgets N; each runs in its own process.")
flags.DEFINE_list("micro_batches", ["1", "2", "8"], "Micro-batch counts M.")
flags.DEFINE_list("schedules", sched.names(), "Schedules for meshes with S > 1.")
flags.DEFINE_string("single_stage_schedule", "1f1b", "The schedule of S = 1 meshes.")
flags.DEFINE_list(
    "remats",
    ["never"],
    "Remat modes; 'never+deferred': remat never with deferred weight gradients (M > 1).",
)
flags.DEFINE_integer("virtual_stages", 2, "Virtual stages of the interleaved schedule.")
flags.DEFINE_enum("optimizer", "adam", ["adam", "sgd"], "Optimizer.")
flags.DEFINE_bool("baseline", True, "Also run the 1×1 configurations in every process.")
flags.DEFINE_bool("timeline", True, "One instrumented step per pipelined configuration.")
flags.DEFINE_bool("jit_compile", True, "XLA stage programs.")
flags.DEFINE_string("name", "mesh_scaling", "Results go to benchmarks/results/<name>.*")
flags.DEFINE_string("child", None, "Internal: run these configurations (JSON) here.")
FLAGS = flags.FLAGS

MIB = float(1 << 20)


DEFERRED = "never+deferred"  # remat "never", weight gradients deferred


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configurations(devices: int, num_layers: int, batch: int) -> tuple[list[dict], list[dict]]:
    """(runnable, skipped) configurations of one device budget for a model of
    ``num_layers`` layers and a global batch of ``batch``, as plain dicts."""
    meshes = [(S, devices // S) for S in _divisors(devices)]
    if FLAGS.baseline and devices > 1:
        meshes.insert(0, (1, 1))
    runnable, skipped = [], []
    for S, R in meshes:
        names = [FLAGS.single_stage_schedule] if S == 1 else FLAGS.schedules
        for name in names:
            v = FLAGS.virtual_stages if name == "interleaved" else 1
            for M in (int(m) for m in FLAGS.micro_batches):
                for remat in FLAGS.remats:
                    config = {
                        "devices": S * R,
                        "stages": S,
                        "replicas": R,
                        "micro_batches": M,
                        "schedule": name,
                        "virtual_stages": v,
                        "remat": remat,
                    }
                    reason = None
                    if batch % (R * M):
                        reason = f"batch {batch} not divisible by R×M = {R * M}"
                    elif name == "interleaved" and M % S:
                        reason = f"interleaved needs M % S == 0 (M={M}, S={S})"
                    elif S * v > num_layers:
                        reason = f"{S * v} model stages but {num_layers} layers"
                    elif remat == DEFERRED and M == 1:
                        reason = "one micro-batch: nothing to defer"
                    if reason:
                        skipped.append({**config, "status": "skipped: " + reason})
                    else:
                        runnable.append(config)
    return runnable, skipped


def _label(c: dict) -> str:
    v = f"(v={c['virtual_stages']})" if c["virtual_stages"] > 1 else ""
    return f"{c['stages']}x{c['replicas']} M={c['micro_batches']} {c['schedule']}{v} {c['remat']}"


def _optimizer() -> Any:
    """A fresh optimizer of --optimizer (the Pipeline makes one per stage replica)."""
    import keras

    if FLAGS.optimizer == "adam":
        return keras.optimizers.Adam(1e-4)
    return keras.optimizers.SGD(1e-3)


def _memory() -> dict:
    import tensorflow as tf

    return tf.config.experimental.get_memory_info("CPU:0")


def build(c: dict, data: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The configuration ``c`` built and its first step run (traced, compiled): the pipeline
    and its row so far (balance, first step seconds, resident bytes)."""
    import hybrid

    before = _memory()["current"]
    start = time.perf_counter()
    pipe = hybrid.Pipeline(
        common.reference_model(**common.flag_values(*common.REFERENCE_MODEL_FLAGS))["layers"],
        mesh=hybrid.DeviceMesh.create(c["stages"], c["replicas"]),
        micro_batches=c["micro_batches"],
        schedule=c["schedule"],
        remat="never" if c["remat"] == DEFERRED else c["remat"],
        defer_weight_gradients=c["remat"] == DEFERRED,
        virtual_stages=c["virtual_stages"],
    )
    pipe.compile(optimizer=_optimizer, loss=data["loss"], jit_compile=FLAGS.jit_compile)
    pipe.build((None, *data["input_shape"]), data["input_dtype"])
    pipe.train_step(data["x"], data["y"])
    first = time.perf_counter() - start
    row = {
        **c,
        "balance": list(pipe.balance),
        "first_step_s": first,
        "resident_bytes": _memory()["current"] - before,
    }
    print(f"  built {_label(c)}: first step {first:.1f} s", file=sys.stderr, flush=True)
    return pipe, row


def measure(
    pipe: Any, row: dict[str, Any], samples: list[float], data: dict[str, Any], devices: int
) -> None:
    """Completes ``row`` (run in a process of ``devices`` devices) from its timed steps
    (``samples``, seconds), one step after resetting the allocator's peak, the simulated
    schedule and (--timeline) one instrumented step."""
    import tensorflow as tf

    step = common.median(samples)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = _memory()["current"]
    pipe.train_step(data["x"], data["y"])
    transient = _memory()["peak"] - before
    total = row["resident_bytes"] + transient
    s = pipe.schedule
    row.update(
        step_ms=1e3 * step,
        step_ms_samples=[1e3 * v for v in samples],
        examples_per_s=FLAGS.batch / step,
        compile_s=max(0.0, row["first_step_s"] - step),
        micro_batch_size=FLAGS.batch // (row["replicas"] * row["micro_batches"]),
        transient_bytes=transient,
        peak_mib_total=total / MIB,
        peak_mib_per_device=total / MIB / row["devices"],
        uniform_bubble=float(sched.simulate(s).bubble_fraction),
        peak_in_flight=list(sched.simulate(s).peak_in_flight),
        measured_bubble=0.0,
        action_ms={},
        process_devices=devices,
        status="ok",
    )
    if FLAGS.timeline and row["stages"] > 1:
        row.update(measured_timeline(pipe, data))


def measured_timeline(pipe: Any, data: dict[str, Any]) -> dict[str, Any]:
    """The bubble of one instrumented step and the mean milliseconds of each action."""
    from hybrid.run import timeline

    events, measured = common.instrumented_step(pipe, data["x"], data["y"])
    spans: dict[str, list[float]] = {}
    for e in events:
        spans.setdefault(f"{e.action.op}{e.action.stage}", []).append(e.end - e.start)
    return {
        "measured_bubble": timeline.bubble_fraction(pipe.schedule, measured),
        "action_ms": {k: 1e3 * sum(v) / len(v) for k, v in sorted(spans.items())},
    }


def _keras_model(data: dict[str, Any]) -> Any:
    """The reference model (same initial weights) as one Keras model."""
    import keras

    fresh = common.reference_model(**common.flag_values(*common.REFERENCE_MODEL_FLAGS))
    inputs = keras.Input(data["input_shape"], dtype=data["input_dtype"])
    return keras.Sequential([inputs, *fresh["layers"]])


def keras_step(data: dict[str, Any]) -> Any:
    """What the user would run instead: the same model (same initial weights) compiled by
    plain Keras on one device (XLA when --jit_compile), one ``train_on_batch`` per step."""
    model = _keras_model(data)
    model.compile(_optimizer(), data["loss"], jit_compile=FLAGS.jit_compile)
    return lambda: model.train_on_batch(data["x"], data["y"])


def ceiling_step(data: dict[str, Any], devices: int) -> Any:
    """The host's ceiling for any step on ``devices`` devices: plain Keras's one-device step
    on each device at once, on its share of the batch, nothing exchanged
    (``common.independent_step``)."""
    import tensorflow as tf

    names = [d.name for d in tf.config.list_logical_devices("CPU")[:devices]]
    return common.independent_step(  # (a Keras loss keeps no state: one for every copy)
        lambda: _keras_model(data), lambda: data["loss"], _optimizer, data["x"], data["y"], names
    )


KERAS = "plain Keras, 1 device"
CEILING = "plain Keras on every device at once"


def run_configurations(configs: list[dict], devices: int) -> None:
    """In this process: build, time (beside plain Keras) and measure every configuration;
    print RESULT lines, the last one with the environment and plain Keras's step."""
    import hybrid

    hybrid.simulate_cpu_devices(devices)
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")  # one tf.function per pipeline: retracing notes
    data = common.reference_model(**common.flag_values(*common.REFERENCE_MODEL_FLAGS))
    pipes, rows = {}, {}
    for c in configs:
        pipes[_label(c)], rows[_label(c)] = build(c, data)
    steps = {label: common.train_step(p, data["x"], data["y"]) for label, p in pipes.items()}
    baselines = {KERAS: keras_step(data)}
    if devices > 1:
        baselines[CEILING] = ceiling_step(data, devices)
    samples, _ = common.time_steps({**baselines, **steps}, warmup=2)
    for label, pipe in pipes.items():
        measure(pipe, rows[label], samples[label], data, devices)
    for label in pipes:
        print("RESULT " + json.dumps(rows[label]))
    env = common.environment()
    keras_ms = 1e3 * common.median(samples[KERAS])
    ceiling_ms = 1e3 * common.median(samples[CEILING]) if devices > 1 else keras_ms
    last = {"environment": env, "keras_step_ms": keras_ms, "ceiling_step_ms": ceiling_ms}
    print("RESULT " + json.dumps(last))


def _rank_and_derive(
    rows: list[dict], keras_ms: dict[int, float], ceiling_ms: dict[int, float]
) -> None:
    """Speedup over the best 1×1 of the same process, efficiency = speedup / N, the speedup
    over plain Keras's one-device step timed in that process (``keras_ms``), and the share
    of the host's ceiling for its device count reached (``of_ceiling``: the ceiling step of
    the process's N devices, ``ceiling_ms``, over this step; plain Keras's for one device;
    NaN for other counts)."""
    for r in rows:
        p = r["process_devices"]
        r["speedup_vs_keras"] = keras_ms[p] / r["step_ms"]
        ceiling = {1: keras_ms[p], p: ceiling_ms[p]}.get(r["devices"], float("nan"))
        r["of_ceiling"] = ceiling / r["step_ms"]
    best_single: dict[int, float] = {}
    for r in rows:
        if r["devices"] == 1:
            p = r["process_devices"]
            best_single[p] = max(best_single.get(p, 0.0), r["examples_per_s"])
    fallback = max(best_single.values(), default=0.0)
    for r in rows:
        base = best_single.get(r["process_devices"], fallback)
        r["speedup"] = r["examples_per_s"] / base if base else float("nan")
        r["efficiency"] = r["speedup"] / r["devices"] if base else float("nan")


def _of(rows: list[dict], S: int, R: int, schedule: str) -> list[dict]:
    """The rows of mesh S × R and ``schedule``, by micro-batch count."""
    mine = [r for r in rows if (r["stages"], r["replicas"], r["schedule"]) == (S, R, schedule)]
    return sorted(mine, key=lambda r: r["micro_batches"])


def _bar(
    ax: Any, x: float, height: float, width: float, text: str, color: str, label: Any = None
) -> None:
    """One bar with ``text`` on top."""
    ax.bar(x, height, width, color=color, label=label)
    ax.text(x, height, text, ha="center", va="bottom", fontsize=6)


def _throughput_panel(
    ax: Any, rows: list[dict], meshes: list[tuple[int, int]], colors: dict[str, str]
) -> None:
    """Examples per second of each mesh shape, a bar per schedule at its best M."""
    from matplotlib.patches import Patch

    for i, (S, R) in enumerate(meshes):
        present = [s for s in colors if _of(rows, S, R, s)]
        width = 0.8 / len(present)
        for j, schedule in enumerate(present):
            best = max(_of(rows, S, R, schedule), key=lambda r: r["examples_per_s"])
            x = i + (j - (len(present) - 1) / 2) * width
            _bar(
                ax, x, best["examples_per_s"], width, f"M={best['micro_batches']}", colors[schedule]
            )
    ax.set_xticks(range(len(meshes)))
    ax.set_xticklabels([f"{S}×{R}" for S, R in meshes])
    ax.set_xlabel("mesh S × R (best M of each schedule)")
    ax.set_ylabel("examples / s")
    ax.set_title("throughput vs mesh shape", fontsize=10)
    ax.legend(
        handles=[Patch(color=c, label=s) for s, c in colors.items()], fontsize=7, loc="lower left"
    )


def _efficiency_panel(
    ax: Any, rows: list[dict], meshes: list[tuple[int, int]], colors: dict[str, str]
) -> None:
    """Efficiency against M, a line per multi-device mesh shape and schedule."""
    for S, R in meshes:
        for schedule in colors:
            mine = _of(rows, S, R, schedule)
            if mine and S * R > 1:
                ax.plot(
                    [r["micro_batches"] for r in mine],
                    [r["efficiency"] for r in mine],
                    marker="o" if R > 1 else "s",
                    linestyle="-" if S > 1 else "--",
                    color=colors[schedule],
                    label=f"{S}×{R} {schedule}",
                )
    ms = sorted({r["micro_batches"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms)
    ax.set_xticklabels([str(m) for m in ms])
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("efficiency: speedup over 1×1 ÷ N")
    ax.set_ylim(0, max(1.05, max((r["efficiency"] for r in rows), default=1) * 1.1))
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("efficiency vs micro-batches", fontsize=10)


def _versus_keras_panel(ax: Any, sweeps: list[dict]) -> None:
    """Speedup over plain Keras on one device of each mesh shape (its best configuration), a
    bar per model; a tick at the ideal N and one per model at the host's ceiling (plain
    Keras on each of the N devices at once)."""
    meshes = sorted(
        {(r["stages"], r["replicas"]) for sw in sweeps for r in sw["rows"]},
        key=lambda t: (t[0] * t[1], t),
    )
    width = 0.8 / len(sweeps)
    for j, sw in enumerate(sweeps):
        for i, (S, R) in enumerate(meshes):
            mine = [r for r in sw["rows"] if (r["stages"], r["replicas"]) == (S, R)]
            if not mine:
                continue
            best = max(mine, key=lambda r: r["speedup_vs_keras"])
            x = i + (j - (len(sweeps) - 1) / 2) * width
            label = sw["label"] if i == 0 else None
            value = best["speedup_vs_keras"]
            _bar(ax, x, value, width, f"{value:.2f}", f"C{j}", label)
            n = S * R
            ceiling = sw["keras_step_ms"][n] / sw["ceiling_step_ms"][n] if n > 1 else 1.0
            ax.plot([x - width / 2, x + width / 2], [ceiling] * 2, color=f"C{j}", linestyle="--")
    for i, (S, R) in enumerate(meshes):
        ax.plot([i - 0.45, i + 0.45], [S * R] * 2, color="k", linestyle=":", linewidth=1)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylim(0, 1.35 * max(S * R for S, R in meshes))  # room for the legend
    ax.set_xticks(range(len(meshes)))
    ax.set_xticklabels([f"{S}×{R}" for S, R in meshes])
    ax.set_xlabel("mesh S × R (best configuration; dotted: ideal N; dashed: host ceiling)")
    ax.set_ylabel("speedup over plain Keras, 1 device")
    ax.set_title("vs what the user would run instead", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")


def plot(name: str, sweeps: list[dict], title: str) -> str:
    """Three panels: the main sweep's throughput per mesh shape (best M per schedule) and
    efficiency vs M; every sweep's speedup over plain Keras per mesh shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweeps[0]["rows"]
    meshes = sorted({(r["stages"], r["replicas"]) for r in rows}, key=lambda t: (t[0] * t[1], t))
    schedules = sorted({r["schedule"] for r in rows})
    colors = {s: f"C{i}" for i, s in enumerate(schedules)}
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 3.8))
    _throughput_panel(left, rows, meshes, colors)
    _efficiency_panel(middle, rows, meshes, colors)
    _versus_keras_panel(right, sweeps)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return common.save_figure(fig, name, dpi=72)


def model_values(small: bool) -> dict[str, Any]:
    """The reference-model flags of the main sweep, or of --small_model's (its model, width,
    depth and batch; the other flags as given)."""
    values = common.flag_values(*common.REFERENCE_MODEL_FLAGS)
    if small:
        try:
            model, width, depth, batch = FLAGS.small_model.split(":")
            values.update(model=model, width=int(width), depth=int(depth), batch=int(batch))
        except ValueError:
            raise app.UsageError(
                f"--small_model={FLAGS.small_model!r}: give model:width:depth:batch, e.g. "
                "transformer:64:2:32, or '' for none"
            ) from None
    return values


def run_budgets(budgets: list[int], model: dict[str, Any]) -> dict[str, Any]:
    """Every budget's runnable configurations of ``model`` (reference-model flag values) in
    a child process of its own: the rows (ranked, speedups derived), the skipped
    configurations and each child's environment (with ``keras_step_ms``)."""
    from hybrid.models import num_layers

    layers = num_layers(model["model"], model["depth"])
    rows: list[dict] = []
    skipped: list[dict] = []
    environments = {}
    passed = [f"--{name}={value}" for name, value in model.items()]
    passed += common.flag_args(*common.TIMING_FLAGS, "optimizer", "timeline", "jit_compile")
    for n in budgets:
        runnable, skip = configurations(n, layers, model["batch"])
        skipped += skip
        if not runnable:
            continue
        child = json.dumps({"devices": n, "configs": runnable})
        results = common.run_child(
            [os.path.abspath(__file__), f"--child={child}", *passed],
            env={"TF_CPU_ALLOCATOR_USE_BFC": "true"},
            timeout=4 * 3600,
        )
        environments[n] = {
            **results[-1]["environment"],
            "keras_step_ms": results[-1]["keras_step_ms"],
            "ceiling_step_ms": results[-1]["ceiling_step_ms"],
        }
        rows += results[:-1]
    _rank_and_derive(
        rows,
        {n: e["keras_step_ms"] for n, e in environments.items()},
        {n: e["ceiling_step_ms"] for n, e in environments.items()},
    )
    rows.sort(key=lambda r: -r["examples_per_s"])
    return {
        "model": model,
        "layers": layers,
        "rows": rows,
        "skipped": skipped,
        "environments": environments,
        "keras_step_ms": {n: e["keras_step_ms"] for n, e in environments.items()},
        "ceiling_step_ms": {n: e["ceiling_step_ms"] for n, e in environments.items()},
    }


def print_table(rows: list[dict], skipped: list[dict]) -> None:
    print(
        f"  {'#':>3} {'N':>2} {'mesh':>5} {'M':>3} {'schedule':<16} {'remat':<12} "
        f"{'ms/step':>8} {'ex/s':>8} {'speedup':>7} {'eff':>5} {'vs Keras':>8} {'of ceil':>7} "
        f"{'bubble':>6} "
        f"{'MiB/dev':>8} {'compile s':>9}"
    )
    for i, r in enumerate(rows, 1):
        sched_name = r["schedule"] + (
            f"(v={r['virtual_stages']})" if r["virtual_stages"] > 1 else ""
        )
        print(
            f"  {i:>3} {r['devices']:>2} {r['stages']}x{r['replicas']:<3} "
            f"{r['micro_batches']:>3} {sched_name:<16} {r['remat']:<12} {r['step_ms']:>8.2f} "
            f"{r['examples_per_s']:>8.1f} {r['speedup']:>7.2f} {r['efficiency']:>5.2f} "
            f"{r['speedup_vs_keras']:>8.2f} {r['of_ceiling']:>7.2f} "
            f"{r['measured_bubble']:>6.1%} {r['peak_mib_per_device']:>8.2f} "
            f"{r['compile_s']:>9.1f}"
        )
    for r in skipped:
        print(f"      skipped {_label(r)}: {r['status'][len('skipped: ') :]}")


def describe(model: dict[str, Any]) -> str:
    """``mlp 1024×4, batch 2048``: a sweep's model in a few words."""
    return f"{model['model']} {model['width']}×{model['depth']}, batch {model['batch']}"


def write_results(env: dict, budgets: list[int], sweeps: list[dict]) -> tuple[str, str, str]:
    """<name>.json (the main sweep's rows and skipped; the small model's under
    ``small_model``), <name>.csv (every row, labelled by ``curve``, then the skipped) and
    <name>.png; their paths."""
    config = common.flag_values(
        *common.REFERENCE_MODEL_FLAGS,
        "small_model",
        "devices",
        "micro_batches",
        "schedules",
        "single_stage_schedule",
        "remats",
        "virtual_stages",
        "optimizer",
        "baseline",
        "timeline",
        "jit_compile",
        *common.TIMING_FLAGS,
    )
    main_sweep = sweeps[0]
    result = {
        "environment": env,
        "config": config,
        "rows": main_sweep["rows"],
        "skipped": main_sweep["skipped"],
    }
    if len(sweeps) > 1:
        small = sweeps[1]
        keys = ("model", "rows", "skipped", "keras_step_ms", "ceiling_step_ms")
        result["small_model"] = {k: small[k] for k in keys}
    path = common.write_json(FLAGS.name, result)
    labelled = [dict(r, curve=sw["label"]) for sw in sweeps for r in sw["rows"] + sw["skipped"]]
    csv_path = common.write_csv(FLAGS.name, labelled)
    title = (
        f"{' | '.join(sw['label'] for sw in sweeps)}; N = {', '.join(map(str, budgets))} "
        f"simulated CPU devices ({os.cpu_count()} cores), optimizer {FLAGS.optimizer}"
    )
    return path, csv_path, plot(FLAGS.name, sweeps, title)


def summary_terms(sweep: dict, prefix: str = "") -> str:
    """The SUMMARY's terms of one sweep: its fastest multi-device configuration, and the
    slowest mesh shape's best speedup over plain Keras (``worst_mesh_vs_keras``) and best
    share of the host's ceiling (``worst_mesh_of_ceiling``)."""
    rows = sweep["rows"]
    pipelined = [r for r in rows if r["devices"] > 1]
    best = pipelined[0] if pipelined else rows[0]
    per_mesh: dict[tuple[int, int], float] = {}
    of_ceiling: dict[tuple[int, int], float] = {}
    for r in pipelined:
        key = (r["stages"], r["replicas"])
        per_mesh[key] = max(per_mesh.get(key, 0.0), r["speedup_vs_keras"])
        of_ceiling[key] = max(of_ceiling.get(key, 0.0), r["of_ceiling"])
    worst = min(per_mesh.values(), default=float("nan"))
    worst_share = min(of_ceiling.values(), default=float("nan"))
    return (
        f"{prefix}best={best['stages']}x{best['replicas']}/{best['schedule']}/"
        f"M={best['micro_batches']}/{best['remat']} {prefix}best_examples_per_s="
        f"{best['examples_per_s']:.1f} {prefix}best_speedup={best['speedup']:.3f} "
        f"{prefix}best_efficiency={best['efficiency']:.3f} "
        f"{prefix}best_speedup_vs_keras={best['speedup_vs_keras']:.3f} "
        f"{prefix}worst_mesh_vs_keras={worst:.3f} {prefix}worst_mesh_of_ceiling={worst_share:.3f}"
    )


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.child:
        spec = json.loads(FLAGS.child)
        run_configurations(spec["configs"], spec["devices"])
        return
    budgets = sorted({int(n) for n in FLAGS.devices})
    started = time.perf_counter()
    models = [model_values(small=False)] + ([model_values(small=True)] if FLAGS.small_model else [])
    sweeps = []
    for i, model in enumerate(models):
        sweep = run_budgets(budgets, model)
        kind = "compute-dominated" if i == 0 else "small model"
        sweep["label"] = f"{kind}: {describe(model)}"
        sweeps.append(sweep)
    environments = sweeps[0]["environments"]
    env = dict(next(iter(environments.values()), {}))
    env["devices"] = {n: e["devices"] for n, e in environments.items()}
    env["keras_step_ms"] = sweeps[0]["keras_step_ms"]
    env["ceiling_step_ms"] = sweeps[0]["ceiling_step_ms"]
    common.print_header(FLAGS.name, env)
    for sweep in sweeps:
        print(f"  -- {sweep['label']} --")
        print(f"  model: {sweep['model']}, {sweep['layers']} layers; optimizer {FLAGS.optimizer}")
        print(f"  plain Keras, 1 device: {sweep['keras_step_ms']} ms/step")
        keras_ms, ceiling_ms = sweep["keras_step_ms"], sweep["ceiling_step_ms"]
        ceilings = {n: round(keras_ms[n] / ms, 3) for n, ms in ceiling_ms.items()}
        print(f"  the host's ceiling (plain Keras on every device at once) vs Keras: {ceilings}")
        print(f"  {len(sweep['rows'])} configurations measured, {len(sweep['skipped'])} skipped")
        print_table(sweep["rows"], sweep["skipped"])
    path, csv_path, png = write_results(env, budgets, sweeps)
    print(f"  wrote {path}, {csv_path} and {png} in {time.perf_counter() - started:.0f} s")
    main_sweep = sweeps[0]
    terms = summary_terms(main_sweep)
    if len(sweeps) > 1:
        terms += " " + summary_terms(sweeps[1], prefix="small_")
    print(
        f"SUMMARY {FLAGS.name} devices={','.join(map(str, budgets))} "
        f"configs={len(main_sweep['rows'])} skipped={len(main_sweep['skipped'])} {terms}"
    )


if __name__ == "__main__":
    app.run(main)
