"""Covering grids: every pair of values of any two dimensions in some cell (all-pairs).

A full product of meshes × micro-batches × remat modes × optimizers × schedules grows as
the product of the sizes; an all-pairs grid as the product of the two largest. Exactness
bugs come from one setting or the interplay of two (a remat mode on one mesh, a schedule at
one micro-batch count), and every such pair is run. ``HYBRID_TEST_FULL=1`` runs the full
product instead.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

FULL = os.environ.get("HYBRID_TEST_FULL") == "1"


def pairs(cell: Sequence[Any]) -> set[tuple[int, Any, int, Any]]:
    """(i, value i, j, value j) for every two dimensions i < j of ``cell``."""
    return {(i, cell[i], j, cell[j]) for i, j in itertools.combinations(range(len(cell)), 2)}


def all_pairs(*dimensions: Sequence[Any]) -> list[tuple[Any, ...]]:
    """Cells of the product of ``dimensions`` that together cover every pair of values.

    Greedy and deterministic: repeatedly takes the cell of the product (in product order)
    that covers the most pairs not yet covered. With ``HYBRID_TEST_FULL=1``: the product.
    """
    product = list(itertools.product(*dimensions))
    if FULL or len(dimensions) < 2:
        return product
    missing = set().union(*(pairs(cell) for cell in product))
    chosen = []
    while missing:
        best = max(product, key=lambda cell: len(pairs(cell) & missing))
        chosen.append(best)
        missing -= pairs(best)
    return chosen
