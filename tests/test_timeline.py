"""Instrumented steps: the recorded timeline follows the schedule, and the step is a real one."""

import itertools
import sys

import keras
import numpy as np
import pytest

from hybrid import timeline
from hybrid.core import schedule as sched

import reference as ref
import runner


def make(schedule):
    return ref.pipeline(  # XLA for one schedule: the order of actions is the point here
        2,
        2,
        optimizer=keras.optimizers.SGD(0.1),
        micro_batches=4,
        schedule=schedule,
        jit_compile=schedule == "gpipe",
    )


@pytest.mark.parametrize("schedule", sched.names())
def test_timed_step_records_every_action_in_schedule_order(schedule):
    timed, plain = make(schedule), make(schedule)
    x, y = ref.batch(32)
    plain.build((None, ref.IN_FEATURES))
    timed.build((None, ref.IN_FEATURES))
    plain.set_weights(timed.get_weights())
    metrics, events = timed.timed_train_step(x, y)
    # A real training step: same loss and same new weights as train_step.
    np.testing.assert_allclose(metrics["loss"], plain.train_step(x, y)["loss"], rtol=1e-6)
    ref.assert_weights_close(timed.get_weights(), plain.get_weights())

    s = timed.schedule
    fused = sched.pairs_to_fuse(s)
    skipped = {
        sched.Action(a.stage, op, a.microbatch)
        for a in fused
        for op in sched.Op
        if op != sched.Op.F
    }
    for d in range(s.num_stages):
        recorded = [e.action for e in events if e.device == d]
        assert recorded == [a for a in s.actions[d] if a not in skipped]
        mine = [e for e in events if e.device == d]
        for before, after in itertools.pairwise(mine):
            assert before.end <= after.start
    assert all(0.0 <= e.start <= e.end < 60.0 for e in events)
    bubble = timeline.bubble_fraction(s, [(e.action, e.start, e.end) for e in events])
    assert 0.0 <= bubble < 1.0


def test_plot_measured_beside_simulated(tmp_path):
    pipe = make("1f1b")
    x, y = ref.batch(32)
    _, events = pipe.timed_train_step(x, y)
    s = pipe.schedule
    path = timeline.plot_timelines(
        [
            ("simulated", s, sched.simulate(s).timeline),
            ("measured", s, [(e.action, e.start, e.end) for e in events]),
        ],
        str(tmp_path / "t.png"),
    )
    with open(path, "rb") as f:
        assert f.read(4) == b"\x89PNG"


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
