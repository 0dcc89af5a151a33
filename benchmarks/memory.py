"""Peak activation memory: GPipe vs 1F1B vs interleaved vs ZB-H1, under each remat mode.

A model whose activations dominate (8 × Dense(1024) + head, batch 4096, M = 16 micro-batches
of 256) on a 2-stage × 1-replica mesh. Each configuration runs in its own process: build,
note the bytes TensorFlow's allocator holds (weights, optimizer state), run two steps, and
report the allocator's peak minus that resident figure. The logical CPU devices share one
allocator, so the figure covers both devices; the simulated peak in-flight micro-batches per
device are printed beside it. (XLA's compiler memory is not tensor memory and is not counted.)

Targets: 1F1B holds ≤ 0.6 × GPipe's peak activation memory (remat "never"); remat "always"
holds less than "never".

    python benchmarks/memory.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

import common  # noqa: E402

common.define_model_flags(depth=8, batch=4096)
flags.DEFINE_integer("micro_batches", 16, "Micro-batches M.")
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved", "zb-h1"], "Schedules.")
flags.DEFINE_list("remats", ["never", "except_last", "always"], "Remat modes.")
flags.DEFINE_bool("jit_compile", True, "XLA stage programs.")
flags.DEFINE_string("child", None, "Internal: measure 'schedule,remat' in this process.")
FLAGS = flags.FLAGS

MB = 1024 * 1024


def measure(schedule: str, remat: str) -> dict:
    """In this process: the peak bytes one training step allocates beyond the resident ones."""
    import hybrid

    hybrid.simulate_cpu_devices(2)
    import keras
    import tensorflow as tf

    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    layers = common.dense_stack(FLAGS.width, FLAGS.depth)
    pipe = hybrid.Pipeline(
        layers,
        mesh=hybrid.DeviceMesh.create(2, 1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=keras.optimizers.SGD(1e-4),
        micro_batches=FLAGS.micro_batches,
        schedule=schedule,
        remat=remat,
        virtual_stages=2 if schedule == "interleaved" else 1,
        jit_compile=FLAGS.jit_compile,
    )
    pipe.build((None, FLAGS.width))
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
        "simulated_peak_in_flight": list(hybrid.schedule.simulate(pipe.schedule).peak_in_flight),
    }


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.child:
        schedule, remat = FLAGS.child.split(",")
        print("RESULT " + json.dumps(measure(schedule, remat)))
        return
    import hybrid

    hybrid.simulate_cpu_devices(2)  # as in every child, for the environment header
    env = common.environment()
    common.print_header("memory", env)
    activation_mb = FLAGS.batch // FLAGS.micro_batches * FLAGS.width * 4 / MB
    print(f"  one layer's output for one micro-batch: {activation_mb:.2f} MiB")

    rows = []
    for schedule in FLAGS.schedules:
        for remat in FLAGS.remats:
            child = subprocess.run(
                [sys.executable, os.path.abspath(__file__), f"--child={schedule},{remat}"]
                + [
                    f"--{k}={getattr(FLAGS, k)}"
                    for k in ("width", "depth", "batch", "micro_batches", "jit_compile")
                ],
                capture_output=True,
                # TensorFlow's default CPU allocator keeps no statistics; its BFC allocator does.
                env={**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true"},
                text=True,
                timeout=600,
            )
            lines = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
            if child.returncode or not lines:
                raise RuntimeError(f"{schedule}/{remat} failed:\n{child.stderr[-3000:]}")
            row = json.loads(lines[-1][len("RESULT ") :])
            rows.append(row)
            print(
                f"  {schedule:12s} {remat:12s} peak activations "
                f"{row['peak_activation_mib']:8.1f} MiB   (resident {row['resident_mib']:.1f} MiB,"
                f" in flight per device {row['simulated_peak_in_flight']})"
            )

    def peak(schedule: str, remat: str) -> float:
        for row in rows:
            if row["schedule"] == schedule and row["remat"] == remat:
                return row["peak_activation_mib"]
        return float("nan")

    ratio = peak("1f1b", "never") / peak("gpipe", "never")
    always_vs_never = {s: peak(s, "always") / peak(s, "never") for s in FLAGS.schedules}
    print(f"  1F1B / GPipe peak activations (remat never): {ratio:.3f} (target <= 0.6)")
    for s, r in always_vs_never.items():
        print(f"  {s:12s} always / never: {r:.3f} (target < 1)")
    config = {
        k: getattr(FLAGS, k)
        for k in ("width", "depth", "batch", "micro_batches", "schedules", "remats", "jit_compile")
    }
    path = common.write_json(
        "memory",
        {
            "environment": env,
            "config": config,
            "rows": rows,
            "ratio_1f1b_vs_gpipe": ratio,
            "always_vs_never": always_vs_never,
        },
    )
    import csv

    csv_path = os.path.join(common.RESULTS, "memory.csv")
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    common.bar_chart(
        "memory",
        {f"{r['schedule']}\n{r['remat']}": r["peak_activation_mib"] for r in rows},
        "peak activation MiB",
        f"2 stages, M={FLAGS.micro_batches}, batch {FLAGS.batch}",
    )
    print(f"  wrote {path} and {csv_path}")
    print(
        f"SUMMARY memory ratio_1f1b_vs_gpipe={ratio:.3f} "
        + " ".join(f"always_vs_never_{s}={r:.3f}" for s, r in always_vs_never.items())
    )


if __name__ == "__main__":
    app.run(main)
