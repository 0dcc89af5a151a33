"""Pipeline speedup: the same model on 1 stage vs 2 stages, one replica, 2 devices, M = 8.

Each logical device has one intra-op thread, so on 2 cores the two stages really run in
parallel. Efficiency = speedup / ideal, with ideal = S·M / (M + S - 1) (GPipe's bubble).
Target: efficiency ≥ 0.85 with the default remat mode ("except_last"); each mode in
``--remats`` is measured (1 and 2 stages side by side, all candidates alternating).

    python benchmarks/pipeline_speedup.py [--rounds=10]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from absl import app, flags

import common

common.define_timing_flags(rounds=10, steps_per_round=3)
common.define_model_flags(depth=4, batch=256)
flags.DEFINE_integer("micro_batches", 8, "Micro-batches M.")
flags.DEFINE_string("schedule", "gpipe", "Schedule for both candidates.")
flags.DEFINE_list("remats", ["except_last", "never", "always"], "Remat modes to measure.")
FLAGS = flags.FLAGS


def candidates() -> dict[str, Callable[[], Any]]:
    """For each remat mode: the model on 1 stage and on 2 stages, on one fixed batch."""
    import keras

    import hybrid

    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    steps = {}
    for remat in FLAGS.remats:
        for stages in (1, 2):
            pipe = common.dense_pipeline(
                FLAGS.width,
                FLAGS.depth,
                hybrid.DeviceMesh.create(stages, 1),
                keras.optimizers.SGD(1e-3),
                micro_batches=FLAGS.micro_batches,
                schedule=FLAGS.schedule,
                remat=remat,
            )
            print(f"  {stages} stage(s), remat={remat}: balance {pipe.balance}")
            steps[f"{stages}_stage_{remat}"] = common.train_step(pipe, x, y)
    return steps


def speedups(ms: dict[str, float]) -> tuple[float, dict[str, float], dict[str, float]]:
    """GPipe's ideal speedup on 2 stages, and each remat mode's speedup and efficiency."""
    M, S = FLAGS.micro_batches, 2
    ideal = S * M / (M + S - 1)
    measured = {r: ms[f"1_stage_{r}"] / ms[f"2_stage_{r}"] for r in FLAGS.remats}
    return ideal, measured, {r: v / ideal for r, v in measured.items()}


def main(argv: list[str]) -> None:
    del argv
    env = common.start("pipeline_speedup", devices=2)
    samples, ms = common.time_steps(candidates(), warmup=3)
    ideal, speedup_of, efficiency_of = speedups(ms)
    common.print_ms(ms, width=22)
    for r in FLAGS.remats:
        print(
            f"  remat={r:12s} speedup {speedup_of[r]:.3f}  ideal {ideal:.3f}  "
            f"efficiency {efficiency_of[r]:.3f}"
        )
    primary = FLAGS.remats[0]
    speedup, efficiency = speedup_of[primary], efficiency_of[primary]
    print(f"  target: efficiency >= 0.85 with remat={primary}: {efficiency:.3f}")
    common.write_timed(
        "pipeline_speedup",
        env,
        common.flag_values(
            *common.TIMING_FLAGS, *common.MODEL_FLAGS, "micro_batches", "schedule", "remats"
        ),
        samples,
        ms,
        f"1 vs 2 stages, M={FLAGS.micro_batches}",
        speedup=speedup_of,
        ideal=ideal,
        efficiency=efficiency_of,
    )
    print(
        f"SUMMARY pipeline_speedup remat={primary} speedup={speedup:.3f} "
        f"efficiency={efficiency:.3f}"
    )


if __name__ == "__main__":
    app.run(main)
