"""What the host costs per step: a model so small that a step is nearly all host work, on
meshes up to 8 × 4 = 32 simulated devices and M up to 32, fitted as

    seconds per step = fixed + per_action × actions + per_copy × S·R

    (actions = 2·S·R·M: every stage program's forward and backward on every micro-batch of
    every replica; S·R stage copies: each one's update, all-reduce and share of the graph)

for ``fit`` with ``steps_per_execution`` N = 1 and N = --executions (Keras's meaning: N steps
per call). Beside it, in the same process, what a user would run instead: the same model in
plain Keras on one device (``compile(jit_compile=True)``), its ``train_on_batch`` and its
``fit`` at the same two N. Also reported per mesh: build time (``Pipeline`` + ``compile`` +
the first step, which traces the step and compiles its stage programs) against the number of
stage copies S·R and of distinct stage programs (S: the replicas and micro-batches of a stage
run one program).

The model: --layers_per_stage × Dense(--width) per stage + Dense(1), mse, SGD, GPipe,
``remat="never"``, XLA, --rows examples per micro-batch: an action runs one small layer (plus
the head on the last stage), so what it costs is the engine's and the runtime's, not the
model's. Keras runs the one-stage model. Step times are ``fit``'s own, between the end of its first
execution and the end of its last (a callback's clock): the loop, the feed, the callbacks,
the step. Issue 44's goals (printed with the figures): per action ≤ 30 µs; the whole 1 × 1,
M = 1 step (host cost only, the fitted fixed term being an extrapolation) at N = 1 ≤ Keras's
``train_on_batch``, and at N = 8 ≤ Keras's ``fit`` at N = 8.

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


def keras_reference(batch: int) -> dict[str, float]:
    """Plain Keras on one device, the one-stage model: train_on_batch, fit at N = 1 and
    N = --executions."""
    import keras

    steps, n = FLAGS.steps, FLAGS.executions
    x, y = data(batch, steps)
    out = {}
    for executions in (1, n):
        m = model(1)
        m.compile(
            optimizer=keras.optimizers.SGD(1e-3),
            loss="mse",
            jit_compile=True,
            steps_per_execution=executions,
        )
        fit_seconds_per_step(m, x[: batch * n * 2], y[: batch * n * 2], batch, 2 * n)  # warm
        out[f"keras_fit_N{executions}"] = fit_seconds_per_step(m, x, y, batch, steps)
        if executions == 1:
            out["keras_train_on_batch"] = call_seconds(
                lambda m=m: m.train_on_batch(x[:batch], y[:batch]), steps
            )
    return out


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


def fit_line(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Least squares of ``key`` (ms per step) against actions and stage copies: fixed ms,
    µs per action, µs per stage copy, and the largest relative error over the rows."""
    import numpy as np

    terms = np.array([[1.0, r["actions"], r["stage_copies"]] for r in rows])
    ms = np.array([r[key] for r in rows])
    (fixed, per_action, per_copy), *_ = np.linalg.lstsq(terms, ms, rcond=None)
    error = float(np.max(np.abs(terms @ [fixed, per_action, per_copy] - ms) / ms))
    return {
        "fixed_ms": float(fixed),
        "per_action_us": float(1e3 * per_action),
        "per_copy_us": float(1e3 * per_copy),
        "worst_error": error,
    }


def plot(rows: list[dict[str, Any]], lines: dict[str, dict[str, float]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for n, color in ((1, "#4c72b0"), (FLAGS.executions, "#dd8452")):
        key, line = f"step_N{n}_ms", lines[f"step_N{n}_ms"]
        actions = [r["actions"] for r in rows]
        left.scatter(actions, [r[key] for r in rows], color=color, label=f"fit, N={n}")
        fitted = [
            line["fixed_ms"]
            + 1e-3 * line["per_action_us"] * r["actions"]
            + 1e-3 * line["per_copy_us"] * r["stage_copies"]
            for r in rows
        ]
        left.scatter(
            actions,
            fitted,
            color=color,
            marker="_",
            s=120,
            label=f"{line['fixed_ms']:.2f} ms + {line['per_action_us']:.1f} µs/action + "
            f"{line['per_copy_us']:.0f} µs/copy",
        )
    left.set_xscale("symlog", linthresh=10)
    left.set_yscale("log")
    left.set_xlabel("actions per step (2·S·R·M)")
    left.set_ylabel("ms per step")
    left.set_title("fit's step on a tiny model")
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
    keras_ms = {k: 1e3 * v for k, v in keras_reference(FLAGS.rows).items()}
    lines = {key: fit_line(rows, key) for key in ("step_N1_ms", f"step_N{n}_ms")}
    fixed1, fixed_n = lines["step_N1_ms"]["fixed_ms"], lines[f"step_N{n}_ms"]["fixed_ms"]
    per_action_n = lines[f"step_N{n}_ms"]["per_action_us"]
    print(f"  Keras, one device, batch {FLAGS.rows}: " + "  ".join(
        f"{k} {v:.3f} ms" for k, v in keras_ms.items()
    ))  # fmt: skip
    for key, line in lines.items():
        print(
            f"  {key}: {line['fixed_ms']:.3f} ms fixed + {line['per_action_us']:.1f} µs/action "
            f"+ {line['per_copy_us']:.0f} µs/stage copy (worst point off the fit "
            f"{100 * line['worst_error']:.0f} %)"
        )
    # the whole step of the one-stage model on one device (1×1, M=1: all of it host cost,
    # nothing subtracted) against Keras's step of the same model
    (smallest,) = [r for r in rows if r["stage_copies"] == 1 and r["micro_batches"] == 1] or [
        min(rows, key=lambda r: r["actions"])
    ]
    print(
        f"  1x1 M=1 fit step: N=1 {smallest['step_N1_ms']:.3f} ms, N={n} "
        f"{smallest[f'step_N{n}_ms']:.3f} ms"
    )
    goals = {
        "per_action_us<=30": per_action_n <= 30.0,
        "step_1x1_N1<=keras_train_on_batch": smallest["step_N1_ms"]
        <= keras_ms["keras_train_on_batch"],
        f"step_1x1_N{n}<=keras_fit_N{n}": smallest[f"step_N{n}_ms"] <= keras_ms[f"keras_fit_N{n}"],
    }
    for goal, met in goals.items():
        print(f"  goal {goal}: {'met' if met else 'NOT met'}")
    results = {"fits": lines, "keras_ms": keras_ms, "goals": goals}
    config = common.flag_values(
        "meshes", "micro_batches", "executions", "steps", "layers_per_stage", "width", "rows"
    )
    path = common.write_json(
        "host_overhead", {"environment": env, "config": config, "rows": rows, **results}
    )
    common.write_csv("host_overhead", rows)
    print(f"  wrote {path}, {plot(rows, lines)}")
    keras_n = keras_ms[f"keras_fit_N{n}"]
    print(
        f"SUMMARY host_overhead fixed_N1_ms={fixed1:.3f} fixed_N{n}_ms={fixed_n:.3f} "
        f"per_action_us={per_action_n:.1f} keras_train_on_batch_ms="
        f"{keras_ms['keras_train_on_batch']:.3f} keras_fit_N{n}_ms={keras_n:.3f}"
    )


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    app.run(main)
