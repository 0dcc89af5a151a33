"""The planner's arithmetic against the schedule formulas and hand-computed values; plans,
rejections and errors; one real profile of a tiny model."""

import collections
import dataclasses
import math
import os
import sys

import keras
import numpy as np
import pytest

import hybrid
from hybrid import planning as planner
from hybrid.core import config, schedule
from hybrid.core.config import ConfigError, RunConfig, validate_run
from hybrid.core.schedule import generators
from hybrid.core.schedule.actions import Action, Op
from hybrid.planning import CostProfile, Hardware, LayerCost, Link, search
from hybrid.planning.model_calls import model_calls
from hybrid.planning.stage_costs import StageCost, action_costs, deferred_schedule

import runner

F, B = 1.0, 2.0  # per layer and example


def uniform(num_layers=4, **kwargs):
    """Identical layers; input_backward=0 so model stage 0 is not cheaper than the others."""
    kwargs.setdefault("input_backward", 0.0)
    return planner.uniform_profile(num_layers, F, B, **kwargs)


def test_remat_modes_are_the_engines():
    assert planner.REMAT_MODES == config.REMAT_MODES
    assert planner.Config is RunConfig  # the callers' old name for the one configuration


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro_batches", [(2, 1), (2, 4), (4, 8), (4, 3)])
def test_uniform_stages_reproduce_the_formulas(schedule, stages, micro_batches):
    S, M = stages, micro_batches
    layers_per_stage = 2
    profile = uniform(S * layers_per_stage)
    config = RunConfig(S, 1, M, schedule, "never")
    p = planner.evaluate(profile, config, global_batch=M)  # one example per micro-batch
    f, b = layers_per_stage * F, layers_per_stage * B
    assert p.step_time == pytest.approx((M + S - 1) * (f + b))
    assert p.bubble == pytest.approx((S - 1) / (M + S - 1))
    assert p.config.balance == (layers_per_stage,) * S


def test_uniform_interleaved_bubble():
    S, M, v = 2, 4, 2
    p = planner.evaluate(uniform(8), RunConfig(S, 1, M, "interleaved", "never", v), M)
    assert p.bubble == pytest.approx(hybrid.core.schedule.bubble_formula(S, M, v))
    assert p.config.balance == (2, 2, 2, 2)


def test_costs_scale_with_the_micro_batch_size():
    # 4 examples per micro-batch: every action costs 4 times as much as with 1.
    one = planner.evaluate(uniform(4), RunConfig(2, 1, 4, "gpipe", "never"), 4)
    four = planner.evaluate(uniform(4), RunConfig(2, 1, 4, "gpipe", "never"), 16)
    assert four.step_time == pytest.approx(4 * one.step_time)


def test_remat_adds_the_recomputed_forward():
    # S = 2, M = 2, two layers per stage: F = 2, B = 4 per stage and micro-batch. GPipe runs
    # s1: F0 F1 [F1 B1 fused] B0 and s0: F0 F1 B1 B0. With remat every B but the fused one
    # costs F + B = 6, so s1's B0 ends at 16 and s0's B0 at 22 (never: 3 · 6 = 18).
    profile = uniform(4)
    times = {
        remat: planner.evaluate(profile, RunConfig(2, 1, 2, "gpipe", remat), 2).step_time
        for remat in planner.REMAT_MODES
    }
    # except_last keeps micro-batch 1 on stage 0 (its B1 costs 4, not 6), but B0 waits for
    # stage 1 until 16 either way.
    assert times == pytest.approx({"never": 18.0, "always": 22.0, "except_last": 22.0})
    single = {
        remat: planner.evaluate(uniform(2), RunConfig(1, 1, 3, "gpipe", remat), 3).step_time
        for remat in planner.REMAT_MODES
    }
    # F0 F1 F2 [F2 B2 fused] B1 B0 with F = 2, B = 4: never 18, recomputing B1, B0: +2 · 2
    assert single == pytest.approx({"never": 18.0, "always": 22.0, "except_last": 22.0})


def test_split_backward():
    # Two layers per stage, F = 1, B = 2 each, of which the input gradient is 0.5. W makes
    # the weight gradients and the input gradients of every layer but the first (B's job;
    # stage 0 needs none): on stage 0 W = 4 - 0.5 and B costs nothing.
    profile = planner.uniform_profile(4, F, B, input_backward=0.5)
    p = planner.evaluate(profile, RunConfig(2, 1, 1, "zb-h1", "never"), 1)
    # F0 on s0 [0, 2], F0 on s1 [2, 4], F B W fused on s1 [4, 8], W0 on s0 [8, 11.5]
    assert p.step_time == pytest.approx(11.5)
    p = planner.evaluate(profile, RunConfig(2, 1, 1, "zb-h1", "always"), 1)
    assert p.step_time == pytest.approx(11.5 + 2.0)  # W0 recomputes stage 0's forward
    # A middle stage: B its two layers' input gradients (1), W the rest of its stored
    # backward (4 - 1), nothing computed twice; stage 0: B nothing, W all but its first
    # layer's input gradient.
    profile = planner.uniform_profile(6, F, B, input_backward=0.5)
    stages = [StageCost(profile, 2 * k, 2, 1, 1.0) for k in range(3)]
    costs = action_costs(generators.get("zb-h1", 3, 1), stages, "never", Hardware())
    assert costs[Action(1, Op.B, 0)] == pytest.approx(1.0)
    assert costs[Action(1, Op.W, 0)] == pytest.approx(3.0)
    assert costs[Action(0, Op.B, 0)] == 0.0
    assert costs[Action(0, Op.W, 0)] == pytest.approx(3.5)
    # With free input gradients the deferred W fills the bubble: ZB-H1 beats 1F1B.
    profile = uniform(8)
    for S, M in [(4, 8), (8, 8)]:
        one = planner.evaluate(profile, RunConfig(S, 1, M, "1f1b", "never"), M)
        zb = planner.evaluate(profile, RunConfig(S, 1, M, "zb-h1", "never"), M)
        assert zb.step_time < one.step_time
        assert zb.bubble < one.bubble


