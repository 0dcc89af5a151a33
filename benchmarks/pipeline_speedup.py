"""Pipeline speedup: the same model on 1 stage vs 2 stages, one replica, 2 devices, M = 8.

Each logical device has one intra-op thread, so on 2 cores the two stages really run in
parallel. Efficiency = speedup / ideal, with ideal = S·M / (M + S - 1) (GPipe's bubble).
Target: efficiency ≥ 0.85.

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

flags.DEFINE_integer("rounds", 10, "Timed rounds per candidate.")
flags.DEFINE_integer("steps_per_round", 3, "Steps per round.")
flags.DEFINE_integer("width", 1024, "Dense width.")
flags.DEFINE_integer("depth", 4, "Dense(width) layers.")
flags.DEFINE_integer("batch", 256, "Global batch.")
flags.DEFINE_integer("micro_batches", 8, "Micro-batches M.")
flags.DEFINE_string("schedule", "gpipe", "Schedule for both candidates.")
flags.DEFINE_string("remat", "never", "Remat mode for both candidates.")
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    del argv
    import hybrid

    hybrid.simulate_cpu_devices(2)
    import keras
    import numpy as np
    import tensorflow as tf

    env = common.environment()
    common.print_header("pipeline_speedup", env)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(FLAGS.batch, FLAGS.width)).astype("float32"))
    y = tf.constant(rng.integers(0, 10, size=(FLAGS.batch,)).astype("int32"))

    def make(stages: int) -> hybrid.Pipeline:
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(FLAGS.width, activation="relu") for _ in range(FLAGS.depth)]
        pipe = hybrid.Pipeline(
            layers + [keras.layers.Dense(10)],
            mesh=hybrid.DeviceMesh.create(stages, 1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras.optimizers.SGD(1e-3),
            micro_batches=FLAGS.micro_batches,
            schedule=FLAGS.schedule,
            remat=FLAGS.remat,
        )
        pipe.build((None, FLAGS.width))
        print(f"  {stages} stage(s): balance {pipe.balance}")
        return pipe

    one, two = make(1), make(2)
    samples = common.time_alternating(
        {"1_stage": lambda: one.train_step(x, y), "2_stages": lambda: two.train_step(x, y)},
        rounds=FLAGS.rounds,
        steps_per_round=FLAGS.steps_per_round,
        warmup=3,
    )
    ms = {name: 1e3 * common.median(v) for name, v in samples.items()}
    speedup = ms["1_stage"] / ms["2_stages"]
    M, S = FLAGS.micro_batches, 2
    ideal = S * M / (M + S - 1)
    efficiency = speedup / ideal
    for name, value in ms.items():
        print(f"  {name:10s} {value:8.2f} ms/step (median of {FLAGS.rounds} rounds)")
    print(f"  speedup {speedup:.3f}  ideal {ideal:.3f}  efficiency {efficiency:.3f} (target >= 0.85)")
    config = {
        k: getattr(FLAGS, k)
        for k in ("rounds", "steps_per_round", "width", "depth", "batch", "micro_batches",
                  "schedule", "remat")
    }
    path = common.write_json(
        "pipeline_speedup",
        {
            "environment": env,
            "config": config,
            "ms_per_step": ms,
            "samples_s": samples,
            "speedup": speedup,
            "ideal": ideal,
            "efficiency": efficiency,
        },
    )
    common.bar_chart("pipeline_speedup", ms, "ms / step", f"1 vs 2 stages, M={M}")
    print(f"  wrote {path}")
    print(f"SUMMARY pipeline_speedup speedup={speedup:.3f} efficiency={efficiency:.3f}")


if __name__ == "__main__":
    app.run(main)
