"""Schedules as data: generators against the formulas, validation, simulation."""

import sys
from fractions import Fraction

import pytest

from hybrid.core import schedule as sched
from hybrid.core.schedule import Action, Costs, Op, Schedule, ScheduleError
from hybrid.run import timeline

import runner

UNIT = Costs(forward=Fraction(1), backward=Fraction(1), weight=Fraction(1))  # full B = 2
SIZES = [(1, 1), (2, 1), (2, 4), (3, 5), (4, 4), (4, 8), (8, 16), (3, 2)]


def test_gpipe_data():
    s = sched.gpipe(2, 3)
    assert str(s) == "0: F0 F1 F2 B2 B1 B0 | 1: F0 F1 F2 B2 B1 B0"
    assert s.actions[1][3] == Action(1, Op.B, 2)
    assert Schedule.parse(str(s), 3).actions == s.actions


def test_one_f_one_b_data():
    assert str(sched.one_f_one_b(3, 4)) == (
        "0: F0 F1 F2 B0 F3 B1 B2 B3 | 1: F0 F1 B0 F2 B1 F3 B2 B3 | 2: F0 B0 F1 B1 F2 B2 F3 B3"
    )


def test_interleaved_data():
    s = sched.interleaved(2, 2, virtual_stages=2)
    assert str(s) == "0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 | 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"
    assert s.num_model_stages == 4 and s.device_of(3) == 1
    assert Schedule.parse(str(s), virtual_stages=2).actions == s.actions


def test_zero_bubble_h1_data():
    s = sched.zero_bubble_h1(2, 3)
    assert str(s) == "0: F0 F1 B0 W0 F2 B1 W1 B2 W2 | 1: F0 B0 W0 F1 B1 W1 F2 B2 W2"
    assert s.splits_backward


def test_action_string_round_trip():
    assert str(Action(3, Op.B, 7)) == "B7" and Action(3, Op.B, 7).long() == "3B7"
    assert Action.parse("F12", stage=2) == Action(2, Op.F, 12)
    assert Action.parse("5W1", stage=0) == Action(5, Op.W, 1)
    with pytest.raises(ValueError, match="cannot parse action 'X1'"):
        Action.parse("X1", stage=0)


@pytest.mark.parametrize("stages,micro", SIZES)
@pytest.mark.parametrize("generator", [sched.gpipe, sched.one_f_one_b])
def test_bubble_is_exact(generator, stages, micro):
    result = sched.simulate(generator(stages, micro), UNIT)
    assert result.bubble_fraction == Fraction(stages - 1, micro + stages - 1)
    assert result.makespan == (micro + stages - 1) * 3
    assert result.busy == (micro * 3,) * stages


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (4, 4), (2, 8), (3, 9)])
@pytest.mark.parametrize("virtual", [1, 2, 3])
def test_interleaved_bubble_is_exact(stages, micro, virtual):
    result = sched.simulate(sched.interleaved(stages, micro, virtual), UNIT)
    assert result.bubble_fraction == Fraction(stages - 1, virtual * micro + stages - 1)
    assert sched.bubble_formula(stages, micro, virtual) == pytest.approx(
        float(result.bubble_fraction)
    )


def test_interleaved_rejects_uneven_groups():
    with pytest.raises(ValueError, match=r"multiple of the pipeline stages: M=6, S=4; use M=8"):
        sched.interleaved(4, 6, 2)


@pytest.mark.parametrize("stages,micro", SIZES)
def test_peak_in_flight(stages, micro):
    assert sched.simulate(sched.gpipe(stages, micro)).peak_in_flight == (micro,) * stages
    one_f = sched.simulate(sched.one_f_one_b(stages, micro)).peak_in_flight
    assert one_f == tuple(min(stages - s, micro) for s in range(stages))


@pytest.mark.parametrize("stages,micro", SIZES)
def test_zero_bubble_beats_one_f_one_b_in_the_same_memory(stages, micro):
    zb = sched.simulate(sched.validate(sched.zero_bubble_h1(stages, micro)), UNIT)
    one_f = sched.simulate(sched.one_f_one_b(stages, micro), UNIT)
    assert zb.peak_in_flight == one_f.peak_in_flight
    if stages > 1:
        assert zb.bubble_fraction < one_f.bubble_fraction
    free_w = Costs(forward=1, backward=2, weight=0)
    assert sched.simulate(sched.zero_bubble_h1(stages, micro), free_w).bubble_fraction == (
        pytest.approx(
            float(sched.simulate(sched.one_f_one_b(stages, micro), free_w).bubble_fraction)
        )
    )


@pytest.mark.parametrize("name", sched.names())
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (2, 2), (4, 4)])
def test_every_generator_validates(name, stages, micro):
    virtual = 2 if name == "interleaved" else 1
    s = sched.validate(sched.get(name, stages, micro, virtual))
    assert s.name == name
    assert (
        len(sched.execution_order(s)) == (3 if s.splits_backward else 2) * stages * virtual * micro
    )