def test_deferred_weight_gradients():
    # Per layer: F = 1, B = 2 per example with input gradient 0.5, at micro-batches of 1.
    # Deferred on a middle stage (two layers): each B is the input gradients (1 per
    # micro-batch); the stage's last W runs the rest of the backward once, at all M
    # micro-batches' rows (4 · M - 1 · M); stage 0 runs no B, then all of its backward but
    # its first layer's input gradient (4 · M - 0.5 · M). A schedule without W gets each
    # stage's W right after its last B (its input gradients leave before).
    profile = planner.uniform_profile(6, F, B, input_backward=0.5)
    M = 4
    stages = [StageCost(profile, 2 * k, 2, 1, 1.0) for k in range(3)]
    whole = [StageCost(profile, 2 * k, 2, M, 1.0) for k in range(3)]
    for name in ("1f1b", "zb-h1"):
        sched = deferred_schedule(generators.get(name, 3, M))
        order = schedule.execution_order(sched)
        last = {a.stage: a for a in order if a.op is Op.W}
        for k, row in enumerate(sched.actions):  # every W after the stage's last B
            assert row.index(last[k]) > max(i for i, a in enumerate(row) if a.op is Op.B)
        costs = action_costs(sched, stages, "never", Hardware(), whole)
        for action, cost in costs.items():
            k = action.stage
            if action.op is Op.F:
                assert cost == pytest.approx(2.0)
            elif action == last[k]:
                assert cost == pytest.approx((3.0 if k else 3.5) * M), action
            else:
                assert cost == pytest.approx(1.0 if k and action.op is Op.B else 0.0), action
    # Per example the same work as undeferred here (costs linear in the rows), but the
    # last stage's W leaves the critical path (stage 0 runs its Bs meanwhile), as in
    # ZB-H1; every micro-batch's activations and output gradients stay until W ran.
    config = RunConfig(2, 1, M, "1f1b", "never")
    profile = uniform(4, stored_bytes=10.0)
    plain = planner.evaluate(profile, config, M)
    deferred = planner.evaluate(
        profile, dataclasses.replace(config, defer_weight_gradients=True), M
    )
    assert deferred.step_time == pytest.approx(26.0) and plain.step_time == pytest.approx(30.0)
    assert deferred.peak_in_flight == (M, M) and plain.peak_in_flight == (2, 1)
    assert deferred.peak_memory == pytest.approx(M * 2 * 2 * 10.0)  # 2 layers, ×2: gradients
    # Where a small micro-batch's weight gradient costs more per example (a fixed cost
    # per call), deferring wins and the planner picks it.
    sizes = (1, 2, 4)

    def curve(fixed, each):
        return tuple(fixed + each * b for b in sizes)

    layer = LayerCost(
        "l", curve(0, 1), curve(4, 2), curve(4, 2), curve(0, 0.5), *[(0.0,) * 3] * 3, 0.0
    )
    profile = CostProfile((layer,) * 4, sizes, 0.0)
    best = planner.plan(profile, devices=2, global_batch=4, stages=[2], remats=["never"]).best
    assert best.config.defer_weight_gradients and best.config.micro_batches > 1


def test_all_reduce_formula():
    link = Link(bandwidth=100e9, latency=1e-5)
    assert planner.all_reduce_time(8e9, 4, link) == pytest.approx(2 * 3 / 4 * 8e9 / 100e9 + 6e-5)
    assert planner.all_reduce_time(8e9, 2, link) == pytest.approx(8e9 / 100e9 + 2e-5)
    assert planner.all_reduce_time(8e9, 1, link) == 0.0
    with pytest.raises(ValueError, match="replicas must be at least 1, got 0"):
        planner.all_reduce_time(1.0, 0, link)


def test_step_adds_each_devices_all_reduce_and_update():
    # 1×4: each replica runs 4 layers (F + B = 12 per micro-batch), then all-reduces 400
    # bytes over 4 replicas and updates (4 layers · 0.5).
    profile = uniform(4, param_bytes=100.0, update=0.5)
    hw = Hardware(replica=Link(bandwidth=10.0, latency=1.0))
    p = planner.evaluate(profile, RunConfig(1, 4, 2, "gpipe", "never"), 8, hw)
    reduce = 2 * 3 / 4 * 400 / 10.0 + 6 * 1.0
    assert p.all_reduce_time == pytest.approx(reduce)
    assert p.update_time == pytest.approx(2.0)
    assert p.pipeline_time == pytest.approx(2 * 12.0)
    assert p.step_time == pytest.approx(24.0 + reduce + 2.0)


def test_each_stage_update_launches_once():
    # 4 layers with weights, updates of 0.5 each beyond one update program's 0.75: on 2
    # stages, each device pays its own program once, a stage without weights nothing.
    profile = dataclasses.replace(uniform(4, param_bytes=100.0, update=0.5), update_call=0.75)
    p = planner.evaluate(profile, RunConfig(2, 1, 2, "gpipe", "never", balance=(2, 2)), 2)
    assert p.update_time == pytest.approx(0.75 + 2 * 0.5)
    one = planner.evaluate(profile, RunConfig(1, 1, 2, "gpipe", "never"), 2)
    assert one.update_time == pytest.approx(0.75 + 4 * 0.5)
    assert CostProfile.from_dict(profile.to_dict()) == profile
    free = dataclasses.replace(profile, layers=tuple(
        dataclasses.replace(layer, param_bytes=0.0, update=0.0) for layer in profile.layers
    ))  # fmt: skip
    assert StageCost(free, 0, 4, 1.0, 1.0).update == 0.0


def test_an_update_programs_own_cost_is_found_from_the_layers_and_the_whole(monkeypatch):
    from hybrid.planning import profile as profile_lib

    wholes = iter([8.0, 20.0, 0.0])
    monkeypatch.setattr(profile_lib, "_update_seconds", lambda *args: next(wholes))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    calls = model_calls(model)
    setup = profile_lib._Setup(
        "/device:CPU:0", None, keras.optimizers.SGD, (), "int32", 1, 1, False
    )
    # three runs with weights updated alone in 5, 3 and 4 (each call + own), one without
    assert profile_lib._update_call(calls, [5.0, 3.0, 0.0, 4.0], setup) == 2.0  # (12-8)/2
    assert profile_lib._update_call(calls, [5.0, 3.0, 4.0], setup) == 0.0  # never below 0
    assert profile_lib._update_call(calls, [5.0, 3.0, 4.0], setup) == 3.0  # nor the least
    assert profile_lib._update_call(calls, [5.0, 0.0], setup) == 0.0  # one run: unknown
    no_optimizer = dataclasses.replace(setup, optimizer=None)
    assert profile_lib._update_call(calls, [5.0, 3.0], no_optimizer) == 0.0


def test_devices_that_compute_beside_each_other_run_as_much_slower_as_measured():
    profile = dataclasses.replace(uniform(2), concurrency=1.5)
    one = planner.evaluate(
        profile, RunConfig(1, 1, 1, "gpipe", "never"), 2, Hardware(host_cores=2.0)
    )
    assert one.step_time == pytest.approx(2 * (F + B) * 2)  # one device: nothing beside it
    two = RunConfig(1, 2, 1, "gpipe", "never")
    shared = planner.evaluate(profile, two, 2, Hardware(host_cores=2.0))
    assert shared.step_time == pytest.approx(2 * (F + B) * 1.5)
    assert planner.evaluate(profile, two, 2).step_time == pytest.approx(2 * (F + B))  # own cores
    # two stages, one micro-batch: one device computes at a time, nothing beside it
    chain = planner.evaluate(
        profile, RunConfig(2, 1, 1, "gpipe", "never"), 1, Hardware(host_cores=2.0)
    )
    assert chain.pipeline_time == pytest.approx(2 * (F + B))
    four = planner.evaluate(
        profile, RunConfig(2, 2, 1, "gpipe", "never"), 2, Hardware(host_cores=2.0)
    )
    # M = 1: one device of each replica computes at a time, two on two cores, each beside
    # the other (a core each: not slowed by sharing them; at M = 2, four on two cores)
    assert four.pipeline_time == pytest.approx(2 * (F + B) * 1.5)
    assert four.step_time == pytest.approx(2 * (F + B) * 1.5)
    four_m2 = planner.evaluate(
        dataclasses.replace(uniform(2), concurrency=1.5),
        RunConfig(2, 2, 2, "gpipe", "never"), 4, Hardware(host_cores=2.0),
    )  # fmt: skip
    assert four_m2.pipeline_time == pytest.approx(3 * (F + B) * 2 * 1.5)
    assert CostProfile.from_dict(profile.to_dict()) == profile


