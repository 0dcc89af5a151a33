"""Instrumented steps: the recorded timeline follows the schedule, and the step is a real one."""

import itertools
import sys

import keras
import numpy as np
import pytest

from hybrid.core import schedule as sched
from hybrid.engine.programs import row_sums
from hybrid.engine.step import clocks as timing
from hybrid.run import timeline

import reference as ref
import runner


def make(schedule, deferred=False, jit_compile=True):
    """A 2-stage pipeline; timed steps bracket compiled programs only (``timing.Recorder``)."""
    deferring = {"remat": "never", "defer_weight_gradients": True} if deferred else {}
    return ref.pipeline(
        2,
        2,
        optimizer=keras.optimizers.SGD(0.1),
        micro_batches=4,
        schedule=schedule,
        jit_compile=jit_compile,
        **deferring,
    )


@pytest.mark.parametrize(
    "schedule,deferred", [(name, False) for name in sched.names()] + [("1f1b", True)]
)
def test_timed_step_records_every_action_in_schedule_order(schedule, deferred):
    timed = make(schedule, deferred)  # plain SGD: no optimizer state but the step count
    x, y = ref.batch(32)
    timed.build((None, ref.IN_FEATURES))
    initial = timed.get_weights()
    metrics, events = timed.timed_train_step(x, y)
    after = timed.get_weights()
    # A real training step: same loss and same new weights as train_step from the same start.
    timed.set_weights(initial)
    np.testing.assert_allclose(metrics["loss"], timed.train_step(x, y)["loss"], rtol=1e-6)
    ref.assert_weights_close(after, timed.get_weights())
    assert any(not np.array_equal(a, b) for a, b in zip(after, initial, strict=True))
    if deferred:  # each stage's W ran once, in its last backward action
        assert all(isinstance(row[0].deferral, row_sums.Plan) for row in timed.stages)

    s = timed.schedule
    fused = frozenset() if deferred else sched.pairs_to_fuse(s)
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
    # Each action's clock reads bracket its own work: none shows as taking no time (its
    # end read late, after the device's next action had run, would squeeze that one to 0),
    # but stage 0's B in a split schedule, which computes nothing (no input gradients), and
    # with deferred weight gradients stage 0's B but its last (which runs the stage's W).
    idle_b = any(a.op is sched.Op.W for a in s.actions[0]) or deferred
    closing = {a.stage: a for a in sched.execution_order(s) if a.op is not sched.Op.F}
    working = [
        e
        for e in events
        if not (idle_b and e.action.stage == 0 and e.action.op is sched.Op.B)
        or (deferred and e.action == closing[0])
    ]
    assert all(e.end > e.start for e in working), [(e.action, e.end - e.start) for e in events]
    bubble = timeline.bubble_fraction(s, [(e.action, e.start, e.end) for e in events])
    assert 0.0 <= bubble < 1.0


def test_a_timed_step_of_programs_that_are_not_compiled_warns_that_it_is_unreliable():
    """Not compiled, the stage programs are inlined into the step and their ops escape the
    clock reads (actions of 1–8 µs were measured): the step says so, and is still exact."""
    timed, plain = make("1f1b", jit_compile=False), make("1f1b", jit_compile=False)
    x, y = ref.batch(32)
    for pipe in (timed, plain):
        pipe.build((None, ref.IN_FEATURES))
    plain.set_weights(timed.get_weights())
    with pytest.warns(UserWarning, match="not XLA-compiled"):
        metrics, _ = timed.timed_train_step(x, y)
    np.testing.assert_allclose(metrics["loss"], plain.train_step(x, y)["loss"], rtol=1e-6)


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


