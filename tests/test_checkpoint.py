"""Checkpoints: saved per model variable, restored onto other meshes and balances, exactly.

The resharding test trains on a 2×2 mesh, saves, and restores onto 4×1 and onto 1×2 with
another balance; the steps after the restore must match continuing on the 2×2 mesh (and
the single-device reference).
"""

import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from hybrid.run.checkpoint import Checkpointer, CheckpointError

import reference
import runner

BATCH = 16


def pipeline(stages, replicas, balance=None, optimizer="adam", layers=None, micro_batches=2):
    return reference.pipeline(
        stages,
        replicas,
        layers=layers,
        optimizer=reference.OPTIMIZERS[optimizer],  # the factory: one optimizer per device
        micro_batches=micro_batches,
        balance=balance,
        schedule="1f1b" if stages > 1 else "gpipe",
        jit_compile=False,
        build=True,
    )


def batches(start, count):
    return [reference.batch(BATCH, seed=100 + start + i) for i in range(count)]


def train(pipe, data):
    return [pipe.train_step(x, y)["loss"] for x, y in data]


@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
def test_restore_onto_other_meshes_and_balances_continues_exactly(tmp_path, optimizer):
    first = pipeline(2, 2, optimizer=optimizer)
    train(first, batches(0, 3))
    saved = Checkpointer(first, str(tmp_path)).save(step=3)
    assert os.path.basename(saved) == "ckpt-3"
    expected_losses = train(first, batches(3, 2))
    expected = first.get_weights()

    for stages, replicas, balance in [(4, 1, None), (1, 2, None), (2, 1, [6, 2]), (2, 2, [1, 7])]:
        other = pipeline(stages, replicas, balance=balance, optimizer=optimizer)
        assert other.balance != first.balance or (stages, replicas) != (2, 2)
        restored = Checkpointer(other, str(tmp_path)).restore_latest()
        assert restored is not None and (restored.step, restored.data_position) == (3, 3)
        assert int(other.step_counter.numpy()) == 3
        for r in range(replicas):  # every replica got the checkpoint, not just replica 0
            reference.assert_weights_close(other.replica_weights(r), first_weights_at_3(tmp_path))
        losses = train(other, batches(3, 2))
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        reference.assert_weights_close(other.get_weights(), expected)


def first_weights_at_3(path):
    """The model weights stored in the checkpoint, read without any pipeline."""
    reader = tf.train.load_checkpoint(str(path))
    keys = sorted(
        k
        for k in reader.get_variable_to_shape_map()
        if k.startswith("model/v") and k.endswith("/.ATTRIBUTES/VARIABLE_VALUE")
    )
    return [reader.get_tensor(k) for k in keys]


def test_restored_training_matches_the_single_device_reference(tmp_path):
    """2×2 for 2 steps, restore on 2×1, 2 more steps == the reference trained 4 steps."""
    ref = reference.Reference(reference.mlp_layers(seed=0), reference.OPTIMIZERS["adam"]())
    data = batches(0, 4)
    ref_losses = [ref.train_step(x, y) for x, y in data]
    first = pipeline(2, 2)
    Checkpointer(first, str(tmp_path)).save(step=0)  # keep=3 keeps both
    train(first, data[:2])
    Checkpointer(first, str(tmp_path)).save(step=2)
    other = pipeline(2, 1, balance=[3, 5])
    assert Checkpointer(other, str(tmp_path)).restore_latest().step == 2
    losses = train(other, data[2:])
    np.testing.assert_allclose(losses, ref_losses[2:], rtol=1e-5)
    reference.assert_weights_close(other.get_weights(), ref.model.get_weights())