def test_overheads():
    # One device, M = 3, 1F1B (every pair fused): 3 F actions launch, 3 accumulations of
    # 2 layers × 2 arrays, one update per stage.
    layers = tuple(
        LayerCost(f"l{i}", (F,), (B,), (B,), (0.0,), (0.0,), (0.0,), (0.0,), 0.0, param_tensors=2)
        for i in range(2)
    )
    profile = CostProfile(layers, (1,), 0.0)
    hw = Hardware(action_overhead=0.1, tensor_overhead=0.01, step_overhead=5.0)
    p = planner.evaluate(profile, RunConfig(1, 1, 3, "1f1b", "always"), 3, hw)
    compute = 3 * 2 * (F + B)
    assert p.step_time == pytest.approx(compute + 3 * 0.1 + 3 * 4 * 0.01 + 0.1 + 5.0)


def test_host_cores_bound_replicas_sharing_a_host():
    profile = uniform(2)
    config = RunConfig(1, 2, 1, "gpipe", "never")
    alone = planner.evaluate(profile, config, 2).step_time
    assert alone == pytest.approx(2 * (F + B))  # each replica on its own device
    shared = planner.evaluate(profile, config, 2, Hardware(host_cores=1.0)).step_time
    assert shared == pytest.approx(2 * alone)  # both replicas' work on one core
    assert planner.evaluate(profile, config, 2, Hardware(host_cores=2.0)).step_time == alone
    # two busy cores worth 1.6 alone: two replicas computing at once take 2/1.6 longer
    slow = Hardware(host_cores=1.6)
    assert planner.evaluate(profile, config, 2, slow).step_time == pytest.approx(alone * 1.25)
    # a pipeline of two micro-batches keeps both its devices busy at once: 2/1.6 slower too
    # (with its bubble, where only one computes, counted as busy)
    pipe = RunConfig(2, 1, 2, "gpipe", "never")
    pipelined = planner.evaluate(profile, pipe, 2).step_time
    assert pipelined == pytest.approx(3 * (F + B))
    assert planner.evaluate(profile, pipe, 2, slow).step_time == pytest.approx(pipelined * 1.25)
    # one micro-batch: one device computes at a time, a core to itself
    single = RunConfig(2, 1, 1, "gpipe", "never")
    alone_pipe = planner.evaluate(profile, single, 2).step_time
    assert planner.evaluate(profile, single, 2, slow).step_time == pytest.approx(alone_pipe)
    one = RunConfig(1, 1, 1, "gpipe", "never")  # one device: a core to itself
    assert (
        planner.evaluate(profile, one, 2, slow).step_time
        == planner.evaluate(profile, one, 2).step_time
    )


def test_memory_per_device_follows_peak_in_flight():
    # 2 layers per stage of 100 parameter bytes, stored 10 bytes each, input 1, working 5.
    profile = uniform(
        4,
        param_bytes=100.0,
        stored_bytes=10.0,
        output_bytes=1.0,
        input_bytes=1.0,
        working_bytes=5.0,
    )
    S, M = 2, 4

    def activations(p: planner.Prediction) -> tuple[float, ...]:
        return tuple(t["activations"] for t in p.memory_terms)

    gpipe = planner.evaluate(profile, RunConfig(S, 1, M, "gpipe", "never"), M)
    assert gpipe.peak_in_flight == (M, M)
    # stage 0's inputs are slices of the batch input (counted once, as ``batch_input``); its
    # backward reads the output gradient stage 1 sends (1 byte); stage 1's, its loss's
    assert activations(gpipe) == pytest.approx((M * 20 + 1 + 5, M * (1 + 20) + 5))
    one = planner.evaluate(profile, RunConfig(S, 1, M, "1f1b", "never"), M)
    assert one.peak_in_flight == (S, 1)  # stage s holds S - s
    # the last stage runs every F in one program with its B: it stores nothing between
    # them; its input and that program's peak (layer 2's working set beside layer 1's 10)
    assert activations(one) == pytest.approx((2 * 20 + 1 + 5, 1 + 10 + 5))
    # Recomputing: M inputs, and one program's peak: its second layer's working set (5)
    # beside what its first layer keeps (10).
    always = planner.evaluate(profile, RunConfig(S, 1, M, "gpipe", "always"), M)
    assert activations(always) == pytest.approx((1 + 15, M * 1 + 15))
    # except_last also keeps micro-batch 3's activations on stage 0; stage 1 runs F3 and B3
    # as one program and keeps nothing.
    last = planner.evaluate(profile, RunConfig(S, 1, M, "gpipe", "except_last"), M)
    assert activations(last) == pytest.approx((1 + 15 + 20, M + 15))
    # the pipeline phase: weights + 2 slots (Adam) + the running sums read and written +
    # activations; stage 0 adds the batch (M); the user's model is in the client's memory.
    # (The update holds the accumulated and reduced gradients and writes in place: less.)
    assert gpipe.memory_per_device == pytest.approx(
        (200 * 5 + M + M * 20 + 1 + 5, 200 * 5 + M * 21 + 5)
    )
    sgd = planner.evaluate(profile, RunConfig(S, 1, M, "gpipe", "never"), M, optimizer_slots=0)
    assert sgd.memory_per_device == pytest.approx(
        (200 * 3 + M + M * 20 + 1 + 5, 200 * 3 + M * 21 + 5)
    )
    two = planner.evaluate(profile, RunConfig(S, 2, M, "gpipe", "never"), 2 * M)
    # replicas reduce the accumulated gradients into the update's second copy: nothing more
    assert two.peak_memory == pytest.approx(gpipe.peak_memory)
    assert two.total_memory == pytest.approx(2 * sum(two.memory_per_device))


def test_model_that_does_not_fit_one_device_is_pipelined():
    profile = uniform(4, param_bytes=100.0)  # 1600 bytes resident on one device
    result = planner.plan(
        profile, devices=2, global_batch=4, memory_per_device=1500, remats=["never"]
    )
    oom = [r for r in result.rejected if r.kind == "out of memory"]
    assert oom and all(r.config.stages == 1 for r in oom)
    # 1×2: 400 × (1 weights + 2 slots + 2 gradient copies)
    # 1500 less the 10 % left to the allocator: 1350 bytes
    assert oom[0].reason == (
        "out of memory: needs 1.95 KiB per device, has 1.32 KiB (of 1.46 KiB, 10% left to "
        "the allocator)"
    )
    # (1×2 with sharded optimizer states: 400 × (1 + 1 + 2) = 1600, out too)
    # 2×1: stage 0's device holds 200 × 5 = 1000
    assert result.best.config.stages == 2
    with pytest.raises(ValueError, match=r"no configuration of 2 devices fits .*out of memory ×"):
        _ = planner.plan(profile, devices=2, global_batch=4, memory_per_device=100).best
    with pytest.raises(ValueError, match="out of memory"):
        planner.choose_mesh(profile, None, devices=2, global_batch=4, memory_per_device=100)


