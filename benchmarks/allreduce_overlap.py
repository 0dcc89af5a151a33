"""Whether each stage's gradient all-reduce overlaps the backward of the stages before it.

A 2 × 2 mesh (2 stages × 2 replicas, 4 simulated CPU devices, one intra-op thread each),
--depth × Dense(--width), batch --batch, SGD, 1F1B, ``remat="never"``, XLA. A stage's
all-reduce waits only for its own device row (``reduction.all_stages``), so the last stage
sums its gradients while stage 0 still runs its last backwards; only stage 0's all-reduce
is left on the step's tail. From --rounds timed steps (``timed_train_step``: every action
and every device's all-reduce bracketed by that device's clock), per step:

    step_ms                  the timed step (replica 0's devices, first start to last end)
    allreduce_ms[d]          device d's all-reduce span
    stage0_busy_after_ms     how long device 0 still computed after device 1's all-reduce ended
    hidden_fraction          the part of device 1's all-reduce spent while device 0 computed

    python benchmarks/allreduce_overlap.py [--rounds=5] [--micro_batches=4]

Writes benchmarks/results/allreduce_overlap.json; ends with one SUMMARY line (medians).
"""

from __future__ import annotations

from typing import Any

from absl import app, flags

import common

common.define_model_flags(depth=4, batch=256)
flags.DEFINE_integer("rounds", 5, "Timed steps (after two that trace and warm).")
flags.DEFINE_integer("micro_batches", 4, "M per replica.")
FLAGS = flags.FLAGS


def overlap(view: Any) -> dict[str, Any]:
    """One timed step's all-reduce spans and how much of device 1's ran beside device 0's
    compute (``view``: the pipeline's ``last_timeline``)."""
    last = {d: max(e.end for e in view.actions if e.device == d) for d in (0, 1)}
    spans = {e.device: (e.start, e.end) for e in view.reduces}
    start, end = spans[1]
    hidden = max(0.0, min(end, last[0]) - start)
    return {
        "step_ms": 1e3 * max(e.end for e in view.actions + view.reduces),
        "allreduce_ms": {d: 1e3 * (t - s) for d, (s, t) in sorted(spans.items())},
        "stage0_busy_after_ms": 1e3 * max(0.0, last[0] - end),
        "hidden_fraction": hidden / (end - start) if end > start else 1.0,
    }


def main(argv: list[str]) -> None:
    del argv
    env = common.start("allreduce_overlap", devices=4)
    import keras

    import hybrid

    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    pipe = common.dense_pipeline(
        FLAGS.width,
        FLAGS.depth,
        hybrid.DeviceMesh.create(2, 2),
        keras.optimizers.SGD(1e-3),
        micro_batches=FLAGS.micro_batches,
        schedule="1f1b",
        remat="never",
    )
    common.instrumented_step(pipe, x, y)  # traces and warms
    steps = []
    for i in range(FLAGS.rounds):
        pipe.timed_train_step(x, y)
        steps.append(overlap(pipe.last_timeline))
        s = steps[-1]
        spans = ", ".join(f"device {d} {ms:.2f}" for d, ms in s["allreduce_ms"].items())
        print(
            f"  step {i}: {s['step_ms']:.1f} ms; all-reduce ms: {spans}; device 0 busy "
            f"{s['stage0_busy_after_ms']:.1f} ms after device 1's ended; hidden "
            f"{s['hidden_fraction']:.0%}"
        )
    medians = {
        "step_ms": common.median([s["step_ms"] for s in steps]),
        "stage1_allreduce_ms": common.median([s["allreduce_ms"][1] for s in steps]),
        "stage0_allreduce_ms": common.median([s["allreduce_ms"][0] for s in steps]),
        "stage0_busy_after_ms": common.median([s["stage0_busy_after_ms"] for s in steps]),
        "hidden_fraction": common.median([s["hidden_fraction"] for s in steps]),
    }
    path = common.write_json("allreduce_overlap", {"environment": env, "steps": steps, **medians})
    print(f"  wrote {path}")
    print("SUMMARY allreduce_overlap " + " ".join(f"{k}={v:.3f}" for k, v in medians.items()))


if __name__ == "__main__":
    app.run(main)
