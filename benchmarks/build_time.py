"""Graph build and compile time against S × M: how long a new Pipeline takes to build and run
its first step (trace the step, compile every stage program), and its second step.

Each configuration runs in its own process with S simulated devices (a fresh XLA cache
directory each, so nothing is loaded from an earlier compile): an S-stage pipeline of
--depth_per_stage × Dense(--width) per stage, 1 replica, M micro-batches of --rows examples
each, GPipe, ``remat="except_last"`` (the default), XLA. Reported per configuration:

    build_s        Pipeline(...) + build(): layers, balance, a stage copy on every device
    first_step_s   the first train_step: tracing the whole step and compiling its programs
    second_step_s  the next step (traced and compiled already)

and ``first_step_s`` against S × M (the number of actions the step issues is 2·S·M): it must
not grow worse than linearly. Issue 16's target: S = 8, M = 64 builds and runs its first step
in under 30 s.

    python benchmarks/build_time.py [--stages=2,4,8] [--micro_batches=8,16,32,64]
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

from absl import app, flags

import common

flags.DEFINE_list("stages", ["2", "4", "8"], "Pipeline stages S (one device each).")
flags.DEFINE_list("micro_batches", ["8", "16", "32", "64"], "Micro-batches M.")
flags.DEFINE_integer("width", 256, "Dense width.")
flags.DEFINE_integer("depth_per_stage", 2, "Dense layers per stage.")
flags.DEFINE_integer("rows", 4, "Examples per micro-batch.")
flags.DEFINE_string("child", None, "Internal: measure 'S,M' in this process.")
FLAGS = flags.FLAGS


def measure(stages: int, micro_batches: int) -> dict[str, Any]:
    """In this process (S simulated devices): build, first and second step times."""
    import hybrid

    hybrid.simulate_cpu_devices(stages)
    import keras

    x, y = common.synthetic_batch(FLAGS.rows * micro_batches, FLAGS.width)
    start = time.perf_counter()
    pipe = common.dense_pipeline(
        FLAGS.width,
        FLAGS.depth_per_stage * stages - 1,  # + the head: depth_per_stage layers per stage
        hybrid.DeviceMesh.create(stages, 1),
        keras.optimizers.SGD(1e-3),
        micro_batches=micro_batches,
    )
    built = time.perf_counter()
    pipe.train_step(x, y)
    first = time.perf_counter()
    pipe.train_step(x, y)
    second = time.perf_counter()
    return {
        "stages": stages,
        "micro_batches": micro_batches,
        "actions": 2 * stages * micro_batches,
        "build_s": built - start,
        "first_step_s": first - built,
        "second_step_s": second - first,
        "build_and_first_step_s": first - start,
    }


def plot(rows: list[dict[str, Any]]) -> str:
    """First-step time against S × M, one line per S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(common.RESULTS, "build_time.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for stages in sorted({r["stages"] for r in rows}):
        mine = [r for r in rows if r["stages"] == stages]
        ax.plot(
            [r["stages"] * r["micro_batches"] for r in mine],
            [r["build_and_first_step_s"] for r in mine],
            marker="o",
            label=f"S={stages}",
        )
    ax.axhline(30, color="grey", linestyle="--", label="target (S=8, M=64)")
    ax.set_xlabel("S × M")
    ax.set_ylabel("build + first step (s)")
    ax.set_title("Pipeline build and compile time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.child:
        stages, micro_batches = map(int, FLAGS.child.split(","))
        print("RESULT " + json.dumps(measure(stages, micro_batches)))
        return
    env = common.start("build_time", devices=1)  # the header; each child has its own devices
    rows = []
    for stages in map(int, FLAGS.stages):
        for micro_batches in map(int, FLAGS.micro_batches):
            with tempfile.TemporaryDirectory() as cache:
                flag = f"--tf_xla_persistent_cache_directory={cache}"
                (row,) = common.run_child(
                    [os.path.abspath(__file__), f"--child={stages},{micro_batches}"]
                    + common.flag_args("width", "depth_per_stage", "rows"),
                    env={"TF_XLA_FLAGS": flag},
                )
            rows.append(row)
            print(
                f"  S={stages} M={micro_batches:3d}  build {row['build_s']:6.2f} s  first step "
                f"{row['first_step_s']:6.2f} s  second step {row['second_step_s']:6.3f} s"
            )
    # seconds per action of the largest M over the smallest, per S: <= 1 is at most linear
    growth = {}
    for stages in sorted({r["stages"] for r in rows}):
        mine = sorted((r for r in rows if r["stages"] == stages), key=lambda r: r["actions"])
        per_action = [r["build_and_first_step_s"] / r["actions"] for r in mine]
        growth[stages] = per_action[-1] / per_action[0]
        print(f"  S={stages}: seconds per action, largest M / smallest: {growth[stages]:.2f}")
    common.write_json("build_time", {"environment": env, "rows": rows, "growth": growth})
    common.write_csv("build_time", rows)
    print(f"  wrote {plot(rows)}")
    largest = max(rows, key=lambda r: r["actions"])
    print(
        f"SUMMARY build_time S={largest['stages']} M={largest['micro_batches']} "
        f"build_and_first_step_s={largest['build_and_first_step_s']:.2f} "
        + " ".join(f"growth_S{s}={g:.2f}" for s, g in growth.items())
    )


if __name__ == "__main__":
    app.run(main)
