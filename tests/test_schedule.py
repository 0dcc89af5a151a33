"""Schedules as data: generators, validation, execution order and simulation."""

import sys
from fractions import Fraction

import pytest

from hybrid import schedule as sched
from hybrid.schedule import Action, Costs, Op, Schedule, ScheduleError


def test_gpipe_data():
    s = sched.gpipe(2, 3)
    assert str(s) == "0: F0 F1 F2 B2 B1 B0 | 1: F0 F1 F2 B2 B1 B0"
    assert s.actions[1][3] == Action(1, Op.B, 2)
    assert Schedule.parse(str(s), 3).actions == s.actions


def test_action_string_round_trip():
    assert str(Action(3, Op.B, 7)) == "B7"
    assert Action.parse("F12", stage=2) == Action(2, Op.F, 12)
    with pytest.raises(ValueError, match="cannot parse action 'X1'"):
        Action.parse("X1", stage=0)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("micro", [1, 2, 4, 8, 16])
def test_gpipe_bubble_is_exact(stages, micro):
    result = sched.simulate(
        sched.gpipe(stages, micro), Costs(forward=Fraction(1), backward=Fraction(2))
    )
    assert result.bubble_fraction == Fraction(stages - 1, micro + stages - 1)
    assert result.makespan == (micro + stages - 1) * 3
    assert result.busy == (micro * 3,) * stages
    assert result.peak_in_flight == (micro,) * stages


def test_simulate_float_costs_and_transfer():
    result = sched.simulate(sched.gpipe(2, 2), Costs(forward=1.0, backward=1.0, transfer=0.5))
    # s0: F0[0,1] F1[1,2]; s1: F0[1.5,2.5] F1[2.5,3.5] B1[3.5,4.5] B0[4.5,5.5];
    # s0: B1[5,6] B0[6,7]
    assert result.makespan == pytest.approx(7.0)
    timeline = {(a.stage, str(a)): (start, end) for a, start, end in result.timeline}
    assert timeline[(1, "F0")] == (1.5, 2.5)
    assert timeline[(0, "B0")] == (6.0, 7.0)


def test_per_stage_costs():
    result = sched.simulate(sched.gpipe(2, 1), Costs(forward=[1, 3], backward=[2, 6]))
    assert result.makespan == 1 + 3 + 6 + 2
    assert result.busy == (3, 9)


def test_execution_order_respects_devices_and_data():
    order = sched.execution_order(sched.gpipe(3, 2))
    position = {a: i for i, a in enumerate(order)}
    for a in order:
        if a.op is Op.F and a.stage > 0:
            assert position[Action(a.stage - 1, Op.F, a.microbatch)] < position[a]
        if a.op is Op.B:
            assert position[Action(a.stage, Op.F, a.microbatch)] < position[a]
            if a.stage < 2:
                assert position[Action(a.stage + 1, Op.B, a.microbatch)] < position[a]


def test_validate_rejects_deadlock_with_marked_grid():
    # Stage 0 wants B0 before it ever sends F1; stage 1 wants F1 before it does B0.
    bad = sched.from_mapping({0: "F0 B0 F1 B1", 1: "F0 F1 B0 B1"}, num_microbatches=2)
    with pytest.raises(ScheduleError) as err:
        sched.validate(bad)
    message = str(err.value)
    assert "deadlocks" in message
    assert "stage 0 waits at B0 for B0 on stage 1" in message
    assert ">B0<" in message and ">F1<" in message


def test_validate_rejects_a_device_waiting_on_itself():
    bad = sched.from_mapping({0: "B0 F0"}, num_microbatches=1)
    with pytest.raises(ScheduleError, match="stage 0 waits at B0 for F0 on stage 0"):
        sched.validate(bad)


def test_validate_rejects_a_missing_step():
    bad = sched.from_mapping({0: "F0 F1 B1 B0", 1: "F0 F1 B1"}, num_microbatches=2)
    with pytest.raises(ScheduleError, match="stage 1 never runs B0"):
        sched.validate(bad)


def test_validate_rejects_duplicates_and_range():
    with pytest.raises(ScheduleError, match=r"F0 on stage 0 appears twice[\s\S]*>F0<"):
        sched.validate(sched.from_mapping({0: "F0 F0 B0"}, num_microbatches=1))
    with pytest.raises(ScheduleError, match=r"micro-batch 3 is out of range"):
        sched.validate(sched.from_mapping({0: "F0 F3 B0"}, num_microbatches=1))


def test_validate_rejects_forward_only_as_training_schedule():
    with pytest.raises(ScheduleError, match="needs backward actions"):
        sched.validate(sched.forward_only(2, 2))


def test_registry_errors_name_the_choices():
    assert "gpipe" in sched.names()
    with pytest.raises(ValueError, match=r"unknown schedule 'gpip'; choose one of \['gpipe'"):
        sched.get("gpip", 2, 2)


@pytest.mark.parametrize("stages,micro", [(0, 1), (1, 0)])
def test_generator_sizes(stages, micro):
    with pytest.raises(ValueError, match="at least one stage and one micro-batch"):
        sched.gpipe(stages, micro)


def test_grid_rendering():
    grid = sched.gpipe(2, 1).grid(mark=[(1, 1)])
    assert grid.splitlines() == [
        "step      s0     s1",
        "   0      F0     F0",
        "   1      B0   >B0<",
    ]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
