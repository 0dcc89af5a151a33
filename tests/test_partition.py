"""Balancing against brute force, and validation of explicit balances."""

import itertools
import random
import sys

import pytest

from hybrid.core import partition

import runner


def brute_force(costs, stages):
    """The minimal max-stage cost over every contiguous partition."""
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    costs = [rng.choice([0, 1, 2, 3, 5, 8, 13, 0.5]) for _ in range(n)]
    balance = partition.balance_by_cost(costs, stages)
    assert len(balance) == stages and sum(balance) == n and min(balance) >= 1
    assert max(partition.stage_costs(costs, balance)) == brute_force(costs, stages)


def test_known_partitions():
    assert partition.balance_by_cost([1, 1, 1, 1], 2) == (2, 2)
    assert partition.balance_by_cost([4, 1, 1, 1, 1], 2) == (1, 4)
    assert partition.balance_by_cost([1, 2, 3, 4, 5, 6, 7, 8, 9], 3) == (5, 2, 2)
    assert partition.balance_by_cost([0, 0, 5, 0], 4) == (1, 1, 1, 1)


def test_stage_costs():
    assert partition.stage_costs([1, 2, 3, 4], (1, 3)) == (1.0, 9.0)


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="cannot cut 3 layers into 4 stages"):
        partition.balance_by_cost([1, 1, 1], 4)


def test_negative_costs():
    with pytest.raises(ValueError, match="non-negative"):
        partition.balance_by_cost([1, -1], 1)


@pytest.mark.parametrize(
    "balance,match",
    [
        ((2, 2), "sums to 4 but the model has 5 layers"),
        ((5,), "has 1 entries but the mesh has 2 stages"),
        ((5, 0), "gives a stage no layers"),
    ],
)
def test_check_balance(balance, match):
    with pytest.raises(ValueError, match=match):
        partition.check_balance(balance, num_layers=5, num_stages=2)
    assert partition.check_balance([3, 2], 5, 2) == (3, 2)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
