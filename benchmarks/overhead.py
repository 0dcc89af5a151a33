"""Overhead of the Pipeline machinery: a 1×1 mesh vs a hand-written Keras training step.

Both train the same model (4 × Dense(1024) + a head, batch 256, Adam) on one device in one
process, timed in alternation. The hand-written step is a ``tf.function`` with a
GradientTape and ``optimizer.apply``, once plain and once XLA-compiled (the Pipeline compiles
its stage programs with XLA). Target: pipeline / hand-written XLA ≤ 1.05.

    python benchmarks/overhead.py [--rounds=10]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from absl import app, flags

import common

common.define_timing_flags(rounds=10, steps_per_round=5)
common.define_model_flags(depth=4, batch=256)
FLAGS = flags.FLAGS


def handwritten_step(x: Any, y: Any, loss: Any, jit: bool) -> Callable[[], float]:
    """One training step of the same model as a hand-written ``tf.function`` (GradientTape,
    Adam), XLA-compiled when ``jit``."""
    import keras
    import tensorflow as tf

    model = keras.Sequential(
        [keras.Input((FLAGS.width,))] + common.dense_stack(FLAGS.width, FLAGS.depth)
    )
    optimizer = keras.optimizers.Adam(1e-4)
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=jit)
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return value

    return lambda: float(step(x, y))


def candidates() -> dict[str, Callable[[], Any]]:
    """The 1×1 pipeline and the hand-written step with and without XLA, on one fixed batch."""
    import keras

    import hybrid

    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    pipe = common.dense_pipeline(
        FLAGS.width,
        FLAGS.depth,
        hybrid.DeviceMesh.create(1, 1),
        keras.optimizers.Adam(1e-4),
        loss=loss,
        micro_batches=1,
        remat="never",
    )
    return {
        "pipeline_1x1": common.train_step(pipe, x, y),
        "keras_tf_function_xla": handwritten_step(x, y, loss, jit=True),
        "keras_tf_function": handwritten_step(x, y, loss, jit=False),
    }


def ratios(ms: dict[str, float]) -> tuple[float, float]:
    """The pipeline's step time over the hand-written one's, with and without XLA; printed."""
    ratio_xla = ms["pipeline_1x1"] / ms["keras_tf_function_xla"]
    ratio_plain = ms["pipeline_1x1"] / ms["keras_tf_function"]
    print(f"  ratio pipeline / hand-written XLA step:   {ratio_xla:.3f}  (target <= 1.05)")
    print(f"  ratio pipeline / hand-written plain step: {ratio_plain:.3f}")
    return ratio_xla, ratio_plain


def main(argv: list[str]) -> None:
    del argv
    env = common.start("overhead", devices=1)
    samples, ms = common.time_steps(candidates(), warmup=3)
    common.print_ms(ms, width=24)
    ratio_xla, ratio_plain = ratios(ms)
    common.write_timed(
        "overhead",
        env,
        common.flag_values(*common.TIMING_FLAGS, *common.MODEL_FLAGS),
        samples,
        ms,
        "1×1 pipeline vs hand-written Keras step",
        ratio_vs_xla=ratio_xla,
        ratio_vs_plain=ratio_plain,
    )
    print(f"SUMMARY overhead ratio_vs_xla={ratio_xla:.3f} ratio_vs_plain={ratio_plain:.3f}")


if __name__ == "__main__":
    app.run(main)
