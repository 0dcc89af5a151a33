"""The memory rule's cut (``hybrid.core.memory``), the engine's estimate it cuts
(``Pipeline(balance="memory")``, ``pipe.summary()``) and the planner's memory cuts."""

from __future__ import annotations

import dataclasses
import itertools
import sys

import keras
import numpy as np
import pytest

import hybrid
from hybrid.core import memory
from hybrid.core import schedule as schedule_lib
from hybrid.core.config import RunConfig
from hybrid.engine.model.optimizers import optimizer_copies, slots_per_weight
from hybrid.planning import cost_model
from hybrid.planning.costs import uniform_profile
from hybrid.planning.hardware import ALLOCATOR_HEADROOM as HEADROOM

import reference as ref
import runner


def random_layers(seed: int, n: int) -> memory.LayerBytes:
    rng = np.random.default_rng(seed)
    return memory.LayerBytes(
        params=list(rng.integers(0, 1000, n).astype(float)),
        stored=list(rng.integers(0, 500, n).astype(float)),
        working=list(rng.integers(0, 300, n).astype(float)),
        output=list(rng.integers(1, 400, n).astype(float)),
        model_input=float(rng.integers(1, 400)),
    )


def usage_for(name: str, S: int, M: int, remat: str, **kwargs) -> memory.Usage:
    """The usage of an S × 2 run with Adam."""
    config = RunConfig(S, 2, M, name, remat, **kwargs)
    sched = schedule_lib.validate(schedule_lib.get(name, S, M, config.virtual_stages))
    return memory.usage_of(config, sched, optimizer_slots=2)


def cuts(n: int, S: int):
    for ends in itertools.combinations(range(1, n), S - 1):
        bounds = (0, *ends, n)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


@pytest.mark.parametrize(
    "name,remat,deferred,sharded",
    [
        ("gpipe", "never", False, False),
        ("1f1b", "always", False, True),
        ("1f1b", "except_last", False, False),
        ("gpipe", "never", True, False),
    ],
)
def test_the_memory_cut_is_the_best_of_every_cut(name, remat, deferred, sharded):
    """balance_by_memory's largest stage peak equals the smallest over all cuts (brute
    force), on random layer bytes, and its stage_peaks are each stage's memory_terms."""
    for seed, (n, S) in enumerate([(7, 2), (8, 3), (9, 4)]):
        layers = random_layers(seed, n)
        usage = usage_for(
            name, S, 4, remat, defer_weight_gradients=deferred, shard_optimizer_states=sharded
        )
        chosen = memory.balance_by_memory(layers, S, usage)
        best = min(max(memory.stage_peaks(layers, c, usage)) for c in cuts(n, S))
        assert max(memory.stage_peaks(layers, chosen, usage)) == pytest.approx(best)
        assert sum(chosen) == n and min(chosen) >= 1


def test_stage_peaks_apply_the_terms_stage_by_stage():
    """Stage 0 holds the batch input (the user's model is in the client's memory, on no
    device); the in-flight counts are 1F1B's."""
    layers = memory.LayerBytes([100.0, 200.0], [10.0, 20.0], [5.0, 7.0], [3.0, 4.0], 2.0)
    usage = usage_for("1f1b", 2, 4, "never")
    assert usage.in_flight == (2, 1)
    s0, s1 = memory.stage_peaks(layers, (1, 1), usage)
    # stage 0: params 100, Adam state 200, input shard 4·2, gradients 200, activations
    # 2·10 + 3 + 5 (its inputs are slices of the shard; 3: the gradient of its output, which
    # its backward reads); update phase: 100 + 200 + 8 + 200 (R = 2: the all-reduce writes
    # the reduced gradients, the update's second copy, and the update writes in place)
    assert s0 == max(100 + 200 + 8 + 200 + 28, 508)
    # stage 1, the last, runs each F with its B in one program (it stores nothing between
    # them): 200 + 400 + 400 + (its input 3 + that program's peak, 7: its working set)
    assert usage.fused == (False, True)
    assert s1 == max(200 + 400 + 400 + 3 + 7, 1000)


