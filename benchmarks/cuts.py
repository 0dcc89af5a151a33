"""Where the cut falls, and what each stage then does: the zoo models (``zoo.py``'s builds)
cut into S stages by parameters (``balance="params"``, the old default) and by estimated
compute (``balance="compute"``, the default), each stage's share of the step measured.

Per model and S, one process with S simulated CPU devices (1 intra-op thread each), the
pipeline S×1 with M = S micro-batches and GPipe, XLA stage programs:

    estimated      each stage's share of the summed ``layer_costs.call_work`` (what
                   ``pipe.summary()`` prints and the compute cut balances)
    measured       each stage's share of the busy time of a timed step (the median over
                   ``--steps`` timed steps of every action's duration on that stage: its
                   forwards and backwards over the M micro-batches)
    largest/mean   the largest measured share over the mean (1 / S): 1.0 is an even cut

    python benchmarks/cuts.py [--models=mobilenetv2,resnet50] [--stages=2,4]

Results: cuts.json, cuts.csv (a row per model × S × balance).
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

from absl import app, flags

import common
import zoo

flags.DEFINE_list("stages", ["2", "4"], "Pipeline stages S to cut each model into.")
flags.DEFINE_list("balances", ["params", "compute"], "Cuts to compare.")
flags.DEFINE_string("cut_child", None, "Internal: measure 'model,S' in this process.")
FLAGS = flags.FLAGS


def measure(name: str, stages: int) -> list[dict[str, Any]]:
    """A row per balance of FLAGS.balances: the cut, its estimated and measured shares."""
    import keras

    import hybrid
    from hybrid.engine.api import summary

    rows = []
    for balance in FLAGS.balances:
        model, x, y = zoo.build(name)
        pipe = hybrid.Pipeline(
            model, hybrid.DeviceMesh.create(stages, 1), micro_batches=stages, balance=balance
        )
        pipe.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=FLAGS.jit_compile,
        )
        pipe.train_step(x, y)  # builds and compiles
        pipe.timed_train_step(x, y)  # compiles the timed step
        busy: list[list[float]] = [[] for _ in range(stages)]
        for _ in range(FLAGS.steps):
            _, actions = pipe.timed_train_step(x, y)
            per_stage = [0.0] * stages
            for a in actions:
                if a.action is not None:
                    per_stage[a.action.stage] += a.end - a.start
            for k in range(stages):
                busy[k].append(per_stage[k])
        measured = [statistics.median(b) for b in busy]
        work = [r.work for r in summary.stage_rows(pipe)]
        rows.append(
            {
                "model": name,
                "stages": stages,
                "balance": balance,
                "cut": list(pipe.balance),
                "estimated": [w / sum(work) for w in work],
                "measured": [m / sum(measured) for m in measured],
                "largest_over_mean": max(measured) / (sum(measured) / stages),
                "stage_ms": [1e3 * m for m in measured],
            }
        )
        del pipe, model
    return rows


def _shares(values: list[float]) -> str:
    return " ".join(f"{v:5.1%}" for v in values)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.cut_child:
        name, stages = FLAGS.cut_child.split(",")
        common.start("cuts", int(stages))
        print("RESULT " + json.dumps(measure(name, int(stages))))
        return
    env = common.start("cuts", devices=1)  # the header; each child has its own devices
    rows: list[dict[str, Any]] = []
    for name in FLAGS.models:
        for stages in (int(s) for s in FLAGS.stages):
            (got,) = common.run_child(
                [os.path.abspath(__file__), f"--cut_child={name},{stages}"]
                + common.flag_args(*_PASSED)
            )
            for row in got:
                rows.append(row)
                print(
                    f"{name:14s} S={stages} {row['balance']:8s} cut {str(row['cut']):16s} "
                    f"estimated {_shares(row['estimated'])}  measured "
                    f"{_shares(row['measured'])}  largest/mean {row['largest_over_mean']:.2f}",
                    flush=True,
                )
    common.write_json("cuts", {"environment": env, "rows": rows})
    common.write_csv("cuts", rows)


_PASSED = ("models", "balances", "batch", "image_size", "seq_len", "steps", "jit_compile")

if __name__ == "__main__":
    app.run(main)
