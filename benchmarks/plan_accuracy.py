"""The planner's predicted step time against the step measured, per model and mesh.

Per model, one process with 4 simulated CPU devices (1 intra-op thread each): for each mesh
S×R of ``--meshes``, ``hybrid.plan`` on that mesh alone (devices S·R, stages [S]; its
default hardware: this host's calibrated cost per step and per action,
``hybrid.planning.host_calibration``) ranks the candidates; the top ``--top`` of them are
built with ``Pipeline(model, mesh, config=candidate.config)`` and timed side by side in
alternation (``--rounds`` rounds of ``--steps`` steps each, after two warm-up steps; the
median round), so the host's noise hits them alike:

    predicted_ms   the plan's step time for the candidate
    measured_ms    the step measured
    error          predicted / measured - 1
    best_gap       the planner's first candidate's measured step over the fastest
                   measured of the top candidates, minus 1 (0: it chose the fastest)

    python benchmarks/plan_accuracy.py [--models=mlp,transformer,resnet] [--plan_meshes=1x1,2x1]

The models are the reference ones as layer lists (what ``hybrid.plan`` profiles today):
``mlp`` (4 blocks of Dense(256), LayerNorm, GELU), ``transformer`` (4 blocks, width 64,
``--seq_len`` tokens) and ``resnet`` (4 residual blocks of width 16, ``--image_size``
images); the global batch is ``--batch``.
Results: plan_accuracy.json, plan_accuracy.csv.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

from absl import app, flags

import common

flags.DEFINE_list("models", ["mlp", "transformer", "resnet"], "Reference models to plan.")
flags.DEFINE_integer("batch", 32, "Global batch.")
flags.DEFINE_integer("seq_len", 32, "Transformer tokens per example.")
flags.DEFINE_integer("image_size", 16, "ResNet image height and width.")
flags.DEFINE_integer("steps", 5, "Steps per timing round of each candidate.")
flags.DEFINE_integer("rounds", 9, "Timing rounds (the candidates alternate; the median).")
flags.DEFINE_list("plan_meshes", ["1x1", "2x1", "1x2", "2x2"], "Meshes SxR to plan and time.")
flags.DEFINE_integer("top", 3, "Candidates timed per mesh, the planner's first ones.")
flags.DEFINE_string("plan_child", None, "Internal: measure this model in this process.")
FLAGS = flags.FLAGS


def _model(name: str) -> tuple[list[Any], tuple[int, ...], str, Any, Any]:
    """(layers, input shape, input dtype, x, y) of a reference model, seeded."""
    import numpy as np

    from hybrid.models import mlp, resnet, transformer

    rng, n = np.random.default_rng(0), FLAGS.batch
    if name == "transformer":
        seq = FLAGS.seq_len
        layers = transformer(seq_len=seq, d_model=64, num_blocks=4)
        x = rng.integers(0, 256, size=(n, seq)).astype("int32")
        return layers, (seq,), "int32", x, rng.integers(0, 256, size=(n, seq)).astype("int32")
    if name == "resnet":
        size = FLAGS.image_size
        layers = resnet(width=16, num_blocks=4)
        x = rng.normal(size=(n, size, size, 3)).astype("float32")
        return layers, (size, size, 3), "float32", x, rng.integers(0, 10, size=(n,))
    layers = mlp(width=256, depth=4)
    x = rng.normal(size=(n, 256)).astype("float32")
    return layers, (256,), "float32", x, rng.integers(0, 10, size=(n,)).astype("int32")


def _loss() -> Any:
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def measure(name: str) -> list[dict[str, Any]]:
    import keras

    import hybrid

    rows = []
    for spec in FLAGS.plan_meshes:
        S, R = (int(v) for v in spec.split("x"))
        layers, shape, dtype, x, y = _model(name)
        plan = hybrid.plan(
            layers,
            devices=S * R,
            global_batch=FLAGS.batch,
            stages=[S],
            input_shape=shape,
            input_dtype=dtype,
            loss=_loss(),
            optimizer=lambda: keras.optimizers.SGD(0.01),
            optimizer_slots=0,
            verbose=0,
        )
        steps = {}
        for rank, candidate in enumerate(plan.ranked[: FLAGS.top]):
            layers, _, _, x, y = _model(name)
            pipe = hybrid.Pipeline(layers, hybrid.DeviceMesh.create(S, R), config=candidate.config)
            pipe.compile(optimizer=keras.optimizers.SGD(0.01), loss=_loss())
            steps[rank] = common.train_step(pipe, x, y)
        samples = common.time_alternating(steps, FLAGS.rounds, FLAGS.steps, warmup=2)
        timed = [
            (candidate, statistics.median(samples[rank]))
            for rank, candidate in enumerate(plan.ranked[: FLAGS.top])
        ]
        fastest = min(t for _, t in timed)
        for rank, (candidate, measured) in enumerate(timed):
            c = candidate.config
            rows.append(
                {
                    "model": name,
                    "mesh": spec,
                    "rank": rank,
                    "config": f"M={c.micro_batches} {c.schedule} remat={c.remat} "
                    f"v={c.virtual_stages} defer={c.defer_weight_gradients} "
                    f"balance={list(c.balance)}",
                    "predicted_ms": 1e3 * candidate.step_time,
                    "measured_ms": 1e3 * measured,
                    "error": candidate.step_time / measured - 1,
                    "best_gap": timed[0][1] / fastest - 1 if rank == 0 else None,
                }
            )
    return rows


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.plan_child:
        common.start("plan_accuracy", 4)
        print("RESULT " + json.dumps(measure(FLAGS.plan_child)))
        return
    env = common.start("plan_accuracy", devices=1)
    rows: list[dict[str, Any]] = []
    for name in FLAGS.models:
        (got,) = common.run_child(
            [os.path.abspath(__file__), f"--plan_child={name}"]
            + common.flag_args(
                "plan_meshes", "top", "batch", "image_size", "seq_len", "steps", "rounds"
            )
        )
        for row in got:
            rows.append(row)
            gap = "" if row["best_gap"] is None else f"  chosen vs fastest {row['best_gap']:+.0%}"
            print(
                f"{name:12s} {row['mesh']:4s} #{row['rank']} {row['config']:58s} predicted "
                f"{row['predicted_ms']:8.2f} ms  measured {row['measured_ms']:8.2f} ms  "
                f"error {row['error']:+.0%}{gap}",
                flush=True,
            )
    errors = sorted(abs(r["error"]) for r in rows)
    if errors:
        print(
            f"SUMMARY plan_accuracy median |error| {statistics.median(errors):.0%}, worst "
            f"{errors[-1]:.0%} over {len(errors)} candidates"
        )
    common.write_json("plan_accuracy", {"environment": env, "rows": rows})
    common.write_csv("plan_accuracy", rows)


if __name__ == "__main__":
    app.run(main)