def test_ranking_data_parallel_vs_pipeline():
    profile = uniform(4, param_bytes=1000.0)
    fast = planner.plan(profile, devices=2, global_batch=8, remats=["never"])
    times = [p.step_time for p in fast.ranked]
    assert times == sorted(times)
    # free links: 1×2 has no bubble, 2×1 has one; every candidate was considered
    assert fast.best.config.mesh_spec == "stage:1;replica:2"
    assert fast.best.step_time == pytest.approx(8 / 2 * 4 * (F + B))
    # (3 schedules on 1×2, interleaved with v=2 too on 2×1: no virtual stages on one
    # device) × (M in 1, 2, 4 on 1×2; 1, 2, 4, 8 on 2×1), each M > 1 with and without
    # deferred weight gradients
    considered = len(fast.ranked) + len(fast.rejected) + fast.merged
    assert considered == 3 * (3 + 2) + 4 * (4 + 3)
    # on the 1-stage mesh gpipe, 1f1b and zb-h1 cannot differ: one row for the three, the
    # other two counted
    one_stage = [p.config for p in fast.ranked if p.config.stages == 1]
    labels = [(c.micro_batches, c.defer_weight_gradients, c.virtual_stages) for c in one_stage]
    assert len(labels) == len(set(labels)) == 5 and fast.merged == 2 * 5, labels
    assert all(c.virtual_stages == 1 for c in one_stage)
    assert "10 left out as equal to a row but for the schedule (1-stage meshes)" in str(fast)
    assert "; planned in " in str(fast).splitlines()[0] and fast.seconds > 0
    # an all-reduce link this slow makes the pipeline (no all-reduce) the fastest
    slow = planner.plan(
        profile,
        devices=2,
        global_batch=8,
        remats=["never"],
        hardware=Hardware(replica=Link(bandwidth=1.0)),
    )
    assert slow.best.config.stages == 2 and slow.best.config.micro_batches == 8
    choice = planner.choose_mesh(
        profile,
        None,
        devices=2,
        global_batch=8,
        remat="never",
        hardware=Hardware(replica=Link(bandwidth=1.0)),
    )
    run = choice.config
    assert (run.stages, run.replicas, run.micro_batches) == (2, 1, 8)
    assert run.mesh_spec == "stage:2;replica:1" and sum(run.balance) == 4
    assert choice.step_time == pytest.approx(slow.best.step_time)


def test_rejection_reasons_and_table():
    # validate_run checks the schedule before the layer count, so 4×1 interleaved (v=2, 8
    # model stages of 4 layers) is "more stages than layers" only with M a multiple of 4.
    result = planner.plan(uniform(4), devices=4, global_batch=6, micro_batches=[1, 2, 3, 4])
    kinds = {r.kind for r in result.rejected}
    assert kinds == {
        "more stages than layers",
        "batch not divisible by R × M",
        "interleaved needs M % S == 0",
    }
    text = str(result)
    assert text == result.table()
    assert result.merged == 0  # the 1-stage meshes' R = 4 does not divide 6
    assert text.splitlines()[0].startswith(
        f"plan for 4 devices, global batch 6: {len(result.ranked)} feasible, "
        f"{len(result.rejected)} rejected; planned in "
    )
    assert "  1 " in text and "mesh" in text and "batch not divisible by R × M ×" in text


@pytest.mark.parametrize(
    "config,batch,kind,match",
    [
        (
            RunConfig(0, 1, 1),
            4,
            "not a positive integer",
            "stages must be a positive integer, got 0",
        ),
        (
            RunConfig(1, 1, 0),
            4,
            "not a positive integer",
            "micro_batches must be a positive integer, got 0",
        ),
        (
            RunConfig(1, 1, 1),
            0,
            "not a positive integer",
            "global_batch must be a positive integer, got 0",
        ),
        (
            RunConfig(1, 1, 1, "gpip"),
            4,
            "unknown schedule",
            r"unknown schedule 'gpip'; choose one of",
        ),
        (RunConfig(1, 1, 1, remat="some"), 4, "unknown remat mode", "unknown remat mode 'some'"),
        (
            RunConfig(1, 1, 1, "gpipe", virtual_stages=2),
            4,
            "virtual stages need the interleaved schedule",
            "virtual_stages=2 needs",
        ),
        (
            RunConfig(2, 2, 4),
            30,
            "batch not divisible by R × M",
            r"global batch 30 is not divisible by replicas \(2\) × micro_batches \(4\) = 8",
        ),
        (
            RunConfig(2, 1, 3, "interleaved", virtual_stages=2),
            6,
            "interleaved needs M % S == 0",
            "the interleaved schedule needs micro_batches to be a multiple of the pipeline "
            "stages: M=3, S=2; use M=4",
        ),
        (
            RunConfig(4, 1, 4, "interleaved", virtual_stages=2),
            4,
            "more stages than layers",
            r"more stages than layers: the run has 8 model stages \(4 devices × 2 virtual "
            r"stages\) but the model has only 4 layers; use at most 4 stages",
        ),
        (
            RunConfig(2, 1, 2, balance=(3, 2)),
            4,
            "bad balance",
            "sums to 5 but the model has 4",
        ),
    ],
)
def test_bad_configurations(config, batch, kind, match):
    with pytest.raises(ConfigError, match=match) as err:
        planner.evaluate(uniform(4), config, batch)
    assert err.value.kind == kind


INFEASIBLE = {
    "more stages than layers",
    "batch not divisible by R × M",
    "interleaved needs M % S == 0",
}


def _unbalanced(config):
    return dataclasses.replace(config, balance=None)


@pytest.mark.parametrize("num_layers", [1, 3, 4, 8])
def test_the_planner_never_proposes_what_pipeline_refuses(num_layers):
    """Every candidate the search considers is judged once; each proposed one (ranked, or
    out of memory) passes validate_run with the balance the planner chose, and each one
    rejected as infeasible fails validate_run with the same kind."""
    profile = uniform(num_layers, param_bytes=100.0)
    limit = 0.9 * 4 * profile.param_bytes  # the whole model does not fit on one device
    kinds = collections.Counter()
    for devices in (1, 2, 3, 4, 6, 8):
        for batch in (1, 4, 6, 12):
            result = planner.plan(
                profile,
                devices=devices,
                global_batch=batch,
                memory_per_device=limit,
                max_micro_batches=8,
                max_virtual_stages=3,
                balances=[None],  # the rules, not the cuts (test_memory_balance.py)
                shardings=[False],  # nor ZeRO-1 (test_memory_balance.py)
            )
            considered = search.candidates(
                devices,
                batch,
                num_layers,
                schedule.names(),
                planner.REMAT_MODES,
                None,
                8,
                3,
                None,
            )
            judged = [p.config for p in result.ranked] + [r.config for r in result.rejected]
            assert collections.Counter(map(_unbalanced, judged)) == collections.Counter(considered)
            for p in result.ranked:
                assert validate_run(p.config) == p.config
                assert (p.config.global_batch, p.config.num_layers) == (batch, num_layers)
            for r in result.rejected:
                kinds[r.kind] += 1
                if r.kind == "out of memory":
                    assert validate_run(r.config) == r.config
                    assert r.prediction.peak_memory > limit * (1 - planner.ALLOCATOR_HEADROOM)
                    continue
                assert r.kind in INFEASIBLE
                with pytest.raises(ConfigError) as err:
                    validate_run(r.config)
                assert err.value.kind == r.kind
                assert str(err.value) == r.reason
    assert set(kinds) >= {"out of memory", "batch not divisible by R × M"}
    if num_layers < 8:
        assert "more stages than layers" in kinds