def test_step_view_splits_each_devices_step():
    """Two devices (times in s): device 1 waits 0.2 for F(0,0)'s output and device 0 waits
    1.0 for the gradient of micro-batch 0 (transfers); F(1,1) and B(0,1) start late only
    because their device was busy (no transfer); the all-reduces and the idle rest."""
    F, B, A, T = sched.Op.F, sched.Op.B, sched.Action, timing.TimedAction
    events = [
        T(0, A(0, F, 0), 0.0, 1.0),
        T(0, A(0, F, 1), 1.0, 2.0),
        T(1, A(1, F, 0), 1.2, 3.0),  # the last stage: forward and backward fused
        T(1, A(1, F, 1), 3.0, 4.0),
        T(0, A(0, B, 0), 4.0, 5.0),
        T(0, A(0, B, 1), 5.5, 6.5),
        T(0, None, 6.5, 7.5),
        T(1, None, 4.0, 8.0),
    ]
    view = timing.StepView.of(events)
    first, second = view.devices
    np.testing.assert_allclose(first[1:], [4.0, 1.0, 1.0, 2.0])
    np.testing.assert_allclose(second[1:], [2.8, 0.2, 4.0, 1.0])
    assert first.step == pytest.approx(8.0) and second.step == pytest.approx(8.0)
    assert view.communication_share == pytest.approx(4.2 / 8)
    assert "communication takes 52% of the step on pipeline device 1" in view.warning()
    quiet = timing.StepView.of([e for e in events if e.action is not None or e.device == 0])
    assert quiet.warning() is None  # device 1 without its all-reduce: 2.5 % communication
    # one idle figure for the title, the log line and TensorBoard: the devices' mean
    assert view.idle_fraction == pytest.approx((2.0 / 8 + 1.0 / 8) / 2)
    assert view.transfers() == [(0, 3.0, 4.0), (1, 1.0, 1.2)]  # the 1.0 and 0.2 above


def test_a_measured_step_as_a_picture_and_a_chrome_trace(tmp_path):
    """The synthetic step above: fused F+B on the last stage, the all-reduces and the two
    transfer waits, in one lane per device (times in µs)."""
    import json

    F, B, A, T = sched.Op.F, sched.Op.B, sched.Action, timing.TimedAction
    s = sched.gpipe(2, 2)
    view = timing.StepView.of([
        T(0, A(0, F, 0), 0.0, 1.0), T(0, A(0, F, 1), 1.0, 2.0), T(1, A(1, F, 0), 1.2, 3.0),
        T(1, A(1, F, 1), 3.0, 4.0), T(0, A(0, B, 0), 4.0, 5.0), T(0, A(0, B, 1), 5.5, 6.5),
        T(0, None, 6.5, 7.5), T(1, None, 4.0, 8.0),
    ])  # fmt: skip
    with open(timeline.plot_step(view, s, "step 1", str(tmp_path / "s.png")), "rb") as f:
        assert f.read(4) == b"\x89PNG"
    path = timeline.chrome_trace(view, s, str(tmp_path / "s.json"), ["/CPU:0", "/CPU:1"])
    trace = json.load(open(path))["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert lanes == {0: "device 0 (/CPU:0)", 1: "device 1 (/CPU:1)"}
    spans = sorted((e["tid"], e["name"], e["ts"], e["dur"]) for e in trace if e["ph"] == "X")
    assert spans == [
        (0, "B0", 4e6, 1e6), (0, "B1", 5.5e6, 1e6), (0, "F0", 0.0, 1e6), (0, "F1", 1e6, 1e6),
        (0, "all-reduce", 6.5e6, 1e6), (0, "transfer", 3e6, 1e6),
        (1, "F+B0", 1.2e6, pytest.approx(1.8e6)), (1, "F+B1", 3e6, 1e6),
        (1, "all-reduce", 4e6, 4e6), (1, "transfer", 1e6, pytest.approx(0.2e6)),
    ]  # fmt: skip
    assert timeline.kind(A(1, F, 0), s, {A(1, F, 0), A(1, B, 0)}) == "F"  # B ran on its own


def test_fit_times_every_nth_step_without_changing_training():
    """timeline_every=2: steps 2 and 4 of fit run timed; the weights are those of an untimed
    fit, and the last timed step's view has every device's compute and all-reduce."""
    timed, plain = make("1f1b"), make("1f1b")
    x, y = ref.batch(64)
    plain.build((None, ref.IN_FEATURES))
    timed.build((None, ref.IN_FEATURES))
    plain.set_weights(timed.get_weights())
    timed.timeline_every = 2
    for pipe in (timed, plain):
        pipe.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    ref.assert_weights_close(timed.get_weights(), plain.get_weights())
    assert plain.last_timeline is None
    view = timed.last_timeline
    assert [d.device for d in view.devices] == [0, 1]
    assert sorted(e.device for e in view.reduces) == [0, 1]  # each device's all-reduce
    # (On a loaded host a clock read can run late and shorten the actions after it on its
    # device in the timeline, so only the whole step's compute is sure to be positive.)
    assert sum(device.compute for device in view.devices) > 0
    for device in view.devices:
        assert min(device) >= 0
        assert device.step == pytest.approx(max(e.end for e in view.actions + view.reduces))
    assert len(view.actions) == sum(len(row) for row in timed.schedule.actions) - 4  # fused B


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
