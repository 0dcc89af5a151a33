"""Optimizer states sharded across a stage's replicas (ZeRO-1, ``shard_optimizer_states``):
the same losses, weights and optimizer states as plain Keras on one device, each replica
holding only its share of the state; checkpoints move between sharded and unsharded runs."""

import functools
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
import test_keras_exact as exact

import hybrid
from hybrid.engine.step import optimizer_state, sharding

import reference as ref
import runner

STEPS, BATCH = 3, 16

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-3, epsilon=1e-3),
    "adamw_excluding_biases": lambda: _adamw(),
    "sgd_momentum_global_clipnorm": lambda: keras.optimizers.SGD(
        0.05, momentum=0.9, global_clipnorm=0.5
    ),
    "adam_ema": lambda: keras.optimizers.Adam(1e-3, epsilon=1e-3, use_ema=True),
}


def _adamw() -> keras.optimizers.Optimizer:
    optimizer = keras.optimizers.AdamW(1e-3, weight_decay=0.1, epsilon=1e-3)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


def keras_twin(seed: int = 0) -> keras.Model:
    return keras.Sequential([keras.Input((ref.IN_FEATURES,)), *ref.mlp_layers(seed)])


def keras_fitted(optimizer: str) -> tuple[keras.Model, list[np.ndarray], dict]:
    """The Keras model trained STEPS steps with ``fit`` on one device, its initial weights
    and its history."""
    keras_model = keras_twin()
    keras_model.compile(optimizer=OPTIMIZERS[optimizer](), loss=ref.loss_fn())
    initial = keras_model.get_weights()
    x, y = ref.batch(BATCH * STEPS, seed=3)
    history = keras_model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    return keras_model, initial, history


@functools.cache
def keras_run(optimizer: str) -> tuple[list[np.ndarray], dict, list[np.ndarray]]:
    """:func:`keras_fitted`'s initial weights, history and final weights (EMA: its end swaps
    in the averages), the same for every test: each test process trains it once."""
    keras_model, initial, history = keras_fitted(optimizer)
    return initial, history, keras_model.get_weights()


def trained(optimizer: str, shard: bool, stages: int = 2, replicas: int = 2, schedule="gpipe"):
    """A pipeline of the test MLP trained STEPS steps with ``fit`` (EMA: its end swaps in
    the averages), the final weights of the Keras model trained the same way on one device,
    and both histories."""
    initial, want, weights = keras_run(optimizer)
    template = keras_twin(seed=1)
    template.set_weights(initial)
    pipe = hybrid.Pipeline(
        template,
        hybrid.DeviceMesh.create(stages, replicas),
        micro_batches=2,
        schedule=schedule,
        shard_optimizer_states=shard,
    )
    pipe.compile(optimizer=OPTIMIZERS[optimizer](), loss=ref.loss_fn(), jit_compile=False)
    x, y = ref.batch(BATCH * STEPS, seed=3)
    got = pipe.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    return pipe, weights, got, want


def held_state(pipe) -> dict[int, list[int]]:
    """Elements of optimizer state each replica holds, per stage."""
    found: dict[int, list[int]] = {}
    for k, row in enumerate(pipe.stages):
        indices = optimizer_state.global_indices(pipe.stages, pipe.placement)[k]
        found[k] = [
            sum(int(np.prod(v.shape)) for v in optimizer_state.slots(copy, indices).values())
            for copy in row
        ]
    return found


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_sharded_states_train_as_keras_trains(optimizer, schedule):
    pipe, weights, got, want = trained(optimizer, shard=True, schedule=schedule)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    ref.assert_weights_close(pipe.get_weights(), weights)
    for r in range(2):  # every replica holds the same weights after the owners sent theirs
        ref.assert_weights_close(pipe.replica_weights(r), weights)
    # each replica updates, and holds the state of, a share of every stage: together all
    state = held_state(pipe)
    plain, _, _, _ = trained(optimizer, shard=False, schedule=schedule)
    for k, shares in state.items():
        whole = held_state(plain)[k][0]
        assert sum(shares) == whole and all(0 < s < whole for s in shares), (k, shares, whole)


def test_sharded_slots_equal_the_unsharded_ones():
    sharded, _, _, _ = trained("adam", shard=True)
    plain, _, _, _ = trained("adam", shard=False)
    for k in range(len(sharded.stages)):
        indices = optimizer_state.global_indices(sharded.stages, sharded.placement)[k]
        mine = optimizer_state.row_slots(sharded.stages[k], indices)
        theirs = optimizer_state.slots(plain.stages[k][0], indices)
        assert mine.keys() == theirs.keys()
        for key in theirs:
            np.testing.assert_allclose(mine[key].numpy(), theirs[key].numpy(), rtol=1e-6)


def test_a_checkpoint_moves_between_sharded_and_unsharded_meshes(tmp_path):
    sharded, _, _, _ = trained("adam", shard=True)
    keras_model, _, _ = keras_fitted("adam")  # trained on below
    hybrid.Checkpointer(sharded, str(tmp_path)).save(step=STEPS)
    x, y = ref.batch(BATCH, seed=11)
    want = keras_model.train_on_batch(x, y)
    for stages, replicas, shard in ((3, 1, False), (2, 2, True), (1, 2, True)):
        other = hybrid.Pipeline(
            keras_twin(seed=2),
            hybrid.DeviceMesh.create(stages, replicas),
            micro_batches=2,
            shard_optimizer_states=shard,
        )
        other.compile(optimizer=OPTIMIZERS["adam"](), loss=ref.loss_fn(), jit_compile=False)
        other.build((None, ref.IN_FEATURES))
        hybrid.Checkpointer(other, str(tmp_path)).restore_latest()
        np.testing.assert_allclose(other.train_step(x, y)["loss"], want, rtol=1e-5)
        ref.assert_weights_close(other.get_weights(), keras_model.get_weights())


def test_one_loss_scale_on_every_sharded_copy_as_keras_has():
    """Every copy's LossScaleOptimizer, whatever share it updates, skips the overflowing
    step and moves its scale as Keras's one does (float16: within its round-off)."""
    keras_run, pipe = exact.policy_pair(
        exact.float16_model, exact.scaled_sgd, 2, 2, 2, "gpipe", False, shard_optimizer_states=True
    )
    exact.assert_one_loss_scale(keras_run, pipe)
    assert pipe.stages and not any(all(copy.updates) for row in pipe.stages for copy in row)


def test_owners_balance_whole_variables_by_size():
    assert sharding.owners([100, 10, 60, 50], 2) == [0, 0, 1, 1]  # 100 + 10 | 60 + 50
    assert sharding.owners([4, 4, 4], 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="stage 3 has 1 trainable variable.* for 2 replicas"):
        sharding.owners([8], 2, stage=3)


def test_what_cannot_be_sharded_is_refused_at_build():
    pipe = hybrid.Pipeline(
        [keras.layers.Dense(4), keras.layers.Dense(2)],
        hybrid.DeviceMesh.create(2, 4),
        shard_optimizer_states=True,
    )
    pipe.compile(optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match="stage 0 has 2 trainable variable.* for 4 replicas"):
        pipe.build((None, 3))
    with pytest.raises(ValueError, match="shard_optimizer_states=True: under a strategy"):
        hybrid.Pipeline(
            ref.mlp_layers(),
            hybrid.DeviceMesh.create(1, 1),
            strategy=tf.distribute.OneDeviceStrategy("/cpu:0"),
            shard_optimizer_states=True,
        )


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