def test_bad_arguments():
    with pytest.raises(ValueError, match="devices must be a positive integer, got 0"):
        planner.plan(uniform(), devices=0, global_batch=4)
    with pytest.raises(ValueError, match="stages=3 does not divide devices=4"):
        planner.plan(uniform(), devices=4, global_batch=4, stages=[3])
    with pytest.raises(ValueError, match="unknown remat mode 'later'"):
        planner.plan(uniform(), devices=2, global_batch=4, remats=["later"])
    with pytest.raises(ValueError, match="needs input_shape"):
        planner.plan([keras.layers.Dense(2)], devices=1, global_batch=4)
    with pytest.raises(ValueError, match="bandwidth > 0 and latency >= 0; got bandwidth=0"):
        Link(bandwidth=0)
    with pytest.raises(ValueError, match="memory_per_device must be positive, got -1"):
        Hardware(memory_per_device=-1)
    with pytest.raises(ValueError, match="tensor_overhead=-1"):
        Hardware(tensor_overhead=-1)
    with pytest.raises(ValueError, match="optimizer_slots must be >= 0, got -1"):
        planner.evaluate(uniform(), RunConfig(1, 1, 1), 1, optimizer_slots=-1)
    with pytest.raises(ConfigError, match="micro_batches must be a positive integer, got 0"):
        planner.plan(uniform(), devices=2, global_batch=4, micro_batches=[0])
    with pytest.raises(ValueError, match="by measured time or memory; use balance=None, 'time'"):
        planner.evaluate(uniform(), RunConfig(2, 1, 1, balance="params"), 1)
    with pytest.raises(ValueError, match=r"config.global_batch=8 differs .* \(4\)"):
        planner.evaluate(uniform(), RunConfig(1, 1, 1, global_batch=8), 4)
    with pytest.raises(ValueError, match=r"config.num_layers=3 differs .* \(4\)"):
        planner.evaluate(uniform(), RunConfig(1, 1, 1, num_layers=3), 4)
    timed = planner.evaluate(uniform(), RunConfig(2, 1, 2, balance="time"), 2)
    assert timed == planner.evaluate(uniform(), RunConfig(2, 1, 2), 2)
    layer = uniform(1).layers[0]
    with pytest.raises(ValueError, match="forward has 1 values but the profile has 2"):
        CostProfile((layer,), (1, 2), 0.0)
    with pytest.raises(ValueError, match=r"increasing order, got \[2, 1\]"):
        CostProfile((layer,), (2, 1), 0.0)


def test_interpolation_between_and_beyond_measured_batches():
    layer = LayerCost(
        "l",
        (1.0, 4.0),
        (2.0, 2.0),
        (0.0, 0.0),
        (0.0, 0.0),
        (0.0, 0.0),
        (0.0, 0.0),
        (8.0, 32.0),
        0.0,
    )
    profile = CostProfile((layer,), (2, 8), 0.0)
    assert profile.value(0, "forward", 4) == pytest.approx(2.0)
    assert profile.value(0, "forward", 16) == pytest.approx(8.0)
    assert profile.value(0, "forward", 1) == pytest.approx(0.5)
    assert profile.value(0, "backward", 100) == pytest.approx(2.0)  # a fixed cost stays fixed
    assert profile.value(0, "output_bytes", 4) == pytest.approx(16.0)
    single = uniform(1)  # one point: proportional to the batch
    assert single.value(0, "forward", 6) == pytest.approx(6 * F)


def test_the_profile_is_a_curve_over_every_micro_batch_size_a_candidate_runs():
    # 2 devices, batch 16: R=1 runs 16/M for M in 1..16, R=2 runs 8/M: sizes 1, 2, 4, 8, 16
    assert search._profile_batches(2, 16, None, 32, keep=6) == [1, 2, 4, 8, 16]
    # what M=2 runs, and the whole shard (M=2's deferred weight gradients)
    assert search._profile_batches(2, 16, [2], 32) == [4, 8, 16]
    assert search._profile_batches(2, 16, None, 4) == [2, 4, 8, 16]  # M <= 4
    assert search._profile_batches(2, 16, None, 32, stages=[1]) == [1, 2, 4, 8]  # R = 2 only
    # more sizes than PROFILED_SIZES: thinned evenly on a log scale, both ends kept
    assert search.PROFILED_SIZES == 4
    assert search._profile_batches(2, 16, None, 32) == [1, 2, 8, 16]
    assert search._profile_batches(1, 2**10, None, 2**10) == [1, 8, 128, 1024]
    assert search._profile_batches(1, 2**10, None, 2**10, keep=6) == [1, 4, 16, 64, 256, 1024]
    assert search._thinned([3, 5, 7], 6) == [3, 5, 7]


def test_on_a_given_mesh_the_planner_picks_the_fastest_m_on_the_cost_curve():
    # each layer's action costs a fixed 1 (F) or 2 (B) per micro-batch plus its examples:
    # more micro-batches shrink the bubble but pay the fixed cost more often
    sizes = (1, 2, 4, 8)

    def curve(fixed, each):
        return tuple(fixed + each * b for b in sizes)

    layer = LayerCost(
        "l", curve(1, 1), curve(2, 2), curve(2, 2), curve(1, 1), *[(0.0,) * 4] * 3, 0.0
    )
    layers = tuple(dataclasses.replace(layer, name=f"l{i}") for i in range(4))
    profile = CostProfile(layers, sizes, 0.0)
    steps = {
        M: planner.evaluate(profile, RunConfig(2, 1, M, "1f1b", "never"), 8).step_time
        for M in sizes
    }
    assert steps == {1: 99.0, 2: 85.0, 4: 87.0, 8: 106.0}  # the knee at M = 2
    kept = {"schedule": "1f1b", "remat": "never", "defer_weight_gradients": False}
    choice = planner.choose_mesh(profile, None, devices=2, stages=2, global_batch=8, **kept)
    assert (choice.config.stages, choice.config.replicas) == (2, 1)  # the mesh stays
    assert choice.config.micro_batches == 2 and choice.step_time == 85.0


def test_profile_round_trip_and_link_fit():
    profile = uniform(3, param_bytes=12.0, update=0.25)
    assert CostProfile.from_dict(profile.to_dict()) == profile
    link = Link.fit([1e3, 1e6, 4e6], [1e-5 + 1e3 / 2e9, 1e-5 + 1e6 / 2e9, 1e-5 + 4e6 / 2e9])
    assert link.bandwidth == pytest.approx(2e9) and link.latency == pytest.approx(1e-5)
    assert Link.fit([1, 2], [3.0, 3.0]) == Link(math.inf, 3.0)
    with pytest.raises(ValueError, match="two or more"):
        Link.fit([1], [1.0])


