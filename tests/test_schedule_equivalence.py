"""Every schedule trains exactly like one device: schedules × meshes × micro-batches × remat
modes × XLA or plain graphs.

Meshes 2×1, 4×1, 2×2, 4×2, M ∈ {4, 8}, every remat mode, stage programs under XLA or as plain
TensorFlow graphs: every pair of values of any two of these dimensions is run (an all-pairs
grid, ``covering.py``; ``HYBRID_TEST_FULL=1`` runs the whole product). Same reference and
tolerance as ``test_equivalence.py``: 3 Adam steps, losses and every weight to 1e-5 relative,
replicas bit-identical. Gradients are compared directly for one cell of each schedule.
"""

import sys

import pytest

from hybrid.core import schedule as sched

import covering
import runner
from test_equivalence import REMATS, _run

MESHES = [(2, 1), (4, 1), (2, 2), (4, 2)]
MICRO_BATCHES = [4, 8]
GRID = [
    pytest.param(
        name, s, r, m, remat, jit, id=f"{name}-{s}x{r}-M{m}-{remat}-{'xla' if jit else 'graph'}"
    )
    for name, (s, r), m, remat, jit in covering.all_pairs(
        sched.names(), MESHES, MICRO_BATCHES, REMATS, [False, True]
    )
]


@pytest.mark.parametrize("schedule,stages,replicas,micro_batches,remat,jit", GRID)
def test_schedule_matches_single_device(schedule, stages, replicas, micro_batches, remat, jit):
    pipe = _run(
        stages,
        replicas,
        micro_batches,
        remat,
        "adam",
        schedule=schedule,
        check_grads=False,
        jit=jit,
    )
    assert pipe.schedule.name == schedule and pipe.jit_compile == jit


@pytest.mark.parametrize("schedule", [n for n in sched.names() if n != "gpipe"])
def test_schedule_gradients_match(schedule):
    _run(2, 2, 4, "except_last", "sgd_momentum", schedule=schedule, check_grads=True)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