def scaled_pipeline(stages, replicas):
    """A mixed_float16 model under a LossScaleOptimizer whose scale doubles every 2 steps."""
    keras.utils.set_random_seed(0)
    layers = [
        keras.layers.Dense(16, activation="relu", dtype="mixed_float16"),
        keras.layers.Dense(16, activation="tanh", dtype="mixed_float16"),
        keras.layers.Dense(reference.CLASSES, dtype="float32"),
    ]
    inner = keras.optimizers.Adam(0.01)
    return reference.pipeline(
        stages,
        replicas,
        layers=layers,
        optimizer=keras.optimizers.LossScaleOptimizer(inner, 2.0**4, dynamic_growth_steps=2),
        micro_batches=2,
        jit_compile=False,
        build=True,
    )


def test_the_loss_scale_is_saved_and_restored(tmp_path):
    """A LossScaleOptimizer's dynamic scale and step counter (and its inner optimizer's
    state) are in the checkpoint: the restored run continues exactly."""
    first = scaled_pipeline(2, 1)
    train(first, batches(0, 3))
    Checkpointer(first, str(tmp_path)).save(step=3)
    expected_losses = train(first, batches(3, 2))
    other = scaled_pipeline(1, 2)
    Checkpointer(other, str(tmp_path)).restore_latest()
    for copy in other.stages[0]:
        optimizer = copy.optimizer
        assert float(optimizer.dynamic_scale.numpy()) == 2.0**5  # doubled once in 3 steps
        assert int(optimizer.step_counter.numpy()) == 1
        assert int(optimizer.iterations.numpy()) == 3
    # float16 micro-batches of another size round differently: equal to float16 round-off
    np.testing.assert_allclose(train(other, batches(3, 2)), expected_losses, rtol=2**-10)
    reference.assert_weights_close(other.get_weights(), first.get_weights(), rtol=1e-3)


def test_keeps_the_newest_checkpoints(tmp_path):
    pipe = pipeline(2, 1)
    saver = Checkpointer(pipe, str(tmp_path), keep=2)
    for step in range(1, 5):
        saver.save(step)
    names = sorted(f for f in os.listdir(tmp_path) if f.endswith(".index"))
    assert names == ["ckpt-3.index", "ckpt-4.index"]
    assert saver.latest.endswith("ckpt-4")


def test_unreadable_latest_falls_back_to_the_one_before(tmp_path):
    pipe = pipeline(2, 1)
    saver = Checkpointer(pipe, str(tmp_path))
    saver.save(1)
    at_one = pipe.get_weights()
    train(pipe, batches(0, 1))
    saver.save(2)
    data = [f for f in os.listdir(tmp_path) if f.startswith("ckpt-2.data")]
    with open(os.path.join(tmp_path, data[0]), "r+b") as f:
        f.truncate(8)  # a torn write
    other = pipeline(2, 1)
    messages = []
    restored = Checkpointer(other, str(tmp_path)).restore_latest(messages.append)
    assert restored.step == 1
    assert "ckpt-2 is unreadable" in messages[0]
    reference.assert_weights_close(other.get_weights(), at_one, rtol=0, atol=0)


def test_another_model_or_seed_is_refused_with_the_reason(tmp_path):
    Checkpointer(pipeline(2, 1), str(tmp_path), seed=0).save(1)
    wider = pipeline(2, 1, layers=reference.mlp_layers(seed=0, width=8))
    with pytest.raises(CheckpointError, match="has shape .* this model's has"):
        Checkpointer(wider, str(tmp_path)).restore_latest()
    shorter = reference.mlp_layers(seed=0)[:-1] + [keras.layers.Dense(reference.CLASSES)]
    fewer = pipeline(2, 1, layers=shorter[:4] + shorter[-1:])
    with pytest.raises(CheckpointError, match="holds a model of 14 variables, this .* model has 8"):
        Checkpointer(fewer, str(tmp_path)).restore_latest()
    with pytest.raises(CheckpointError, match="resume with seed=0"):
        Checkpointer(pipeline(2, 1), str(tmp_path), seed=5).restore_latest()
    with pytest.raises(CheckpointError, match="does not match this pipeline's optimizer"):
        Checkpointer(pipeline(2, 1, optimizer="sgd_momentum"), str(tmp_path)).restore_latest()


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
