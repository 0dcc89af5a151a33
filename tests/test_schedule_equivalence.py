"""Every schedule trains exactly like one device: schedules × remat × meshes × micro-batches.

Meshes 2×1, 4×1, 2×2, 4×2 with M ∈ {4, 8} and every remat mode, for 1F1B, interleaved
(v = 2) and ZB-H1; GPipe's cells not already in ``test_equivalence.py`` (the 4×1 mesh) are
added here. Same reference and tolerance as the foundation grid: 3 Adam steps, losses and
every weight to 1e-5 relative, replicas bit-identical. Gradients are compared directly in
``test_equivalence.py`` and for one cell of each schedule here.

XLA compilation dominates the cost of a cell and is exercised for every mesh, micro-batch
count and remat mode by ``test_equivalence.py``; here the stage programs run as plain
TensorFlow graphs, except the 2×2, M = 4 cell of every schedule × remat mode, which runs
under XLA as well (the whole grid under XLA passes too: set HYBRID_TEST_XLA=1, ~3.5 min).
"""

import itertools
import os
import sys

import pytest

from hybrid.core import schedule as sched

import runner
from test_equivalence import REMATS, _run

MESHES = [(2, 1), (4, 1), (2, 2), (4, 2)]
MICRO_BATCHES = [4, 8]

ALL_XLA = os.environ.get("HYBRID_TEST_XLA") == "1"
CELLS = [
    (name, s, r, m, remat)
    for name, (s, r), m, remat in itertools.product(sched.names(), MESHES, MICRO_BATCHES, REMATS)
    if name != "gpipe" or (s, r) == (4, 1)
]
XLA_CELLS = [
    (name, 2, 2, 4, remat) for name in sched.names() if name != "gpipe" for remat in REMATS
]


def _param(cell, jit):
    name, s, r, m, remat = cell
    return pytest.param(*cell, jit, id=f"{name}-{s}x{r}-M{m}-{remat}-{'xla' if jit else 'graph'}")


GRID = [_param(cell, ALL_XLA) for cell in CELLS]
if not ALL_XLA:
    GRID += [_param(cell, True) for cell in XLA_CELLS]


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