def test_profile_a_tiny_model_and_choose_a_mesh(caplog):
    keras.utils.set_random_seed(0)
    layers = [
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(8),
        keras.layers.Dense(10),
    ]
    profile = planner.profile_model(
        layers,
        (8,),
        "float32",
        [2, 4],
        loss=keras.losses.SparseCategoricalCrossentropy(True),
        optimizer=lambda: keras.optimizers.SGD(0.1),
        repeats=3,
        cache=False,
    )
    assert profile.batch_sizes == (2, 4) and profile.num_layers == 3
    # a program per layer and batch size, each traced once: no retracing warning
    assert not [r for r in caplog.records if "retracing" in r.getMessage()]
    assert [layer.param_bytes for layer in profile.layers] == [(8 * 8 + 8) * 4] * 2 + [
        (8 * 10 + 10) * 4
    ]
    assert [layer.param_tensors for layer in profile.layers] == [2, 2, 2]
    assert profile.layers[0].output_bytes == (2 * 8 * 4, 4 * 8 * 4)
    assert profile.input_bytes == 8 * 4 and profile.input_is_float
    for layer in profile.layers:
        assert min(layer.forward + layer.backward + layer.recompute_backward) >= 0
        assert min(layer.stored_bytes) > 0
    # Dense(8, relu) and Dense(8) differ; the first two layers are not one measurement
    choice = planner.choose_mesh(
        profile, None, devices=2, global_batch=8, schedule="1f1b", remat="always"
    )
    run = choice.config
    assert run.stages * run.replicas == 2 and run.schedule == "1f1b"
    assert 8 % (run.replicas * run.micro_batches) == 0
    assert sum(run.balance) == 3 and len(run.balance) == run.stages


@pytest.mark.parametrize("kind,micro_batches", [("micro-batch", 2), ("synchronized", 4)])
def test_a_model_with_batch_norm_prefers_enough_examples_per_normalization(kind, micro_batches):
    # 2 stages × 2 replicas, batch 64: the fastest M is the largest (the least bubble)
    args = dict(devices=4, global_batch=64, schedules=["1f1b"], stages=[2], remats=["never"])
    profile = uniform(8)
    assert planner.plan(profile, **args).best.config.micro_batches == 32
    # BN over >= 16 examples: B / (R·M) per micro-batch, B / M when synchronized
    with_bn = dataclasses.replace(profile, batch_norm=kind)
    c = planner.plan(with_bn, **args).best.config
    assert c.micro_batches == micro_batches
    assert with_bn.batch_norm_examples(64, c.replicas, c.micro_batches) == 16
    assert search.BATCH_NORM_MIN_EXAMPLES == 16


def test_profile_of_a_tied_model_counts_the_embedding_once():
    """A layer without ``get_config`` (a user's tied head) is profiled on its own, and the
    whole model's bytes count the embedding it shares once; each layer reading it counts
    it (both stages hold it)."""
    from hybrid.models.transformer import TiedHead
    from hybrid.planning import costs

    embedding = keras.layers.Embedding(64, 8)
    layers = [embedding, keras.layers.Dense(8), TiedHead(embedding)]
    profile = costs.profile_model(
        layers,
        (),
        "int32",
        [4],
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        target_shape=(),
        repeats=1,
    )
    table = 64 * 8 * 4
    assert [x.param_bytes for x in profile.layers] == [table, (8 * 8 + 8) * 4, table]
    assert profile.model_bytes == table + (8 * 8 + 8) * 4
    assert profile.template_bytes == profile.model_bytes < profile.param_bytes


def test_a_profile_is_measured_once_per_host_and_model(monkeypatch, tmp_path):
    """The second profile of the same layers (new instances, other names) is read back;
    another layer configuration, input, batch size or optimizer is measured; a layer without
    a configuration is measured every time."""
    from hybrid.planning import costs, profile_cache
    from hybrid.planning import profile as profile_lib

    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path))
    measured = []  # the first measurement is real; the others are counted and reuse it

    def measure(*args, real=profile_lib.measure_layers, **kwargs):
        measured.append(measured[0] if measured else real(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(profile_lib, "measure_layers", measure)

    def profile(width=8, batch=2, lr=0.1, layers=None):
        keras.utils.set_random_seed(0)
        layers = layers or [keras.layers.Dense(width, activation="relu"), keras.layers.Dense(4)]
        return layers, costs.profile_model(
            layers, (8,), "float32", [batch], loss=keras.losses.SparseCategoricalCrossentropy(True),
            optimizer=lambda: keras.optimizers.SGD(lr), repeats=1,
        )  # fmt: skip

    _, first = profile()
    assert len(measured) == 1 and len(os.listdir(profile_cache.directory())) == 1
    layers, again = profile()
    assert len(measured) == 1  # read back
    assert [x.name for x in again.layers] == [layer.name for layer in layers]  # its own names
    same = lambda p: dataclasses.replace(p, layers=tuple(  # noqa: E731
        dataclasses.replace(x, name="") for x in p.layers))  # fmt: skip
    assert same(again) == same(first)
    for changed in ({"width": 9}, {"batch": 4}, {"lr": 0.2}):
        profile(**changed)
    assert len(measured) == 4 and len(os.listdir(profile_cache.directory())) == 4
    from hybrid.models.transformer import TiedHead

    embedding = keras.layers.Embedding(16, 8)
    embedding.build((None,))
    tied = [keras.layers.Dense(8), TiedHead(embedding)]
    assert profile_cache.fingerprint(model_calls(tied, (8,)), [2], device="CPU:0") is None
    profile(layers=tied)
    profile(layers=tied)
    assert len(measured) == 6 and len(os.listdir(profile_cache.directory())) == 4


def test_a_profile_on_a_shared_host_times_two_devices_at_once(monkeypatch, tmp_path):
    """The profile's concurrency is measured beside the second local CPU device (the heaviest
    run, at the largest size) and filed with the profile; one device alone has none."""
    from hybrid.core.mesh import local_devices
    from hybrid.planning import costs
    from hybrid.planning import profile as profile_lib

    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path))
    cpus = list(local_devices())
    assert costs._beside(cpus[0], cpus) == cpus[1]
    assert costs._beside(cpus[0], cpus[:1]) is None
    assert costs._beside("/device:GPU:0", ["/device:GPU:0", "/device:GPU:1"]) is None
    seen = []

    def timed(probe, twin, repeats, repetitions):
        # each run repeats the program as often as a run of about RUN_SECONDS needs
        assert 1 <= repetitions <= 8
        seen.append((probe.programs.stage.device, twin.programs.stage.device, twin.batch))
        return 1.25

    monkeypatch.setattr(profile_lib, "measure_concurrency", timed)

    def profile():
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)]
        return costs.profile_model(
            layers, (8,), "float32", [2, 8], loss=keras.losses.SparseCategoricalCrossentropy(True),
            repeats=1, cache=False,
        )  # fmt: skip

    # programs shorter than the threshold are not timed two at once (they would time launches)
    monkeypatch.setattr(profile_lib, "MIN_CONCURRENCY_SECONDS", 1e9)
    assert profile().concurrency == 1.0 and not seen
    monkeypatch.setattr(profile_lib, "MIN_CONCURRENCY_SECONDS", 0.0)
    assert profile().concurrency == 1.25
    assert seen == [(cpus[0], cpus[1], 8)]


