"""Peak activation memory: GPipe vs 1F1B vs interleaved vs ZB-H1, under each remat mode.

A model whose activations dominate (8 × Dense(1024) + head, batch 4096, M = 16 micro-batches
of 256) on a 2-stage × 1-replica mesh. Each configuration runs in its own process: build,
note the bytes TensorFlow's allocator holds (weights, optimizer state), run two steps, and
report the allocator's peak minus that resident figure. The logical CPU devices share one
allocator, so the figure covers both devices; the simulated peak in-flight micro-batches per
device are printed beside it. (XLA's compiler memory is not tensor memory and is not counted.)

Targets: 1F1B holds ≤ 0.6 × GPipe's peak activation memory (remat "never"); remat "always"
holds less than "never". With --deferred each schedule also runs with remat "never" and
deferred weight gradients (``never+deferred``): every micro-batch's activations and output
gradients held until the stage's one weight-gradient pass.

    python benchmarks/memory.py
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import app, flags

import common

common.define_model_flags(depth=8, batch=4096)
flags.DEFINE_integer("micro_batches", 16, "Micro-batches M.")
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved", "zb-h1"], "Schedules.")
flags.DEFINE_list("remats", ["never", "except_last", "always"], "Remat modes.")
flags.DEFINE_bool("jit_compile", True, "XLA stage programs.")
flags.DEFINE_bool("deferred", True, "Also remat never with deferred weight gradients.")
flags.DEFINE_string("child", None, "Internal: measure 'schedule,remat' in this process.")
FLAGS = flags.FLAGS

MB = 1024 * 1024
DEFERRED = "never+deferred"  # remat "never", weight gradients deferred


def measure(schedule: str, remat: str) -> dict:
    """In this process: the peak bytes one training step allocates beyond the resident ones."""
    import hybrid
    from hybrid.core import schedule as schedule_lib

    hybrid.simulate_cpu_devices(2)
    import tensorflow as tf

    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    deferred = remat == DEFERRED
    pipe = common.schedule_pipeline(
        schedule,
        "never" if deferred else remat,
        FLAGS.micro_batches,
        1e-4,
        jit_compile=FLAGS.jit_compile,
        defer_weight_gradients=deferred,
    )
    inputs = x.numpy().nbytes + y.numpy().nbytes  # the batch itself is not the step's memory
    resident = tf.config.experimental.get_memory_info("CPU:0")["current"] - inputs
    for _ in range(2):
        pipe.train_step(x, y)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - inputs
    return {
        "schedule": schedule,
        "remat": remat,
        "peak_activation_mib": (peak - resident) / MB,
        "resident_mib": resident / MB,
        "simulated_peak_in_flight": list(schedule_lib.simulate(pipe.schedule).peak_in_flight),
    }


def measure_in_child(schedule: str, remat: str) -> dict[str, Any]:
    """:func:`measure` in a fresh process, with the allocator that keeps statistics."""
    results = common.run_child(
        [os.path.abspath(__file__), f"--child={schedule},{remat}"]
        + common.flag_args(*common.MODEL_FLAGS, "micro_batches", "jit_compile"),
        # TensorFlow's default CPU allocator keeps no statistics; its BFC allocator does.
        env={"TF_CPU_ALLOCATOR_USE_BFC": "true"},
        timeout=600,
    )
    row = results[-1]
    print(
        f"  {schedule:12s} {remat:12s} peak activations "
        f"{row['peak_activation_mib']:8.1f} MiB   (resident {row['resident_mib']:.1f} MiB,"
        f" in flight per device {row['simulated_peak_in_flight']})"
    )
    return row


def ratios(rows: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
    """1F1B / GPipe peak activations (remat never), and always / never for each schedule."""

    def peak(schedule: str, remat: str) -> float:
        for row in rows:
            if row["schedule"] == schedule and row["remat"] == remat:
                return row["peak_activation_mib"]
        return float("nan")

    ratio = peak("1f1b", "never") / peak("gpipe", "never")
    if FLAGS.deferred:
        for s in FLAGS.schedules:
            print(f"  {s:12s} deferred / never: {peak(s, DEFERRED) / peak(s, 'never'):.3f}")
    return ratio, {s: peak(s, "always") / peak(s, "never") for s in FLAGS.schedules}


def write_results(env: dict[str, Any], rows: list[dict[str, Any]], **figures: Any) -> None:
    """memory.json (environment, config, rows, ``figures``), memory.csv and memory.png."""
    config = common.flag_values(
        *common.MODEL_FLAGS, "micro_batches", "schedules", "remats", "jit_compile"
    )
    path = common.write_json(
        "memory", {"environment": env, "config": config, "rows": rows, **figures}
    )
    csv_path = common.write_csv("memory", rows)
    common.bar_chart(
        "memory",
        {f"{r['schedule']}\n{r['remat']}": r["peak_activation_mib"] for r in rows},
        "peak activation MiB",
        f"2 stages, M={FLAGS.micro_batches}, batch {FLAGS.batch}",
    )
    print(f"  wrote {path} and {csv_path}")


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.child:
        schedule, remat = FLAGS.child.split(",")
        print("RESULT " + json.dumps(measure(schedule, remat)))
        return
    env = common.start("memory", devices=2)  # as in every child, for the environment header
    activation_mb = FLAGS.batch // FLAGS.micro_batches * FLAGS.width * 4 / MB
    print(f"  one layer's output for one micro-batch: {activation_mb:.2f} MiB")
    remats = FLAGS.remats + ([DEFERRED] if FLAGS.deferred else [])
    rows = [measure_in_child(s, r) for s in FLAGS.schedules for r in remats]
    ratio, always_vs_never = ratios(rows)
    print(f"  1F1B / GPipe peak activations (remat never): {ratio:.3f} (target <= 0.6)")
    for s, r in always_vs_never.items():
        print(f"  {s:12s} always / never: {r:.3f} (target < 1)")
    write_results(env, rows, ratio_1f1b_vs_gpipe=ratio, always_vs_never=always_vs_never)
    print(
        f"SUMMARY memory ratio_1f1b_vs_gpipe={ratio:.3f} "
        + " ".join(f"always_vs_never_{s}={r:.3f}" for s, r in always_vs_never.items())
    )


if __name__ == "__main__":
    app.run(main)
