"""Pipelined × data-parallel training equals single-device training on the whole batch.

Over meshes × micro-batch counts × remat modes × optimizers (SGD with momentum, Adam), every
pair of values of any two of them is run (an all-pairs grid, ``covering.py``: 24 runs of the
144; ``HYBRID_TEST_FULL=1`` runs all): the same layers with the same initial weights, the
gradients of one batch, then 3 training steps. Losses, gradients and every weight must match
the reference to 1e-5 relative, and all replica copies of a stage must be bit-identical. The
reference's run is the same for every cell: each test process trains it once per optimizer.
"""

import dataclasses
import functools
import itertools
import sys

import numpy as np
import pytest

import covering
import reference as ref
import runner

MESHES = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2), (2, 4)]
MICRO_BATCHES = [1, 2, 4, 8]
REMATS = ["never", "except_last", "always"]
STEPS = 3
BATCH = 64  # divisible by every replicas × micro_batches in the grid


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """What the single-device reference computes from the same initial weights: the
    gradients of batch 0, the loss of each of :data:`STEPS` training steps on batches
    1..STEPS, and the weights after them."""

    initial: list[np.ndarray]
    gradients: list[np.ndarray]
    losses: list[float]
    final: list[np.ndarray]


@functools.cache
def trajectory(optimizer: str) -> Trajectory:
    """The reference's run with ``optimizer``: the same for every cell of the grid (same
    layers, weights and batches), so each test process trains it once per optimizer."""
    reference = ref.Reference(ref.mlp_layers(), ref.OPTIMIZERS[optimizer]())
    initial = reference.model.get_weights()
    gradients = reference.gradients(*ref.batch(BATCH, seed=0))
    losses = [reference.train_step(*ref.batch(BATCH, seed=step + 1)) for step in range(STEPS)]
    return Trajectory(initial, gradients, losses, reference.model.get_weights())


def _run(
    stages, replicas, micro_batches, remat, optimizer, schedule="gpipe", check_grads=True, jit=True
):
    want = trajectory(optimizer)
    pipe = ref.pipeline(
        stages,
        replicas,
        layers=ref.mlp_layers(seed=99),  # other initial weights: set_weights must overwrite them
        optimizer=optimizer,
        micro_batches=micro_batches,
        schedule=schedule,
        remat=remat,
        jit_compile=jit,
        weights=want.initial,
    )
    if check_grads:
        x0, y0 = ref.batch(BATCH, seed=0)
        ref.assert_weights_close(pipe.gradients(x0, y0), want.gradients)
    for step in range(STEPS):
        x, y = ref.batch(BATCH, seed=step + 1)
        got = pipe.train_step(x, y)["loss"]
        np.testing.assert_allclose(
            got, want.losses[step], rtol=1e-5, err_msg=f"loss of step {step}"
        )
    ref.assert_weights_close(pipe.get_weights(), want.final)
    for r in range(1, replicas):
        for a, b in zip(pipe.replica_weights(r), pipe.replica_weights(0), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"replica {r} diverged from replica 0")
    return pipe


OPTIMIZER_NAMES = sorted(ref.OPTIMIZERS)
# Stage programs compiled with XLA or run as TensorFlow graphs: every other dimension's values
# are covered with both (compiling is most of a cold test run's time).
JIT = [False, True]
DIMENSIONS = [MESHES, MICRO_BATCHES, REMATS, OPTIMIZER_NAMES, JIT]
CELLS = covering.all_pairs(*DIMENSIONS)
GRID = [
    pytest.param(
        s, r, m, remat, opt, jit, id=f"{s}x{r}-M{m}-{remat}-{opt}-{'xla' if jit else 'graph'}"
    )
    for (s, r), m, remat, opt, jit in CELLS
]


def test_the_grid_covers_every_pair():
    covered = set().union(*(covering.pairs(cell) for cell in CELLS))
    for i, j in itertools.combinations(range(len(DIMENSIONS)), 2):
        for x, y in itertools.product(DIMENSIONS[i], DIMENSIONS[j]):
            assert (i, x, j, y) in covered, (x, y)
    assert len(CELLS) < len(list(itertools.product(*DIMENSIONS))) or covering.FULL


@pytest.mark.parametrize("stages,replicas,micro_batches,remat,optimizer,jit", GRID)
def test_matches_single_device(stages, replicas, micro_batches, remat, optimizer, jit):
    pipe = _run(stages, replicas, micro_batches, remat, optimizer, jit=jit)
    assert len(pipe.balance) == stages and sum(pipe.balance) == len(ref.mlp_layers())


def test_reference_comparison_can_fail():
    """A pipeline that trained on other data must not pass the comparison."""
    reference = ref.Reference(ref.mlp_layers(), ref.OPTIMIZERS["adam"]())
    pipe = ref.pipeline(2, 1, optimizer="adam", weights=reference.model.get_weights())
    x, y = ref.batch(BATCH, seed=1)
    reference.train_step(x, y)
    pipe.train_step(x, (y + 1) % ref.CLASSES)
    with pytest.raises(AssertionError):
        ref.assert_weights_close(pipe.get_weights(), reference.model.get_weights())


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
