"""Input feeding: ``fit`` with batches prepared on the devices ahead of the step (``prefetch``)
against ``fit`` preparing each batch when its step starts, and plain Keras ``fit`` on one
device, side by side in one process.

Every candidate trains the same model (--depth × Dense(--width)) on the same tf.data input
pipeline: batches of --batch random examples whose map does --augment rounds of host work
per example (an "augmentation" standing in for decoding), for --steps steps per ``fit`` call.
One timed sample is one ``fit`` call; the table reports milliseconds per step.

    keras_1_device     keras.Model.fit on one device (the whole batch per step)
    pipeline_prefetch0 hybrid.Pipeline.fit, 2 stages × 1 replica, prefetch=0
    pipeline_prefetch2 the same with prefetch=2 (a feeding thread prepares and places batches)

Twice: with the input pipeline as written (no ``.prefetch``: the map's work falls between
steps unless something reads ahead) and with ``.prefetch(tf.data.AUTOTUNE)`` appended (what
the tf.data guide recommends: then what the feed still takes off the critical path is the
padding, the split into shards and the copies onto the devices; on a simulated CPU mesh those
copies are free, on accelerators and across hosts they are real transfers).

    python benchmarks/input_feed.py [--rounds=5] [--steps=8] [--augment=8]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from absl import app, flags

import common

common.define_timing_flags(rounds=5, steps_per_round=1)
common.define_model_flags(depth=4, batch=256, width=512)
flags.DEFINE_integer("steps", 8, "Steps per fit call (one timed sample).")
flags.DEFINE_integer("augment", 8, "Rounds of per-example host work in the dataset's map.")
flags.DEFINE_integer("micro_batches", 4, "Micro-batches of the pipelines.")
FLAGS = flags.FLAGS


def dataset(prefetched: bool) -> Any:
    """An endless dataset of --batch examples with --augment rounds of work per example."""
    import tensorflow as tf

    def augment(x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        for _ in range(FLAGS.augment):
            x = tf.tanh(x + tf.roll(x, shift=1, axis=0) * 0.5)
        return x, y

    x, y = common.synthetic_batch(FLAGS.batch * 4, FLAGS.width)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().map(augment).batch(FLAGS.batch)
    return data.prefetch(tf.data.AUTOTUNE) if prefetched else data


def candidates(prefetched: bool) -> dict[str, Callable[[], Any]]:
    """Each candidate: one ``fit`` call of --steps steps on the dataset."""
    import keras

    import hybrid

    data = dataset(prefetched)
    fit = dict(epochs=1, steps_per_epoch=FLAGS.steps, verbose=0, shuffle=False)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    layers = common.dense_stack(FLAGS.width, FLAGS.depth)
    model = keras.Sequential([keras.Input((FLAGS.width,)), *layers])
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss=loss, jit_compile=True)
    steps: dict[str, Callable[[], Any]] = {"keras_1_device": lambda: model.fit(data, **fit)}
    for depth in (0, 2):
        pipe = common.dense_pipeline(
            FLAGS.width,
            FLAGS.depth,
            hybrid.DeviceMesh.create(2, 1),
            keras.optimizers.SGD(1e-3),
            micro_batches=FLAGS.micro_batches,
            prefetch=depth,
        )
        steps[f"pipeline_prefetch{depth}"] = lambda pipe=pipe: pipe.fit(data, **fit)
    return steps


def main(argv: list[str]) -> None:
    del argv
    env = common.start("input_feed", devices=2)
    results: dict[str, Any] = {}
    samples: dict[str, list[float]] = {}
    ms: dict[str, float] = {}
    for prefetched in (False, True):
        label = "tfdata_prefetch" if prefetched else "no_tfdata_prefetch"
        got, medians = common.time_steps(candidates(prefetched), warmup=1)
        for name in got:
            samples[f"{label}/{name}"] = [s / FLAGS.steps for s in got[name]]
            ms[f"{label}/{name}"] = medians[name] / FLAGS.steps
        gain = medians["pipeline_prefetch0"] / medians["pipeline_prefetch2"]
        versus_keras = medians["keras_1_device"] / medians["pipeline_prefetch2"]
        results[label] = {"prefetch_speedup": gain, "speedup_over_keras": versus_keras}
    common.print_ms(ms, width=44)
    for label, values in results.items():
        print(
            f"  {label}: prefetch=2 is {values['prefetch_speedup']:.3f}x prefetch=0, "
            f"{values['speedup_over_keras']:.3f}x Keras on one device"
        )
    common.write_timed(
        "input_feed",
        env,
        common.flag_values(*common.MODEL_FLAGS, "rounds", "steps", "augment", "micro_batches"),
        samples,
        ms,
        f"fit, {FLAGS.steps} steps per call: prefetch to devices vs none vs Keras",
        ratios=results,
    )
    gains = " ".join(f"{k}={v['prefetch_speedup']:.3f}" for k, v in results.items())
    print(f"SUMMARY input_feed prefetch_speedup {gains}")


if __name__ == "__main__":
    app.run(main)