def test_a_device_holding_virtual_stages_holds_all_their_weights():
    """Interleaved, v = 2: device 0 holds model stages 0 and 2: the weights, gradients and
    state of both, the activations of the fuller one and the input shard."""
    layers = random_layers(3, 8)
    usage = usage_for("interleaved", 2, 4, "never", virtual_stages=2)
    assert usage.device_of == (0, 1, 0, 1)
    balance = (2, 2, 2, 2)
    d0, d1 = memory.device_peaks(layers, balance, usage)
    stages = [memory.stage_bytes(layers, 2 * k, 2) for k in range(4)]
    wholes = [memory.stage_bytes(memory.scaled(layers, 4), 2 * k, 2) for k in range(4)]
    assert (
        d0
        == memory.device_terms([stages[0], stages[2]], [wholes[0], wholes[2]], [0, 2], usage)[
            "total"
        ]
    )
    held = max(
        memory.activation_bytes(
            stages[k],
            usage.in_flight[k],
            "never",
            usage.keeps_last[k],
            fused=usage.fused[k],
            last=k == 3,
        )
        for k in (1, 3)
    )
    params = stages[1].params + stages[3].params
    assert d1 == memory.memory_terms(params, 2, 2, held)["total"]
    alone = memory.stage_peaks(layers, balance, usage)
    assert d0 > max(alone[0], alone[2]) and d1 > max(alone[1], alone[3])


def test_the_memory_cut_evens_peaks_where_params_do_not():
    """Equal layers under 1F1B: the first stage holds 3 micro-batches in flight, the last
    1, so an even cut is uneven in memory (1.51×); the memory cut gives the first stage
    fewer layers and its largest/smallest is within 1.10 (the layers are fine enough)."""
    n = 60
    layers = memory.LayerBytes(
        params=[16_000.0] * n, stored=[16_000.0] * n, working=[8000.0] * n,
        output=[8000.0] * n, model_input=64_000.0,
    )  # fmt: skip
    usage = usage_for("1f1b", 3, 4, "never")
    cut = memory.balance_by_memory(layers, 3, usage)
    assert cut[0] < cut[1] <= cut[2]
    by_memory = memory.stage_peaks(layers, cut, usage)
    even = memory.stage_peaks(layers, (20, 20, 20), usage)
    assert memory.spread(by_memory) <= 1.10 < memory.spread(even)
    assert max(by_memory) < max(even)


def test_memory_sizes_parse_with_their_unit_or_are_refused():
    assert memory.parse_bytes("16GiB") == 16 * 2**30
    assert memory.parse_bytes(" 512 MiB ") == 512 * 2**20
    assert memory.parse_bytes("80GB") == 80e9 and memory.parse_bytes("1e3B") == 1000
    for bad in ("16", "16gb", "-1GiB", "0MiB", "GiB", "16 GiBs"):
        with pytest.raises(ValueError, match="is not a memory size: give a positive number"):
            memory.parse_bytes(bad)
    assert memory.format_bytes(1.5 * 2**30) == "1.5 GiB" and memory.format_bytes(100) == "100 B"


def test_optimizer_slots_are_counted_on_a_copy():
    counts = {
        "sgd": 0,
        "adam": 2,
        "rmsprop": 1,
        "adagrad": 1,
    }
    for name, want in counts.items():
        assert slots_per_weight(optimizer_copies(name)) == want, name
    assert slots_per_weight(optimizer_copies(keras.optimizers.SGD(momentum=0.9))) == 1
    assert slots_per_weight(optimizer_copies(keras.optimizers.Adam(use_ema=True))) == 3
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    assert slots_per_weight(optimizer_copies(scaled)) == 2


def wide_then_narrow(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(256, activation="relu")]
    layers += [keras.layers.Dense(32, activation="relu") for _ in range(6)]
    return keras.Sequential([keras.Input((ref.IN_FEATURES,)), *layers, keras.layers.Dense(4)])


def test_pipeline_balance_memory_cuts_by_the_estimate_and_trains_as_keras():
    """Pipeline(balance="memory") cuts where the estimate's largest stage peak is smallest
    (the summary shows each peak), and trains as plain Keras on one device."""
    keras_model = wide_then_narrow()
    keras_model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    template = wide_then_narrow()
    template.set_weights(keras_model.get_weights())
    pipe = hybrid.Pipeline(
        template, hybrid.DeviceMesh.create(2, 2), micro_batches=2, balance="memory"
    )
    pipe.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=False)
    with pytest.raises(ValueError, match=r"balance=\"memory\" weighs activations by the batch"):
        pipe.build((None, ref.IN_FEATURES))
    pipe.build((16, ref.IN_FEATURES))
    peaks = pipe.predicted_memory()
    layers, batch = pipe._bytes
    usage = memory.usage_of(pipe.config, pipe.schedule, 2)
    micro = memory.scaled(layers, batch / 4)
    assert pipe.balance == memory.balance_by_memory(micro, 2, usage)
    assert peaks == memory.stage_peaks(micro, pipe.balance, usage)  # one stage per device
    assert peaks == memory.device_peaks(micro, pipe.balance, usage)
    assert max(peaks) == min(max(memory.stage_peaks(micro, c, usage)) for c in cuts(8, 2))
    assert layers.params[0] == (ref.IN_FEATURES * 256 + 256) * 4
    assert layers.output[0] == 256 * 4 and layers.stored == layers.output
    shown = []
    pipe.summary(print_fn=shown.append)
    assert memory.format_bytes(peaks[0]) in shown[0].splitlines()[3]
    assert f"{memory.spread(peaks):.2f}× the smallest" in shown[0].splitlines()[-1]
    x = np.random.default_rng(0).normal(size=(16, ref.IN_FEATURES)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16, 4)).astype("float32")
    for _ in range(2):
        want = keras_model.train_on_batch(x, y)
        np.testing.assert_allclose(pipe.train_step(x, y)["loss"], want, rtol=1e-5)
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())


