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
from typing import Any

from absl import app, flags

import common

common.define_timing_flags(rounds=8, steps_per_round=3)
common.define_model_flags(depth=4, batch=256)
flags.DEFINE_integer("micro_batches", 8, "Micro-batches M.")
flags.DEFINE_string("remat", "never", "Remat mode for every schedule.")
FLAGS = flags.FLAGS


def calibrated_costs(schedule: Any, events: list[Any]) -> Any:
    """Mean measured seconds of F, B and W per model stage -> schedule.Costs."""
    from hybrid.core.schedule import Costs, Op

    spans = collections.defaultdict(list)
    for e in events:
        spans[(e.action.op, e.action.stage)].append(e.end - e.start)
    K = schedule.num_model_stages

    def mean(op: Any, k: int) -> float:
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


def build_pipelines() -> dict[str, Any]:
    """One built 2-stage pipeline per registered schedule (interleaved: 2 virtual stages)."""
    from hybrid.core import schedule as sched

    pipes = {}
    for name in sched.names():
        pipes[name] = common.schedule_pipeline(name, FLAGS.remat, FLAGS.micro_batches, 1e-3)
        print(f"  {name}: balance {pipes[name].balance}")
    return pipes


def compare_timelines(name: str, pipe: Any, x: Any, y: Any) -> dict[str, Any]:
    """One instrumented step of ``pipe`` beside the simulation of its schedule with the
    measured action costs: bubbles and step times, both timelines drawn in a PNG."""
    from hybrid.core import schedule as sched
    from hybrid.run import timeline

    events, measured = common.instrumented_step(pipe, x, y)
    s = pipe.schedule
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
        seconds=True,  # both in seconds (the simulation's costs are measured ones): ms axis
    )
    return {
        "measured_bubble": measured_bubble,
        "predicted_bubble": float(predicted.bubble_fraction),
        "uniform_cost_bubble": float(uniform.bubble_fraction),
        "predicted_step_ms": 1e3 * float(predicted.makespan),
        "instrumented_step_ms": 1e3 * max(e.end for e in events),
        "peak_in_flight": list(predicted.peak_in_flight),
        "png": path,
    }


def print_table(rows: dict[str, dict[str, Any]]) -> None:
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


def main(argv: list[str]) -> None:
    del argv
    env = common.start("schedules", devices=2)
    x, y = common.synthetic_batch(FLAGS.batch, FLAGS.width)
    pipes = build_pipelines()
    samples, ms = common.time_steps(
        {name: common.train_step(pipe, x, y) for name, pipe in pipes.items()}, warmup=3
    )
    rows = {
        name: {"ms_per_step": ms[name], **compare_timelines(name, pipe, x, y)}
        for name, pipe in pipes.items()
    }
    print_table(rows)
    config = common.flag_values(*common.TIMING_FLAGS, *common.MODEL_FLAGS, "micro_batches", "remat")
    path = common.write_json(
        "schedules", {"environment": env, "config": config, "schedules": rows, "samples_s": samples}
    )
    common.bar_chart("schedules", ms, "ms / step", f"2 stages, M={FLAGS.micro_batches}")
    print(f"  wrote {path}")
    best = min(ms, key=lambda name: ms[name])
    print(
        "SUMMARY schedules "
        + " ".join(f"{n}_ms={v:.2f}" for n, v in ms.items())
        + f" fastest={best}"
    )


if __name__ == "__main__":
    app.run(main)
