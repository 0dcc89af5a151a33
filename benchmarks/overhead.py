"""Overhead of the Pipeline machinery: a 1×1 mesh vs a hand-written Keras training step.

Both train the same model (4 × Dense(1024) + a head, batch 256, Adam) on one device in one
process, timed in alternation. The hand-written step is a ``tf.function`` with a
GradientTape and ``optimizer.apply``, once plain and once XLA-compiled (the Pipeline compiles
its stage programs with XLA). Target: pipeline / hand-written XLA ≤ 1.05.

    python benchmarks/overhead.py [--rounds=10]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

import common  # noqa: E402

common.define_timing_flags(rounds=10, steps_per_round=5)
common.define_model_flags(depth=4, batch=256)
FLAGS = flags.FLAGS


def main(argv: list[str]) -> None:
    del argv
    import hybrid

    hybrid.simulate_cpu_devices(1)
    import keras
    import tensorflow as tf

    env = common.environment()
    common.print_header("overhead", env)
    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    pipe = hybrid.Pipeline(
        common.dense_stack(FLAGS.width, FLAGS.depth),
        mesh=hybrid.DeviceMesh.create(1, 1),
        loss=loss,
        optimizer=keras.optimizers.Adam(1e-4),
        micro_batches=1,
        remat="never",
    )
    pipe.build((None, FLAGS.width))

    def handwritten(jit: bool):
        model = keras.Sequential(
            [keras.Input((FLAGS.width,))] + common.dense_stack(FLAGS.width, FLAGS.depth)
        )
        optimizer = keras.optimizers.Adam(1e-4)
        optimizer.build(model.trainable_variables)

        @tf.function(jit_compile=jit)
        def step(x, y):
            with tf.GradientTape() as tape:
                value = loss(y, model(x, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return value

        return lambda: float(step(x, y))

    samples = common.time_alternating(
        {
            "pipeline_1x1": lambda: pipe.train_step(x, y),
            "keras_tf_function_xla": handwritten(True),
            "keras_tf_function": handwritten(False),
        },
        rounds=FLAGS.rounds,
        steps_per_round=FLAGS.steps_per_round,
        warmup=3,
    )
    ms = {name: 1e3 * common.median(v) for name, v in samples.items()}
    ratio_xla = ms["pipeline_1x1"] / ms["keras_tf_function_xla"]
    ratio_plain = ms["pipeline_1x1"] / ms["keras_tf_function"]
    for name, value in ms.items():
        print(f"  {name:24s} {value:8.2f} ms/step (median of {FLAGS.rounds} rounds)")
    print(f"  ratio pipeline / hand-written XLA step:   {ratio_xla:.3f}  (target <= 1.05)")
    print(f"  ratio pipeline / hand-written plain step: {ratio_plain:.3f}")
    config = {
        k: getattr(FLAGS, k) for k in ("rounds", "steps_per_round", "width", "depth", "batch")
    }
    path = common.write_json(
        "overhead",
        {
            "environment": env,
            "config": config,
            "ms_per_step": ms,
            "samples_s": samples,
            "ratio_vs_xla": ratio_xla,
            "ratio_vs_plain": ratio_plain,
        },
    )
    common.bar_chart("overhead", ms, "ms / step", "1×1 pipeline vs hand-written Keras step")
    print(f"  wrote {path}")
    print(f"SUMMARY overhead ratio_vs_xla={ratio_xla:.3f} ratio_vs_plain={ratio_plain:.3f}")


if __name__ == "__main__":
    app.run(main)
