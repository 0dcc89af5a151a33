"""Graph build and compile time against S × M and against the replicas R: how long a new
Pipeline takes to build and run its first step (trace the step, compile every stage
program), and its second step.

Each configuration runs in its own process with S · R simulated devices and a fresh XLA
cache directory (nothing is loaded from an earlier process's compile; within the process the
first step compiles each stage program on one replica's device and the other replicas load
it, as the launcher does by default; ``--noxla_cache``: no cache, each device compiles its
own, what the Python API does unless ``TF_XLA_FLAGS`` names a cache): an S-stage pipeline of
--depth_per_stage × Dense(--width) per stage, R replicas, M micro-batches of --rows examples
each, GPipe, ``remat="except_last"`` (the default), XLA. Reported per configuration:

    build_s        Pipeline(...) + build(): layers, balance, a stage copy on every device
    first_step_s   the first train_step: tracing the whole step and compiling its programs
    second_step_s  the next step (with R > 1 the first step ran the replicas in turn, so that
                   all but one load the programs one compiled: the second traces the step
                   that runs them together; with R = 1, traced and compiled already)

and ``first_step_s`` against S × M (the number of actions the step issues is 2·S·R·M): it
must not grow worse than linearly. Issue 16's target: S = 8, M = 64 builds and runs its first
step in under 30 s. Against R (``--replicas``): the distinct stage programs are S whatever R,
the stage copies S · R; issue 44's goal is a build time that follows the distinct programs
(printed per S: build + first step at the largest R over R = 1).

    python benchmarks/build_time.py [--stages=2,4,8] [--micro_batches=8,16,32,64]
    python benchmarks/build_time.py --stages=2,4,8 --replicas=1,2,4 --micro_batches=8 \
        [--noxla_cache]
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
flags.DEFINE_list("replicas", ["1"], "Replicas R (S · R simulated devices).")
flags.DEFINE_bool(
    "xla_cache", True, "A fresh persistent XLA cache per configuration (the launcher's default)."
)
flags.DEFINE_integer("width", 256, "Dense width.")
flags.DEFINE_integer("depth_per_stage", 2, "Dense layers per stage.")
flags.DEFINE_integer("rows", 4, "Examples per micro-batch.")
flags.DEFINE_string("child", None, "Internal: measure 'S,R,M' in this process.")
FLAGS = flags.FLAGS


def measure(stages: int, replicas: int, micro_batches: int) -> dict[str, Any]:
    """In this process (S · R simulated devices): build, first and second step times."""
    import hybrid

    hybrid.simulate_cpu_devices(stages * replicas)
    import keras

    x, y = common.synthetic_batch(FLAGS.rows * micro_batches * replicas, FLAGS.width)
    start = time.perf_counter()
    pipe = common.dense_pipeline(
        FLAGS.width,
        FLAGS.depth_per_stage * stages - 1,  # + the head: depth_per_stage layers per stage
        hybrid.DeviceMesh.create(stages, replicas),
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
        "replicas": replicas,
        "stage_copies": stages * replicas,
        "micro_batches": micro_batches,
        "actions": 2 * stages * replicas * micro_batches,
        "build_s": built - start,
        "first_step_s": first - built,
        "second_step_s": second - first,
        "build_and_first_step_s": first - start,
        "build_and_two_steps_s": second - start,
    }


def plot(rows: list[dict[str, Any]]) -> str:
    """First-step time against S × M, one line per S."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(common.RESULTS, "build_time.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    for stages, replicas in sorted({(r["stages"], r["replicas"]) for r in rows}):
        mine = [r for r in rows if (r["stages"], r["replicas"]) == (stages, replicas)]
        ax.plot(
            [r["stages"] * r["micro_batches"] for r in mine],
            [r["build_and_first_step_s"] for r in mine],
            marker="o",
            label=f"S={stages}" + (f" R={replicas}" if replicas > 1 else ""),
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
        stages, replicas, micro_batches = map(int, FLAGS.child.split(","))
        print("RESULT " + json.dumps(measure(stages, replicas, micro_batches)))
        return
    env = common.start("build_time", devices=1)  # the header; each child has its own devices
    rows = []
    for stages in map(int, FLAGS.stages):
        for replicas in map(int, FLAGS.replicas):
            for micro_batches in map(int, FLAGS.micro_batches):
                with tempfile.TemporaryDirectory() as cache:
                    flag = f"--tf_xla_persistent_cache_directory={cache}"
                    (row,) = common.run_child(
                        [os.path.abspath(__file__), f"--child={stages},{replicas},{micro_batches}"]
                        + common.flag_args("width", "depth_per_stage", "rows"),
                        env={"TF_XLA_FLAGS": flag if FLAGS.xla_cache else ""},
                    )
                row["xla_cache"] = FLAGS.xla_cache
                rows.append(row)
                print(
                    f"  S={stages} R={replicas} M={micro_batches:3d}  build {row['build_s']:6.2f} s"
                    f"  first step {row['first_step_s']:6.2f} s  second step "
                    f"{row['second_step_s']:6.3f} s"
                )
    # seconds per action of the largest M over the smallest, per S (and R): <= 1 is at most
    # linear; build + two steps (the second traces the step of all replicas together) at the
    # largest R over R = 1, per S and M: 1 follows the distinct programs (S), R the stage
    # copies (S · R)
    growth, over_replicas = {}, {}
    for stages, replicas in sorted({(r["stages"], r["replicas"]) for r in rows}):
        mine = [r for r in rows if (r["stages"], r["replicas"]) == (stages, replicas)]
        if len(mine) < 2:
            continue
        mine.sort(key=lambda r: r["actions"])
        per_action = [r["build_and_first_step_s"] / r["actions"] for r in mine]
        name = f"S{stages}" + (f"R{replicas}" if replicas > 1 else "")
        growth[name] = per_action[-1] / per_action[0]
        print(f"  {name}: seconds per action, largest M / smallest: {growth[name]:.2f}")
    for stages, micro_batches in sorted({(r["stages"], r["micro_batches"]) for r in rows}):
        mine = [r for r in rows if (r["stages"], r["micro_batches"]) == (stages, micro_batches)]
        mine.sort(key=lambda r: r["replicas"])
        if len(mine) > 1 and mine[0]["replicas"] == 1:
            ratio = mine[-1]["build_and_two_steps_s"] / mine[0]["build_and_two_steps_s"]
            over_replicas[f"S{stages}M{micro_batches}R{mine[-1]['replicas']}"] = ratio
            print(
                f"  S={stages} M={micro_batches}: build + two steps at R={mine[-1]['replicas']}"
                f" over R=1: {ratio:.2f} (the stage copies grew {mine[-1]['replicas']}x, the "
                "distinct programs 1x)"
            )
    common.write_json(
        "build_time",
        {"environment": env, "rows": rows, "growth": growth, "over_replicas": over_replicas},
    )
    common.write_csv("build_time", rows)
    print(f"  wrote {plot(rows)}")
    largest = max(rows, key=lambda r: r["actions"])
    print(
        f"SUMMARY build_time S={largest['stages']} M={largest['micro_batches']} "
        f"build_and_first_step_s={largest['build_and_first_step_s']:.2f} "
        + " ".join(f"growth_{name}={g:.2f}" for name, g in growth.items())
        + "".join(f" over_replicas_{name}={r:.2f}" for name, r in over_replicas.items())
    )


if __name__ == "__main__":
    app.run(main)
