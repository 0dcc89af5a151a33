"""Pipeline speedup: the same model on 1 stage vs 2 stages, one replica, 2 devices, M = 8.

Each logical device has one intra-op thread, so on 2 cores the two stages really run in
parallel. Efficiency = speedup / ideal, with ideal = S·M / (M + S - 1) (GPipe's bubble).
Target: efficiency ≥ 0.85 with the default remat mode ("except_last"); each mode in
``--remats`` is measured (1 and 2 stages side by side, all candidates alternating).

    python benchmarks/pipeline_speedup.py [--rounds=10]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

import common  # noqa: E402

common.define_timing_flags(rounds=10, steps_per_round=3)
common.define_model_flags(depth=4, batch=256)
flags.DEFINE_integer("micro_batches", 8, "Micro-batches M.")
flags.DEFINE_string("schedule", "gpipe", "Schedule for both candidates.")
flags.DEFINE_list("remats", ["except_last", "never", "always"], "Remat modes to measure.")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    del argv
    import hybrid

    hybrid.simulate_cpu_devices(2)
    import keras

    env = common.environment()
    common.print_header("pipeline_speedup", env)
    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)

    def make(stages: int, remat: str) -> hybrid.Pipeline:
        layers = common.dense_stack(FLAGS.width, FLAGS.depth)
        pipe = hybrid.Pipeline(
            layers,
            mesh=hybrid.DeviceMesh.create(stages, 1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras.optimizers.SGD(1e-3),
            micro_batches=FLAGS.micro_batches,
            schedule=FLAGS.schedule,
            remat=remat,
        )
        pipe.build((None, FLAGS.width))
        print(f"  {stages} stage(s), remat={remat}: balance {pipe.balance}")
        return pipe

    candidates = {}
    for remat in FLAGS.remats:
        for stages in (1, 2):
            pipe = make(stages, remat)
            candidates[f"{stages}_stage_{remat}"] = lambda pipe=pipe: pipe.train_step(x, y)
    samples = common.time_alternating(
        candidates, rounds=FLAGS.rounds, steps_per_round=FLAGS.steps_per_round, warmup=3
    )
    ms = {name: 1e3 * common.median(v) for name, v in samples.items()}
    M, S = FLAGS.micro_batches, 2
    ideal = S * M / (M + S - 1)
    speedups = {r: ms[f"1_stage_{r}"] / ms[f"2_stage_{r}"] for r in FLAGS.remats}
    efficiencies = {r: v / ideal for r, v in speedups.items()}
    for name, value in ms.items():
        print(f"  {name:22s} {value:8.2f} ms/step (median of {FLAGS.rounds} rounds)")
    for r in FLAGS.remats:
        print(
            f"  remat={r:12s} speedup {speedups[r]:.3f}  ideal {ideal:.3f}  "
            f"efficiency {efficiencies[r]:.3f}"
        )
    primary = FLAGS.remats[0]
    speedup, efficiency = speedups[primary], efficiencies[primary]
    print(f"  target: efficiency >= 0.85 with remat={primary}: {efficiency:.3f}")
    config = {
        k: getattr(FLAGS, k)
        for k in (
            "rounds",
            "steps_per_round",
            "width",
            "depth",
            "batch",
            "micro_batches",
            "schedule",
            "remats",
        )
    }
    path = common.write_json(
        "pipeline_speedup",
        {
            "environment": env,
            "config": config,
            "ms_per_step": ms,
            "samples_s": samples,
            "speedup": speedups,
            "ideal": ideal,
            "efficiency": efficiencies,
        },
    )
    common.bar_chart("pipeline_speedup", ms, "ms / step", f"1 vs 2 stages, M={M}")
    print(f"  wrote {path}")
    print(
        f"SUMMARY pipeline_speedup remat={primary} speedup={speedup:.3f} "
        f"efficiency={efficiency:.3f}"
    )


if __name__ == "__main__":
    app.run(main)