def test_timing_rounds_repeat_a_long_program_once_and_record_seconds_per_repetition(
    monkeypatch,
):
    """The first round runs every program the profile's chain of times; later rounds a
    program that took RUN_SECONDS or more per repetition once, a short one the whole chain;
    each time is seconds per repetition net of the identity twin run as often. (A clock
    of the programs' own: seconds = launch + repetitions × per repetition.)"""
    import types

    import tensorflow as tf

    from hybrid.planning import profile as profile_lib

    calls = []

    def program(per_repetition):
        def seconds(repeats):
            calls.append((per_repetition, repeats))
            return 1e-3 + per_repetition * repeats

        return types.SimpleNamespace(seconds=seconds)

    monkeypatch.setattr(profile_lib, "run_seconds", lambda p, args: p.seconds(int(args[3])))
    long, short = program(0.03), program(1e-4)
    programs = types.SimpleNamespace(forward=long, stored=short)
    probe = types.SimpleNamespace(
        names=("forward", "stored"), programs=programs, args=([], [], [], tf.constant(4)),
        times={"forward": [], "stored": []},
    )  # fmt: skip
    identity = types.SimpleNamespace(forward=program(1e-5), stored=program(1e-5))
    launch = profile_lib._time_rounds([[probe]], identity, ([], [], [], tf.constant(4)), 3)
    # per round: forward (long) and its twin, stored (short) and its twin
    runs = [(ran[1], twin[1]) for ran, twin in zip(calls[0::2], calls[1::2], strict=True)]
    assert runs == [(4, 4), (4, 4), (1, 1), (4, 4), (1, 1), (4, 4)]
    assert probe.times["forward"] == pytest.approx([0.03 - 1e-5] * 3)  # per repetition, net
    assert probe.times["stored"] == pytest.approx([1e-4 - 1e-5] * 3)
    assert launch == pytest.approx((1e-3 + 4e-5) / 4)  # the twin's forward, at the chain


def test_two_devices_at_once_are_timed_against_one_alone():
    from hybrid.core.mesh import local_devices
    from hybrid.planning import profile as profile_lib
    from hybrid.planning.concurrency import measure_concurrency

    keras.utils.set_random_seed(0)
    calls = model_calls([keras.layers.Dense(256, activation="relu"), keras.layers.Dense(4)], (256,))
    setup = profile_lib._Setup(None, None, None, (), "int32", 3, 4, True)
    cpu0, cpu1 = list(local_devices())[:2]
    probes = []
    for device in (cpu0, cpu1):
        here = dataclasses.replace(setup, device=device)
        programs = profile_lib.StagePrograms(profile_lib._stage(calls, 0, 2, here, device))
        probes.append(profile_lib._probe(calls, 0, 2, here, programs, 64))
    factor = measure_concurrency(*probes, 5)
    # at least 1 by definition; finite and not absurd even on a loaded host (a bound against
    # a broken measurement, e.g. the twin timed alone or the ratio upside down)
    assert 1.0 <= factor < 16.0


def graph_model():
    """Two named inputs, a nested functional block, a skip over it, a merge, a Dense called
    twice (tied), and a non-tensor argument (``Dropout(training=False)``)."""
    keras.utils.set_random_seed(0)
    inner_in = keras.Input((8,))
    inner = keras.Model(inner_in, keras.layers.Dense(8, activation="relu", name="inner")(inner_in))
    a, b = keras.Input((6,), name="a"), keras.Input((2,), name="b")
    h = keras.layers.Dense(8, name="first")(keras.layers.Concatenate(name="cat")([a, b]))
    shared = keras.layers.Dense(8, name="shared")
    deep = shared(keras.layers.Dropout(0.5, name="drop")(inner(h), training=False))
    joined = keras.layers.Add(name="join")([shared(h), deep])
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(3, name="head")(joined), name="g")


def test_any_model_the_pipeline_takes_is_planned_from_its_layer_calls():
    """The planner's rows are the Pipeline's layer calls, each measured on what the graph
    passes it; a cut's bytes count every tensor crossing it (the skip too); the plan's
    layout builds and trains."""
    model = graph_model()
    calls = model_calls(model)
    assert calls.names == ["cat", "first", "inner", "drop", "shared", "shared", "join", "head"]
    assert calls.wiring() == [[0, 1], [2], [3], [4], [3], [5], [6, 7], [8]]
    assert [s.shape for s in calls.input_specs] == [(6,), (2,)]
    assert calls.boundary_bytes(1) == calls.boundary_bytes(6) == 8 * 4
    assert [calls.boundary_bytes(i) for i in (2, 3, 4, 5)] == [2 * 8 * 4] * 4  # h passes over
    assert calls.arguments(3) != calls.arguments(2)  # training=False is what the call is given
    segment = calls.segment(4, 6)  # both calls of `shared`, on h and on the deep branch
    assert len(segment.inputs) == 2 and len(segment.outputs) == 2
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    found = planner.plan(
        model, devices=2, global_batch=8, loss=loss, hardware=Hardware(), stages=[2],
        micro_batches=[2], schedules=["1f1b"], remats=["never"], deferrals=[False], verbose=0,
    )  # fmt: skip
    best = found.best.config
    assert sum(best.balance) == 8 and best.stages == 2, best
    pipe = hybrid.Pipeline(model, hybrid.DeviceMesh.create(2, 1), config=best)
    pipe.compile(optimizer="sgd", loss=loss)
    x = {"a": np.ones((8, 6), "float32"), "b": np.ones((8, 2), "float32")}
    assert np.isfinite(pipe.train_on_batch(x, np.zeros(8, "int32")))


def test_a_run_of_calls_is_measured_as_one_stage_and_shared_by_estimated_work():
    """Past ``max_runs`` calls, runs of calls are measured whole; each call keeps its own
    weights and boundary bytes, and gets the run's time in proportion to its work."""
    from hybrid.planning import profile as profile_lib

    calls = model_calls(graph_model())
    runs = calls.groups(3)
    assert len(runs) == 3 and runs[0][0] == 0 and runs[-1][1] == 8
    assert all(a[1] == b[0] for a, b in zip(runs[:-1], runs[1:], strict=True))
    m = profile_lib.measure_layers(calls, [2], "/CPU:0", repeats=1, chain=1, max_runs=3)
    assert [r.name for r in m.layers] == calls.names
    assert [r.param_bytes for r in m.layers] == [0, 288, 288, 0, 288, 288, 0, 27 * 4]
    assert [r.timings[0].output_bytes for r in m.layers] == [
        2 * calls.boundary_bytes(i) for i in range(8)
    ]
    work = calls.work()
    for start, stop in runs:
        forward = [m.layers[i].timings[0].forward for i in range(start, stop)]
        total = sum(work[start:stop])
        if sum(forward) and total:
            expected = [sum(forward) * w / total for w in work[start:stop]]
            assert forward == pytest.approx(expected)
    assert calls.groups(8) == [(i, i + 1) for i in range(8)]
    timing = profile_lib.LayerTiming(2, 1.0, 2.0, 2.0, 1.0, 900, 100, 0)
    run = profile_lib.LayerMeasurement("", 0, 0, 0.0, (timing,))
    # first, inner, drop: 8 floats out each
    rows = profile_lib._per_call(calls, (1, 4), run, calls.work())
    assert [r.timings[0].working_bytes for r in rows] == [100, 0, 0]  # once: max and sum hold
    assert [r.timings[0].stored_bytes for r in rows] == [300, 300, 300]


