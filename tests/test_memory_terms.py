"""The cost model's per-device memory, term by term (``memory.memory_terms``), and where
each term lands in a schedule: what ``benchmarks/memory.py`` compares with each stage's own
allocator (worst error on its grid in the benchmark's summary line)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from hybrid.core import memory
from hybrid.core.config import RunConfig
from hybrid.planning import cost_model
from hybrid.planning.costs import uniform_profile

import runner

S, M = 4, 8


def profile():
    # 8 layers of 100 parameter bytes (2 per stage), 10 stored bytes and 1 output byte per
    # example, a 3-byte input, working set 5.
    return uniform_profile(
        8,
        param_bytes=100.0,
        stored_bytes=10.0,
        output_bytes=1.0,
        input_bytes=3.0,
        working_bytes=5.0,
    )


def test_terms_of_one_device():
    adam = memory.memory_terms(params=200.0, optimizer_slots=2, replicas=1, activations=50)
    assert adam["optimizer"] == 400.0  # Adam: 2 × params
    assert adam["gradients"] == 400.0  # the running sum read and the new one written
    # pipeline phase: 200 weights + 400 slots + 400 gradients + 50 activations (the update
    # phase, 200 + 400 + 2 × 200, updates in place: less)
    assert adam["total"] == 1050.0 and "update_temporaries" not in adam
    sgd = memory.memory_terms(params=200.0, optimizer_slots=0, replicas=1, activations=50)
    assert sgd["total"] == 200.0 + 400.0 + 50.0  # pipeline phase: weights, gradients, acts
    deferred = memory.memory_terms(200.0, 0, 1, 50.0, deferred=True)
    # the one W's gradients are inside its working set (the activations); the update holds
    # the accumulated gradients (200 weights + 200), and with replicas their reduced copy
    assert deferred["gradients"] == 0.0 and deferred["total"] == 400.0
    assert memory.memory_terms(200.0, 0, 2, 50.0, deferred=True)["total"] == 600.0
    one = memory.memory_terms(200.0, 2, 1, 50.0, accumulates=False)
    # one micro-batch has no running sum: its backward writes the gradients
    assert one["gradients"] == 200.0 and one["total"] == 200.0 + 400.0 + 200.0 + 50.0
    replicated = memory.memory_terms(200.0, 2, 2, 50.0)
    # the all-reduce reads the accumulated gradients and writes the update's reduced copy:
    # nothing beyond the update phase's two copies (measured on a 2 × 2 mesh)
    assert replicated["total"] == adam["total"] and "all_reduce" not in replicated
    first = memory.memory_terms(200.0, 2, 1, 50.0, batch_input=24.0)
    assert first["total"] == adam["total"] + 24.0
    small = memory.memory_terms(200.0, 2, 1, 0.0)  # no activations: still the pipeline's
    assert small["total"] == 200.0 + 400.0 + 400.0


def test_sharded_optimizer_states_hold_a_replicas_share():
    """ZeRO-1 (``shard_optimizer_states``): the slots ÷ R."""
    whole = memory.memory_terms(200.0, 2, 4, 50.0)
    shard = memory.memory_terms(200.0, 2, 4, 50.0, sharded=True)
    assert (whole["optimizer"], shard["optimizer"]) == (400.0, 100.0)
    assert whole["total"] - shard["total"] == 400.0 - 100.0
    config = RunConfig(S, 2, M, "gpipe", "never")
    plain = cost_model.evaluate(profile(), config, 2 * M)
    sharded = cost_model.evaluate(
        profile(), dataclasses.replace(config, shard_optimizer_states=True), 2 * M
    )
    assert [t["optimizer"] for t in sharded.memory_terms] == [200.0] * S  # 400 / 2 replicas
    assert all(
        a < b for a, b in zip(sharded.memory_per_device, plain.memory_per_device, strict=True)
    )


def test_the_users_model_is_on_no_device():
    """The engine builds the user's Keras model in the client's host memory, not beside stage
    0: no device's terms count it. Its bytes (a variable read by two layers, a tied
    embedding, once: the profile's ``model_bytes``) are the host's."""
    config = RunConfig(S, 1, M, "1f1b", "never")
    tied = dataclasses.replace(profile(), model_bytes=700.0)
    assert tied.param_bytes == 800.0 and tied.template_bytes == 700.0
    terms = cost_model.evaluate(tied, config, M).memory_terms
    assert all("template" not in t for t in terms)
    assert [t["params"] for t in terms] == [200.0] * S
    assert profile().template_bytes == 800.0  # not measured: the layers' sum


def test_1f1b_first_stage_holds_S_micro_batches_last_holds_one():
    p = cost_model.evaluate(profile(), RunConfig(S, 1, M, "1f1b", "never"), M)
    assert p.peak_in_flight == (4, 3, 2, 1)
    # each micro-batch (1 example): 2 layers × 10 stored, and on stages > 0 the 1 input
    # byte (stage 0's inputs are slices of the batch input); + the 1-byte output gradient
    # its backward reads from the next stage; + working 5. The last stage
    # runs each F with its B in one program, storing nothing between them: its input and
    # that program's peak (the second layer's working set beside the first's 10 bytes).
    acts = [t["activations"] for t in p.memory_terms]
    assert acts == pytest.approx([4 * 20 + 1 + 5, 3 * 21 + 1 + 5, 2 * 21 + 1 + 5, 1 + 10 + 5])
    # stage 0's device also holds the replica's whole input (M examples × 3 bytes)
    assert [t["batch_input"] for t in p.memory_terms] == [24.0, 0.0, 0.0, 0.0]
    # the pipeline phase: 200 weights + 400 slots + 400 gradients + activations
    resident = 200 + 400 + 400
    peaks = (resident + 24 + 86, resident + 69, resident + 48, resident + 16)
    assert p.memory_per_device == pytest.approx(peaks)
    gpipe = cost_model.evaluate(profile(), RunConfig(S, 1, M, "gpipe", "never"), M)
    assert gpipe.peak_in_flight == (M,) * S
    sgd = cost_model.evaluate(profile(), RunConfig(S, 1, M, "gpipe", "never"), M, optimizer_slots=0)
    # without slots the pipeline phase is the peak: M micro-batches' activations
    assert sgd.memory_per_device[-1] == pytest.approx(200 + 400 + M * 21 + 5)


def test_a_device_deferring_for_two_model_stages_keeps_what_both_will_read():
    """Interleaved with deferred weight gradients: each of a device's model stages keeps
    all M micro-batches' inputs and output gradients until its one W at the step's end, so
    what they keep adds up (measured: a ResNet layout predicted by the larger of the two
    ran out of a 64 MiB cap, ``benchmarks/memory_wall.py``)."""
    config = RunConfig(2, 1, M, "interleaved", "never", virtual_stages=2)
    deferred = dataclasses.replace(config, defer_weight_gradients=True)
    acts = [t["activations"] for t in cost_model.evaluate(profile(), deferred, M).memory_terms]
    # per example a W reads its stage's input, 2 × its layers' 20 stored bytes, less its
    # 1-byte output: 3 + 40 - 1 on model stage 0, 1 + 40 - 1 on the others; M = 8 examples
    # each; device 0 holds model stages 0 and 2, device 1 stages 1 and 3; one W's working
    # set at M rows: 8 × 5
    assert acts == pytest.approx([M * 42 + M * 40 + M * 5, M * 40 + M * 40 + M * 5])


def test_plan_says_by_how_much_the_smallest_candidate_misses():
    from hybrid.planning import search
    from hybrid.planning.hardware import ALLOCATOR_HEADROOM

    # 2 devices; the smallest: 2×1 with one micro-batch of 8 examples, recomputing: device
    # 0 holds 400 weight bytes, Adam's 800, 400 of gradients (one micro-batch: no running
    # sum), the 24-byte input and 288 of activations = 1912 B; the model itself is in the
    # client's memory. (test_memory_balance: where a memory cut fits and the time cut does
    # not.) Each device's memory less the share left to the allocator: 1888 B usable.
    whole = 1888 / (1 - ALLOCATOR_HEADROOM)
    result = search.plan(profile(), devices=2, global_batch=8, memory_per_device=whole)
    with pytest.raises(ValueError) as error:
        _ = result.best
    assert (
        "the smallest candidate, 2x1 M=1 1f1b except_last, needs 1.87 KiB per device: 24 B "
        "(1%) more than the 1.84 KiB each device has after the 10% left to the allocator"
        in str(error.value)
    )
    fits = search.plan(
        profile(), devices=2, global_batch=8, memory_per_device=1913 / (1 - ALLOCATOR_HEADROOM)
    )
    assert fits.best.config.stages == 2
    assert fits.best.peak_memory == pytest.approx(1912.0)


# Run under TensorFlow's BFC allocator (set before TensorFlow starts: a process of its own).
_KEPT = textwrap.dedent(
    """
    import json
    import keras
    from hybrid.planning import layer_programs, model_calls, profile

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32,)),
        keras.layers.Dense(64),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.Dense(64),
        keras.layers.Dense(10),
    ])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    measured = profile.measure_layers(
        model_calls.model_calls(model), [16], "/CPU:0", loss=loss, repeats=1
    )
    calls = model_calls.model_calls(model)
    setup = profile._Setup("/CPU:0", loss, None, (), "int32", 1, 1, True)
    stage = profile._stage(calls, 0, 4, setup, "/CPU:0")
    programs = layer_programs.StagePrograms(stage)
    probe = profile._probe(calls, 0, 4, setup, programs, 16)
    whole = layer_programs.measure_memory("/CPU:0", programs, probe.args)
    print(json.dumps({
        "layers": [m.timings[0].stored_bytes for m in measured.layers],
        "whole": whole.stored, "whole_output_kept": whole.keeps[0],
        "gradients": layer_programs._dense_gradient_bytes(stage),
    }))
    """
)


def test_what_a_layer_keeps_adds_up_to_what_a_stage_of_them_keeps():
    # Each layer call is profiled as its own stage, whose outputs it always returns; inside
    # a stage of several layers an output is kept only where a backward reads it. Counted
    # from the tensors (not the allocator's chunks), the layers' stored bytes add up to
    # what one stage of them keeps.
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run(
        [sys.executable, "-c", _KEPT], env=env, capture_output=True, text=True, check=True
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    dense, norm, relu, hidden, _ = found["layers"]
    activation = 16 * 64 * 4  # one (16, 64) float32 tensor
    assert dense == activation  # its output, which BatchNormalization's backward reads
    assert norm < activation // 2  # its statistics: ReLU's backward reads its own output
    assert relu == activation  # its output (its own backward's, and Dense's input)
    assert hidden == activation  # its output, which the head's backward reads
    # the four as one stage: the same, its output (the hidden Dense's) not kept inside it
    assert found["whole_output_kept"] is False
    assert found["whole"] + activation == pytest.approx(dense + norm + relu + hidden, rel=0.02)
    # a working set leaves out the dense weight gradients (counted as the running sums the
    # engine adds them to): the trainable weights' bytes, BatchNormalization's moving
    # statistics (not trainable) aside
    weights = (32 * 64 + 64) + 2 * 64 + (64 * 64 + 64)
    assert found["gradients"] == 4 * weights


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