def test_the_planner_cuts_by_memory_to_fit_a_budget():
    """balance="memory" in the cost model lowers the largest device peak, and plan() with a
    budget only the memory cut meets chooses it (and says so in its balance)."""
    profile = uniform_profile(8, forward=1e-3, param_bytes=1e5, output_bytes=1e3)
    heavy = dataclasses.replace(profile.layers[0], param_bytes=4e6)
    profile = dataclasses.replace(profile, layers=(heavy, *profile.layers[1:]))
    config = RunConfig(2, 1, 2, "gpipe", "never")
    by_time = cost_model.evaluate(profile, config, 32)
    by_memory = cost_model.evaluate(
        profile, RunConfig(2, 1, 2, "gpipe", "never", balance="memory"), 32
    )
    assert by_memory.peak_memory < by_time.peak_memory
    budget = (by_memory.peak_memory + by_time.peak_memory) / 2  # usable: less the headroom
    plan = hybrid.plan(
        profile, devices=2, global_batch=32, memory_per_device=budget / (1 - HEADROOM), stages=[2],
        schedules=["gpipe"], remats=["never"], micro_batches=[2], deferrals=[False], verbose=0,
    )  # fmt: skip
    assert plan.best.config.balance == by_memory.config.balance
    assert [r.kind for r in plan.rejected] == ["out of memory"]  # the time cut


if __name__ == "__main__":
    sys.exit(runner.main(__file__))


def test_the_planner_shards_optimizer_states_to_fit_a_budget():
    """On 1 × 2 devices with Adam, sharding halves the optimizer state per device: with a
    budget between the two peaks plan() chooses shard_optimizer_states=True; a stage with
    fewer weight arrays than replicas cannot shard (the Pipeline refuses it too)."""
    profile = uniform_profile(4, forward=1e-3, param_bytes=1000.0, output_bytes=10.0)
    whole = RunConfig(1, 2, 1, "gpipe", "never")
    plain = cost_model.evaluate(profile, whole, 8)
    sharded = cost_model.evaluate(
        profile, dataclasses.replace(whole, shard_optimizer_states=True), 8
    )
    # Adam's state (2 × 4000 bytes) halves
    assert plain.peak_memory - sharded.peak_memory == pytest.approx(2 * 4000 / 2)
    budget = (plain.peak_memory + sharded.peak_memory) / 2
    plan = hybrid.plan(
        profile, devices=2, global_batch=8, memory_per_device=budget / (1 - HEADROOM), stages=[1],
        schedules=["gpipe"], remats=["never"], micro_batches=[1], verbose=0,
    )  # fmt: skip
    assert plan.best.config.shard_optimizer_states
    assert plan.best.peak_memory == pytest.approx(sharded.peak_memory)
    one_array = dataclasses.replace(
        profile, layers=tuple(dataclasses.replace(x, param_bytes=0.0) for x in profile.layers)
    )
    one_array = dataclasses.replace(
        one_array,
        layers=(
            dataclasses.replace(one_array.layers[0], param_bytes=4000.0),
            *one_array.layers[1:],
        ),
    )
    refused = hybrid.plan(
        one_array, devices=2, global_batch=8, memory_per_device=1e12, stages=[1],
        schedules=["gpipe"], remats=["never"], micro_batches=[1], verbose=0,
    )  # fmt: skip
    (rejection,) = [r for r in refused.rejected if r.config.shard_optimizer_states]
    assert rejection.kind == "too few variables to shard"
    assert "model stage 0 has 1 weight array(s) for 2 replicas" in rejection.reason