def test_a_keras_applications_cnn_is_planned_in_runs_of_its_calls(monkeypatch, tmp_path):
    """MobileNetV3Small's 180 layer calls (blocks of skips and squeeze-excitation merges)
    are planned as the Pipeline cuts them, measured in at most 32 runs of calls."""
    from hybrid.planning import profile as profile_lib

    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV3Small(
        input_shape=(32, 32, 3), weights=None, classes=10, include_preprocessing=False
    )
    calls = model_calls(model)
    runs = calls.groups(profile_lib.MAX_RUNS)
    assert len(calls.calls) > 150 and len(runs) == profile_lib.MAX_RUNS
    assert [b for _, b in runs[:-1]] == [a for a, _ in runs[1:]] and runs[-1][1] == len(calls.calls)
    work = calls.work()
    assert max(work) > 0 and all(w >= 0 for w in work)
    seen = []

    def measure(calls, sizes, device, **kwargs):
        seen.append((len(calls.calls), list(sizes)))
        return profile_lib.ModelMeasurement(tuple(  # one uniform row per call
            profile_lib.LayerMeasurement(name, 4, 1, 0.0, tuple(
                profile_lib.LayerTiming(b, 1e-4 * b, 2e-4 * b, 2e-4 * b, 1e-4 * b, 64 * b,
                                        64 * b, 32 * b)
                for b in sizes))
            for name in calls.names), 12288, 0.0, device)  # fmt: skip

    monkeypatch.setattr(profile_lib, "measure_layers", measure)
    monkeypatch.setenv("HYBRID_CACHE_DIR", str(tmp_path))  # no stub profile filed for others
    loss = keras.losses.SparseCategoricalCrossentropy()
    found = planner.plan(model, devices=2, global_batch=8, loss=loss, hardware=Hardware(),
                         verbose=0)  # fmt: skip
    assert len(seen[0][1]) <= search.PROFILED_SIZES_MANY_CALLS  # fewer sizes for many calls
    assert seen[0][0] == len(calls.calls) == sum(found.best.config.balance)


def test_a_model_the_planner_cannot_profile_is_refused_with_what_to_do():
    class Subclassed(keras.Model):
        def call(self, x):
            return x

    with pytest.raises(ValueError, match="subclassed Keras model"):
        planner.plan(Subclassed(), devices=2, global_batch=8, verbose=0)
    x_in = keras.Input((6,))
    outputs = [keras.layers.Dense(2)(x_in), keras.layers.Dense(3)(x_in)]
    two = keras.Model(x_in, outputs, name="two")
    with pytest.raises(
        ValueError, match="plan\\(\\) profiles models with one output; 'two' returns 2"
    ):
        planner.plan(two, devices=2, global_batch=8, verbose=0)
    tokens = keras.Input((None,), dtype="int32")
    open_length = keras.Model(tokens, keras.layers.Embedding(8, 4)(tokens), name="open")
    with pytest.raises(ValueError, match=r"'open' leaves an input dimension open \(None,\): the"):
        planner.plan(open_length, devices=2, global_batch=8, verbose=0)
    with pytest.raises(ValueError, match="input_shape describes one input; 'g' takes 2"):
        planner.plan(graph_model(), devices=2, global_batch=8, input_shape=(6,), verbose=0)
    with pytest.raises(ValueError, match="x holds 1 arrays; 'g' takes 2 inputs"):
        planner.plan(graph_model(), devices=2, global_batch=8, x=np.ones((2, 6)), verbose=0)


def test_an_open_sequence_length_is_fixed_by_a_sample_batch(monkeypatch):
    """A KerasHub task model (its backbone nested, token ids and a padding mask of open
    length, the token embedding called again with ``reverse=True``) is planned from a
    sample batch ``x``, one row per call the Pipeline cuts."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=8, dropout=0.0,
    )  # fmt: skip
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    x = {"padding_mask": np.ones((4, 8), "int32"), "token_ids": np.ones((4, 8), "int32")}
    calls = model_calls(lm, x=x)
    assert calls.names[0] == calls.names[-1] == "token_embedding"
    assert calls.arguments(0) != calls.arguments(len(calls.calls) - 1)  # reverse=True
    assert [s.shape for s in calls.input_specs] == [(8,), (8,)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    profiled = []

    def profile(calls, *args, **kwargs):
        profiled.append(calls)
        return uniform(len(calls.calls))

    monkeypatch.setattr(search, "profile_model", profile)
    found = planner.plan(lm, devices=2, global_batch=8, x=x, loss=loss, hardware=Hardware(),
                         verbose=0)  # fmt: skip
    assert profiled[0].names == calls.names and sum(found.best.config.balance) == len(calls.calls)


def test_the_optimizers_state_is_counted_on_the_optimizer_given():
    """Without optimizer_slots, the plan counts the state of the optimizer it is given, as
    the Pipeline counts it: SGD none, SGD with momentum one, Adam two weights' worth."""
    args = dict(
        devices=1, global_batch=4, stages=[1], schedules=["gpipe"], remats=["never"],
        micro_batches=[1], verbose=0,
    )  # fmt: skip
    profile = uniform(4, param_bytes=1000.0)

    def peak(**kwargs):
        return planner.plan(profile, **args, **kwargs).best.peak_memory

    sgd = peak(optimizer=lambda: keras.optimizers.SGD(0.1))
    assert peak(optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9)) == sgd + 4000
    assert peak(optimizer=lambda: keras.optimizers.Adam()) == sgd + 8000 == peak()
    assert peak(optimizer=lambda: keras.optimizers.Adam(), optimizer_slots=0) == sgd
    assert search.slots_of(lambda: keras.optimizers.Adam(use_ema=True)) == 3


def test_the_launcher_profiles_your_model_with_its_loss():
    """--mesh=auto and --dry_run profile a --model=module:function model itself (its
    keras.Input gives the input, or your --data's first batch where that leaves a
    dimension open), with the loss it was compiled with."""
    from hybrid.run.train_config import TrainConfig
    from hybrid.run.user_model import profiled_layers

    config = TrainConfig.of(model="user_model:chain", data="user_model:data", mesh="auto")
    profiled = profiled_layers(config)
    assert isinstance(profiled.model, keras.Sequential) and profiled.input_shape is None
    assert [s.shape for s in model_calls(profiled.model).input_specs] == [(12,)]
    assert isinstance(profiled.loss, keras.losses.SparseCategoricalCrossentropy)
    assert profiled.x is None  # its keras.Input fixes the input
    config = TrainConfig.of(model="user_model:gpt2", data="user_model:tokens", mesh="auto")
    profiled = profiled_layers(config)  # an open sequence length: the data's first batch
    assert [a.shape for a in profiled.x] == [(1, 8), (1, 8)]  # the data's 8 tokens


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
