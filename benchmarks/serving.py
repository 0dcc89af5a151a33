"""Serving throughput: the whole model's SavedModel on one device vs the per-stage export
served pipelined on 2 devices (``hybrid.run.serving``), side by side in one process.

The model (--depth × Dense(--width)) is trained for one step by a 2-stage pipeline, exported
both ways, and each export is loaded back and timed on the same batch of --batch examples:

    whole       the ``serving_default`` signature of ``pipe.export(path)`` (what TF Serving
                runs), on one logical device
    pipelined   ``hybrid.run.serving.load(path/stages).predict(x, micro_batches=M)``: stage i on
                device i, micro-batches flowing through them

Each logical device has one intra-op thread, so on 2 cores the two stages really run in
parallel; the ideal speedup of the pipelined run is S·M / (M + S - 1). Outputs are checked
equal before timing.

    python benchmarks/serving.py [--rounds=10] [--micro_batches=8]
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

from absl import app, flags

import common

common.define_timing_flags(rounds=10, steps_per_round=3)
common.define_model_flags(depth=4, batch=256)
flags.DEFINE_integer("micro_batches", 8, "Micro-batches of the pipelined run.")
FLAGS = flags.FLAGS


def candidates(directory: str) -> dict[str, Callable[[], Any]]:
    """The whole-model and the pipelined server on one fixed batch, outputs checked equal."""
    import keras
    import numpy as np
    import tensorflow as tf

    import hybrid
    from hybrid.run import serving

    devices = [d.name for d in tf.config.list_logical_devices("CPU")[:2]]
    pipe = common.dense_pipeline(
        FLAGS.width,
        FLAGS.depth,
        hybrid.DeviceMesh.create(2, 1),
        keras.optimizers.SGD(1e-3),
        micro_batches=FLAGS.micro_batches,
    )
    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    pipe.train_step(x, y)
    whole_path, stages_path = os.path.join(directory, "whole"), os.path.join(directory, "stages")
    pipe.export(whole_path)
    pipe.export(stages_path, per_stage=True)
    with tf.device(devices[0]):
        whole = tf.saved_model.load(whole_path).signatures["serving_default"]
    (name,) = whole.structured_input_signature[1]
    pipelined = serving.load(stages_path, devices)
    expected = pipe.predict(x, verbose=0)
    np.testing.assert_allclose(next(iter(whole(**{name: x}).values())), expected, atol=1e-4)
    np.testing.assert_allclose(pipelined.predict(x, FLAGS.micro_batches), expected, atol=1e-4)
    return {
        "whole_1_device": lambda: next(iter(whole(**{name: x}).values())).numpy(),
        "pipelined_2_stages": lambda: pipelined.predict(x, FLAGS.micro_batches),
    }


def main(argv: list[str]) -> None:
    del argv
    env = common.start("serving", devices=2)
    with tempfile.TemporaryDirectory() as directory:
        samples, ms = common.time_steps(candidates(directory), warmup=3)
    common.print_ms(ms, width=20)
    M, S = FLAGS.micro_batches, 2
    ideal = S * M / (M + S - 1)
    speedup = ms["whole_1_device"] / ms["pipelined_2_stages"]
    throughput = {name: FLAGS.batch / (value / 1e3) for name, value in ms.items()}
    for name, value in throughput.items():
        print(f"  {name:20s} {value:10.0f} examples/s")
    print(f"  pipelined speedup {speedup:.3f} (ideal {ideal:.3f})")
    common.write_timed(
        "serving",
        env,
        common.flag_values(*common.TIMING_FLAGS, *common.MODEL_FLAGS, "micro_batches"),
        samples,
        ms,
        f"serving {FLAGS.batch} examples: whole model vs 2 stages pipelined, M={M}",
        examples_per_second=throughput,
        speedup=speedup,
        ideal=ideal,
    )
    print(f"SUMMARY serving speedup={speedup:.3f} ideal={ideal:.3f}")


if __name__ == "__main__":
    app.run(main)
