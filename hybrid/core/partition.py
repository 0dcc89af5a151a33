"""Balancing: cut a sequence of layer costs into S contiguous stages.

The stage that costs most sets the pace of the whole pipeline, so the best balance is the
contiguous partition that minimises the most expensive stage. :func:`balance_by_cost`
solves it exactly by dynamic programming; no TensorFlow here (per-layer costs come from
``profile.py`` or from parameter counts).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balance_by_cost", "check_balance", "stage_costs"]


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Validates an explicit balance (layer count per stage) and returns it as a tuple.

    Raises:
      ValueError: wrong length, a stage with no layers, or counts that do not sum to the
        number of layers; the message says how to fix it.
    """
    balance = tuple(int(b) for b in balance)
    if len(balance) != num_stages:
        raise ValueError(
            f"balance {list(balance)} has {len(balance)} entries but the mesh has "
            f"{num_stages} stages; give one layer count per stage"
        )
    if any(b < 1 for b in balance):
        raise ValueError(
            f"balance {list(balance)} gives a stage no layers; every stage needs at least one"
        )
    if sum(balance) != num_layers:
        raise ValueError(
            f"balance {list(balance)} sums to {sum(balance)} but the model has {num_layers} "
            f"layers; the counts must add up to {num_layers}"
        )
    return balance


def _check_sizes(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot cut {num_layers} layers into {num_stages} stages: each stage needs at "
            f"least one layer; use at most {num_layers} stages or a model with more layers"
        )


def balance_by_cost(costs: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """The contiguous partition of ``costs`` into ``num_stages`` non-empty stages whose most
    expensive stage is as cheap as possible.

    Conceptually::

        best(i, k) = min over j < i of max(best(j, k-1), sum(costs[j:i]))

    Among optimal partitions it returns the one whose earlier stages are as long as possible
    (a deterministic tie-break). O(S · n²) for n layers.

    Returns:
      Layer counts per stage, summing to ``len(costs)``.
    """
    n = len(costs)
    _check_sizes(n, num_stages)
    if any(c < 0 for c in costs):
        raise ValueError(f"layer costs must be non-negative, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the minimal max-stage cost of the first i layers cut into k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value <= best[k][i]:  # '<=' prefers the latest cut: longer earlier stages
                    best[k][i], cut[k][i] = value, j
    counts = []
    i = n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        counts.append(i - j)
        i = j
    return tuple(reversed(counts))


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> tuple[float, ...]:
    """The summed cost of each stage under ``balance``."""
    out, start = [], 0
    for count in balance:
        out.append(float(sum(costs[start : start + count])))
        start += count
    return tuple(out)
