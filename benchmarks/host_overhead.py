"""What the host costs per step: a model so small that a step is nearly all host work, on
meshes up to 8 × 4 = 32 simulated devices and M up to 32, ``fit``'s step time fitted, per
mesh over its M, as

    ms per step = fixed + per_action × actions

    (actions = 2·S·R·M: every stage program's forward and backward on every micro-batch of
    every replica; ``fixed``: the mesh's cost per step whatever M, which grows with its S·R
    stage copies: each one's update, all-reduce and share of the graph)

for ``steps_per_execution`` N = 1 and N = --executions (Keras's meaning: N steps per call).
Also per mesh: build time (``Pipeline`` + ``compile`` + the first step, which traces the step
and compiles its stage programs) and the time to trace an execution of N steps, against the
number of stage copies S·R.

Beside it, what a user would run instead, timed side by side in alternation (--rounds,
medians): the one-stage model in plain Keras on one device (``compile(jit_compile=True)``):
``train_on_batch``, ``fit`` at N = 1 and at N = --executions; and the same model as a 1 × 1,
M = 1 pipeline, the same calls.

The model: --layers_per_stage × Dense(--width) per stage + Dense(1), mse, SGD, GPipe,
``remat="never"``, XLA, --rows examples per micro-batch: an action runs one small layer (plus
the head on the last stage), so what it costs is the engine's and the runtime's, not the
model's. Step times are ``fit``'s own, between the end of its first execution and the end of
its last (a callback's clock): the loop, the feed, the callbacks, the step. Issue 44's goals
(printed): the median over meshes of µs per action ≤ 30; the pipeline's ``fit`` at N = 1 ≤
Keras's ``train_on_batch``, and at N = 8 ≤ Keras's ``fit`` at N = 8.

    python benchmarks/host_overhead.py [--meshes=1x1,2x1,...] [--micro_batches=1,8,32]

Writes ``results/host_overhead.{json,csv,png}``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from absl import app, flags

import common

flags.DEFINE_list(
    "meshes", ["1x1", "2x1", "1x2", "2x2", "4x2", "2x4", "4x4", "8x4"], "Meshes S x R."
)
flags.DEFINE_list("micro_batches", ["1", "8", "32"], "Micro-batch counts M.")
flags.DEFINE_integer("executions", 8, "The N > 1 of steps_per_execution measured.")
flags.DEFINE_integer("steps", 48, "Timed steps per fit (a multiple of --executions).")
flags.DEFINE_integer("layers_per_stage", 1, "Dense layers per pipeline stage.")
flags.DEFINE_integer("width", 8, "Dense width.")
flags.DEFINE_integer("rows", 2, "Examples per micro-batch.")
flags.DEFINE_integer("rounds", 5, "Rounds of the side-by-side comparison (medians).")
FLAGS = flags.FLAGS

DEVICES = 32


def model(stages: int) -> Any:
    """--layers_per_stage Dense layers per stage, then the head."""
    import keras

    keras.utils.set_random_seed(0)
    layers = [keras.Input((FLAGS.width,))]
    layers += [
        keras.layers.Dense(FLAGS.width, activation="relu")
        for _ in range(stages * FLAGS.layers_per_stage)
    ]
    return keras.Sequential([*layers, keras.layers.Dense(1)])


def data(batch: int, steps: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, FLAGS.width)).astype("float32")
    return x, x[:, :1].copy()


class _Clock:
    """Keras callback: the time of every batch end (one per execution)."""

    def __new__(cls) -> Any:
        import keras

        class Clock(keras.callbacks.Callback):
            def __init__(self) -> None:
                super().__init__()
                self.ends: list[float] = []

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                self.ends.append(time.perf_counter())

        return Clock()


def fit_seconds_per_step(m: Any, x: Any, y: Any, batch: int, steps: int) -> float:
    """Seconds per step of ``m.fit`` on ``steps`` batches, its first execution left out."""
    clock = _Clock()
    m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
    executions = len(clock.ends)
    return (clock.ends[-1] - clock.ends[0]) / (steps * (executions - 1) / executions)


def call_seconds(call: Callable[[], Any], repeats: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def side_by_side(batch: int) -> dict[str, float]:
    """The one-stage model's step, in alternation over --rounds (medians, ms): plain Keras on
    one device (``train_on_batch``, ``fit`` at N = 1 and N = --executions) and the 1 × 1,
    M = 1 pipeline (``train_on_batch``, ``fit`` at both N)."""
    import keras

    import hybrid

    steps, n = FLAGS.steps, FLAGS.executions
    x, y = data(batch, steps)
    candidates: dict[str, Callable[[], float]] = {}
    for who in ("keras", "pipeline"):
        for executions in (1, n):
            m = model(1)
            if who == "pipeline":
                m = hybrid.Pipeline(m, hybrid.DeviceMesh.create(1, 1), micro_batches=1)
            m.compile(
                optimizer=keras.optimizers.SGD(1e-3),
                loss="mse",
                jit_compile=True,
                steps_per_execution=executions,
            )
            fit_seconds_per_step(m, x[: batch * 2 * n], y[: batch * 2 * n], batch, 2 * n)
            candidates[f"{who}_fit_N{executions}"] = lambda m=m: fit_seconds_per_step(
                m, x, y, batch, steps
            )
            if executions == 1:
                candidates[f"{who}_train_on_batch"] = lambda m=m: call_seconds(
                    lambda: m.train_on_batch(x[:batch], y[:batch]), steps
                )
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(FLAGS.rounds):
        for name, run in candidates.items():
            samples[name].append(run())
    return {name: 1e3 * common.median(values) for name, values in samples.items()}


def measure(stages: int, replicas: int, micro_batches: int) -> dict[str, Any]:
    """Build time, then fit's seconds per step at N = 1 and N = --executions."""
    import keras

    import hybrid

    batch = FLAGS.rows * replicas * micro_batches
    x, y = data(batch, FLAGS.steps)
    start = time.perf_counter()
    pipe = hybrid.Pipeline(
        model(stages),
        hybrid.DeviceMesh.create(stages, replicas),
        micro_batches=micro_batches,
        schedule="gpipe",
        remat="never",
    )
    pipe.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    pipe.train_on_batch(x[:batch], y[:batch])
    built = time.perf_counter() - start
    row: dict[str, Any] = {
        "mesh": f"{stages}x{replicas}",
        "stages": stages,
        "replicas": replicas,
        "micro_batches": micro_batches,
        "actions": 2 * stages * replicas * micro_batches,
        "stage_copies": stages * replicas,
        "build_s": built,
    }
    for executions in (1, FLAGS.executions):
        pipe.steps_per_execution = executions
        warm = 2 * executions
        start = time.perf_counter()
        fit_seconds_per_step(pipe, x[: batch * warm], y[: batch * warm], batch, warm)
        row[f"warm_N{executions}_s"] = time.perf_counter() - start  # traces the execution once
        row[f"step_N{executions}_ms"] = 1e3 * fit_seconds_per_step(pipe, x, y, batch, FLAGS.steps)
    return row