def test_simulate_float_costs_and_transfer():
    result = sched.simulate(
        sched.gpipe(2, 2), Costs(forward=1.0, backward=1.0, weight=0.0, transfer=0.5)
    )
    # s0: F0[0,1] F1[1,2]; s1: F0[1.5,2.5] F1[2.5,3.5] B1[3.5,4.5] B0[4.5,5.5];
    # s0: B1[5,6] B0[6,7]
    assert result.makespan == pytest.approx(7.0)
    timeline = {a.long(): (start, end) for a, start, end in result.timeline}
    assert timeline["1F0"] == (1.5, 2.5)
    assert timeline["0B0"] == (6.0, 7.0)


def test_per_stage_costs():
    result = sched.simulate(sched.gpipe(2, 1), Costs(forward=[1, 3], backward=[2, 6], weight=0))
    assert result.makespan == 1 + 3 + 6 + 2
    assert result.busy == (3, 9)


def test_execution_order_respects_devices_and_data():
    for s in (sched.gpipe(3, 2), sched.interleaved(2, 4, 2), sched.zero_bubble_h1(3, 3)):
        order = sched.execution_order(s)
        position = {a: i for i, a in enumerate(order)}
        for row in s.actions:
            assert [position[a] for a in row] == sorted(position[a] for a in row)
        for a in order:
            for dep in sched.dependencies(a, s.num_model_stages):
                assert position[dep] < position[a]


def test_validate_rejects_deadlock_with_marked_grid():
    # Device 0 wants B0 before it ever sends F1; device 1 wants F1 before it does B0.
    bad = sched.from_mapping({0: "F0 B0 F1 B1", 1: "F0 F1 B0 B1"}, num_microbatches=2)
    with pytest.raises(ScheduleError) as err:
        sched.validate(bad)
    message = str(err.value)
    assert "deadlocks" in message
    assert "device 0 waits at 0B0 for 1B0" in message
    assert ">B0<" in message and ">F1<" in message


def test_validate_rejects_a_device_waiting_on_itself():
    bad = sched.from_mapping({0: "B0 F0"}, num_microbatches=1)
    with pytest.raises(ScheduleError, match="device 0 waits at 0B0 for 0F0"):
        sched.validate(bad)
    bad_w = sched.from_mapping({0: "F0 W0 B0"}, num_microbatches=1)
    with pytest.raises(ScheduleError, match="device 0 waits at 0W0 for 0B0"):
        sched.validate(bad_w)


def test_validate_rejects_a_missing_step():
    bad = sched.from_mapping({0: "F0 F1 B1 B0", 1: "F0 F1 B1"}, num_microbatches=2)
    with pytest.raises(ScheduleError, match="stage 1 never runs B0"):
        sched.validate(bad)
    no_w = sched.from_mapping({0: "F0 B0 W0 F1 B1"}, num_microbatches=2)
    with pytest.raises(ScheduleError, match="stage 0 never runs W1"):
        sched.validate(no_w)


def test_validate_rejects_duplicates_range_and_placement():
    with pytest.raises(ScheduleError, match=r"F0 of stage 0 appears twice[\s\S]*>F0<"):
        sched.validate(sched.from_mapping({0: "F0 F0 B0"}, num_microbatches=1))
    with pytest.raises(ScheduleError, match=r"micro-batch 3 is out of range"):
        sched.validate(sched.from_mapping({0: "F0 F3 B0"}, num_microbatches=1))
    with pytest.raises(ScheduleError, match=r"action 1F0 of stage 1 is on device 0"):
        sched.execution_order(sched.from_mapping({0: "1F0", 1: "0F0"}, 1))


def test_validate_rejects_forward_only_as_training_schedule():
    with pytest.raises(ScheduleError, match="needs backward actions"):
        sched.validate(sched.forward_only(2, 2))


def test_registry_errors_name_the_choices():
    assert sched.names() == ["1f1b", "gpipe", "interleaved", "zb-h1"]
    with pytest.raises(ValueError, match=r"unknown schedule 'gpip'; choose one of \['1f1b', "):
        sched.get("gpip", 2, 2)
    with pytest.raises(ValueError, match="virtual_stages=2 needs one of \\['interleaved'\\]"):
        sched.get("1f1b", 2, 2, virtual_stages=2)


@pytest.mark.parametrize("stages,micro", [(0, 1), (1, 0)])
def test_generator_sizes(stages, micro):
    with pytest.raises(ValueError, match="at least one stage and one micro-batch"):
        sched.gpipe(stages, micro)


def test_pairs_to_fuse():
    assert sched.pairs_to_fuse(sched.gpipe(2, 3)) == {Action(1, Op.F, 2)}
    assert sched.pairs_to_fuse(sched.one_f_one_b(2, 3)) == {Action(1, Op.F, m) for m in range(3)}
    assert sched.pairs_to_fuse(sched.zero_bubble_h1(2, 3)) == {Action(1, Op.F, m) for m in range(3)}


def test_grid_rendering():
    grid = sched.gpipe(2, 1).grid(mark=[(1, 1)])
    assert grid.splitlines() == [
        "step      d0     d1",
        "   0      F0     F0",
        "   1      B0   >B0<",
    ]


def test_render_png(tmp_path):
    path = timeline.render_schedule(sched.interleaved(2, 4, 2), str(tmp_path / "t.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
