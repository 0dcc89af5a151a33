"""Schedules side by side: step time, and simulated vs measured timelines, on 2 devices.

Every registered schedule trains the same model (4 × Dense(1024) + head, batch 256, M = 8)
on a 2-stage × 1-replica mesh (2 logical devices, one per core), timed in alternation in one
process. For each schedule one instrumented step records when every action started and
ended on its device; the mean measured duration of each action kind per stage calibrates
``schedule.simulate``, whose predicted bubble is printed beside the measured one, and both
timelines are drawn in ``benchmarks/results/schedules_<name>.png``.

    python benchmarks/schedules.py [--rounds=8] [--remat=never]
"""

from __future__ import annotations

import collections
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

import common  # noqa: E402

common.define_timing_flags(rounds=8, steps_per_round=3)
common.define_model_flags(depth=4, batch=256)
flags.DEFINE_integer("micro_batches", 8, "Micro-batches M.")
flags.DEFINE_string("remat", "never", "Remat mode for every schedule.")
FLAGS = flags.FLAGS


def calibrated_costs(schedule, events):
    """Mean measured seconds of F, B and W per model stage -> schedule.Costs."""
    from hybrid.core.schedule import Costs, Op

    spans = collections.defaultdict(list)
    for e in events:
        spans[(e.action.op, e.action.stage)].append(e.end - e.start)
    K = schedule.num_model_stages

    def mean(op, k):
        values = spans.get((op, k), [])
        return sum(values) / len(values) if values else 0.0

    forward = [mean(Op.F, k) for k in range(K)]
    if schedule.splits_backward:
        return Costs(
            forward=forward,
            backward=[mean(Op.B, k) for k in range(K)],
            weight=[mean(Op.W, k) for k in range(K)],
        )
    return Costs(forward=forward, backward=[mean(Op.B, k) for k in range(K)], weight=0.0)


def main(argv: list[str]) -> None:
    del argv
    import hybrid

    hybrid.simulate_cpu_devices(2)
    import keras

    from hybrid import timeline
    from hybrid.core import schedule as sched

    env = common.environment()
    common.print_header("schedules", env)
    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)

    pipes = {}
    for name in sched.names():
        layers = common.dense_stack(FLAGS.width, FLAGS.depth)
        pipes[name] = hybrid.Pipeline(
            layers,
            mesh=hybrid.DeviceMesh.create(2, 1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=keras.optimizers.SGD(1e-3),
            micro_batches=FLAGS.micro_batches,
            schedule=name,
            remat=FLAGS.remat,
            virtual_stages=2 if name == "interleaved" else 1,
        )
        pipes[name].build((None, FLAGS.width))
        print(f"  {name}: balance {pipes[name].balance}")
    samples = common.time_alternating(
        {name: (lambda p=p: p.train_step(x, y)) for name, p in pipes.items()},
        rounds=FLAGS.rounds,
        steps_per_round=FLAGS.steps_per_round,
        warmup=3,
    )
    ms = {name: 1e3 * common.median(v) for name, v in samples.items()}
    rows = {}
    for name, pipe in pipes.items():
        for _ in range(2):
            pipe.timed_train_step(x, y)  # trace and warm the instrumented step
        _, events = pipe.timed_train_step(x, y)
        s = pipe.schedule
        measured = [(e.action, e.start, e.end) for e in events]
        measured_bubble = timeline.bubble_fraction(s, measured)
        predicted = sched.simulate(s, calibrated_costs(s, events))
        uniform = sched.simulate(s)
        path = os.path.join(common.RESULTS, f"schedules_{name}.png")
        os.makedirs(common.RESULTS, exist_ok=True)
        timeline.plot_timelines(
            [
                (f"{name}: simulated with measured action costs", s, predicted.timeline),
                (f"{name}: measured (one instrumented step)", s, measured),
            ],
            path,
        )
        rows[name] = {
            "ms_per_step": ms[name],
            "measured_bubble": measured_bubble,
            "predicted_bubble": float(predicted.bubble_fraction),
            "uniform_cost_bubble": float(uniform.bubble_fraction),
            "predicted_step_ms": 1e3 * float(predicted.makespan),
            "instrumented_step_ms": 1e3 * max(e.end for e in events),
            "peak_in_flight": list(predicted.peak_in_flight),
            "png": path,
        }
    print(
        f"  {'schedule':12s} {'ms/step':>8s} {'bubble meas':>12s} {'bubble pred':>12s} "
        f"{'uniform':>8s} {'peak in flight':>15s}"
    )
    for name, row in rows.items():
        print(
            f"  {name:12s} {row['ms_per_step']:8.2f} {row['measured_bubble']:12.3f} "
            f"{row['predicted_bubble']:12.3f} {row['uniform_cost_bubble']:8.3f} "
            f"{str(row['peak_in_flight']):>15s}"
        )
    config = {
        k: getattr(FLAGS, k)
        for k in ("rounds", "steps_per_round", "width", "depth", "batch", "micro_batches", "remat")
    }
    path = common.write_json(
        "schedules", {"environment": env, "config": config, "schedules": rows, "samples_s": samples}
    )
    common.bar_chart("schedules", ms, "ms / step", f"2 stages, M={FLAGS.micro_batches}")
    print(f"  wrote {path}")
    best = min(ms, key=ms.get)
    print(
        "SUMMARY schedules "
        + " ".join(f"{n}_ms={v:.2f}" for n, v in ms.items())
        + f" fastest={best}"
    )


if __name__ == "__main__":
    app.run(main)