def fit_lines(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, float]]:
    """Per mesh, least squares of ``key`` (ms per step) against actions over its M: the
    fixed ms of a step on that mesh, µs per action, and the worst relative error."""
    import numpy as np

    lines = {}
    for mesh in dict.fromkeys(r["mesh"] for r in rows):
        mine = [r for r in rows if r["mesh"] == mesh]
        if len(mine) < 2:
            continue
        actions = np.array([r["actions"] for r in mine], dtype=float)
        ms = np.array([r[key] for r in mine])
        per_action, fixed = np.polyfit(actions, ms, 1)
        error = float(np.max(np.abs(fixed + per_action * actions - ms) / ms))
        lines[mesh] = {
            "fixed_ms": float(fixed),
            "per_action_us": float(1e3 * per_action),
            "worst_error": error,
            "stage_copies": mine[0]["stage_copies"],
        }
    return lines


def plot(rows: list[dict[str, Any]], lines: dict[str, dict[str, dict[str, float]]]) -> str:
    """Left: ms per step against actions, each mesh's fitted line, N = 1 and N = 8. Right:
    build time against stage copies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for n, color in ((1, "#4c72b0"), (FLAGS.executions, "#dd8452")):
        key = f"step_N{n}_ms"
        left.scatter(
            [r["actions"] for r in rows], [r[key] for r in rows], color=color, s=14,
            label=f"fit, steps_per_execution={n}",
        )  # fmt: skip
        for mesh, line in lines[key].items():
            top = max(r["actions"] for r in rows if r["mesh"] == mesh)
            low = min(r["actions"] for r in rows if r["mesh"] == mesh)
            left.plot(
                [low, top],
                [line["fixed_ms"] + 1e-3 * line["per_action_us"] * a for a in (low, top)],
                color=color,
                linewidth=0.8,
            )
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("actions per step (2·S·R·M)")
    left.set_ylabel("ms per step")
    left.set_title("fit's step on a tiny model (lines: each mesh over M)")
    left.legend(fontsize=8)
    for m in sorted({r["micro_batches"] for r in rows}):
        mine = sorted((r for r in rows if r["micro_batches"] == m), key=lambda r: r["stage_copies"])
        right.plot(
            [r["stage_copies"] for r in mine],
            [r["build_s"] for r in mine],
            marker="o",
            label=f"M={m}",
        )
    right.set_xlabel("stage copies S·R")
    right.set_ylabel("build + first step (s)")
    right.set_title("Build time per mesh")
    right.legend(fontsize=8)
    fig.tight_layout()
    return common.save_figure(fig, "host_overhead")


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.steps % FLAGS.executions:
        raise app.UsageError(f"--steps={FLAGS.steps}: give a multiple of --executions")
    env = common.start("host_overhead", devices=DEVICES)
    n = FLAGS.executions
    rows = []
    for mesh in FLAGS.meshes:
        stages, replicas = map(int, mesh.split("x"))
        for micro_batches in map(int, FLAGS.micro_batches):
            row = measure(stages, replicas, micro_batches)
            rows.append(row)
            print(
                f"  {row['mesh']:>4s} M={micro_batches:2d} actions {row['actions']:5d}  "
                f"build {row['build_s']:6.2f} s  step N=1 {row['step_N1_ms']:8.2f} ms  "
                f"N={n} {row[f'step_N{n}_ms']:8.2f} ms  (its execution traced in "
                f"{row[f'warm_N{n}_s']:.1f} s)"
            )
    lines = {key: fit_lines(rows, key) for key in ("step_N1_ms", f"step_N{n}_ms")}
    for key, per_mesh in lines.items():
        print(f"  {key}, per mesh over M: fixed ms + µs per action (worst point off its line)")
        for mesh, line in per_mesh.items():
            print(
                f"    {mesh:>4s}: {line['fixed_ms']:7.3f} ms + {line['per_action_us']:5.1f} µs"
                f"  ({100 * line['worst_error']:.0f} %)"
            )
    per_action = {
        key: common.median([line["per_action_us"] for line in per_mesh.values()])
        for key, per_mesh in lines.items()
    }
    side = side_by_side(FLAGS.rows)
    print(f"  the one-stage model side by side (medians of {FLAGS.rounds} rounds):")
    for name, value in side.items():
        print(f"    {name:26s} {value:7.3f} ms/step")
    goals = {
        "median_per_action_us<=30": per_action[f"step_N{n}_ms"] <= 30.0,
        "pipeline_fit_N1<=keras_train_on_batch": side["pipeline_fit_N1"]
        <= side["keras_train_on_batch"],
        f"pipeline_fit_N{n}<=keras_fit_N{n}": side[f"pipeline_fit_N{n}"] <= side[f"keras_fit_N{n}"],
    }
    print(
        "  median µs per action: "
        + ", ".join(f"{key} {value:.1f}" for key, value in per_action.items())
    )
    for goal, met in goals.items():
        print(f"  goal {goal}: {'met' if met else 'NOT met'}")
    results = {"fits": lines, "per_action_us": per_action, "side_by_side_ms": side, "goals": goals}
    config = common.flag_values(
        "meshes",
        "micro_batches",
        "executions",
        "steps",
        "layers_per_stage",
        "width",
        "rows",
        "rounds",
    )
    path = common.write_json(
        "host_overhead", {"environment": env, "config": config, "rows": rows, **results}
    )
    common.write_csv("host_overhead", rows)
    print(f"  wrote {path}, {plot(rows, lines)}")
    print(
        f"SUMMARY host_overhead per_action_us={per_action[f'step_N{n}_ms']:.1f} "
        + " ".join(f"{name}_ms={value:.3f}" for name, value in side.items())
    )


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    app.run(main)
