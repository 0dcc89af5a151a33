"""TPU placement: the S × R mesh laid onto the cores of a TPU slice's torus of chips.

A slice is a grid of X × Y × Z chips with ``cores_per_chip`` cores each; a core is named by
``(x, y, z, core)``, the coordinates of ``tf.tpu.experimental.Topology``. Along an axis that
wraps (a torus), the last chip is also linked to the first. The mesh has two kinds of
traffic: the pipeline sends activations from ``(s, r)`` to ``(s+1, r)``, and stage ``s``
all-reduces its gradients around its replica group ``mesh[s, :]``. The placement computes::

    split the slice into factors: every axis of more than one chip (a wrapped axis of 4
      chips also as two halves of 2), and the chip's cores as c_s × c_r
    give each factor to the stages or to the replicas, so that their sizes multiply to S and R
    stage_path  = a snake through the stage factors (the c_s cores of a chip first)
    chip_ring   = a Hamiltonian cycle through the replica chips (a snake if none exists),
                  each chip expanded into its c_r cores
    core(s, r)  = the core at stage_path[s] on the stage factors and chip_ring[r] on the others
    keep the layout that (1) closes every ring, (2) has the fewest chip-to-chip hops around
    the rings, (3) the fewest between stages, (4) comes first

Neighbouring stages are then on the same chip or on neighbouring chips, and each replica
group is a chain of neighbours, closed into a ring when the slice allows it. Example, 4 × 4
chips (z = 1) with wraparound, S = 4, R = 4: stages along x, replica rings around y::

          x=0    x=1    x=2    x=3         (s, r): stage s of replica r
    y=0   (0,0) ─ (1,0) ─ (2,0) ─ (3,0)       ─   pipeline link, stage s -> s+1
            │       │       │       │
    y=1   (0,1) ─ (1,1) ─ (2,1) ─ (3,1)       │   ring link of stage s's replica group;
            │       │       │       │             the y wraparound joins y=3 to y=0
    y=2   (0,2) ─ (1,2) ─ (2,2) ─ (3,2)
            │       │       │       │
    y=3   (0,3) ─ (1,3) ─ (2,3) ─ (3,3)

The search needs no TensorFlow; ``hybrid.platforms.tpu_mesh`` reads the torus from a
``Topology`` and names the cores' devices.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence

from hybrid.platforms.torus import AXES, Coord, Torus, chip_hops, is_positive_int

__all__ = ["Placement", "feasible_meshes", "place"]

# A wrapped axis of 4 chips is also a 2 × 2 square: position (hi, lo) sits at chip
# _HALVES[hi][lo]. Changing lo moves 0-1 or 3-2, changing hi moves 1-2 or 3-0 (wraparound).
_HALVES = ((0, 1), (3, 2))


@dataclasses.dataclass(frozen=True)
class Placement:
    """Cores for every (stage, replica) of an S × R mesh on a torus.

    Attributes:
      torus: the slice.
      cores: ``cores[stage][replica]``, each core used once.
      stage_factors: the factors the stages snake through, e.g. ``("x",)``.
      replica_factors: the factors the replica rings go round, e.g. ``("y", "z")``.
    """

    torus: Torus
    cores: tuple[tuple[Coord, ...], ...]
    stage_factors: tuple[str, ...]
    replica_factors: tuple[str, ...]

    @property
    def num_stages(self) -> int:
        """S: the rows of :attr:`cores`."""
        return len(self.cores)

    @property
    def num_replicas(self) -> int:
        """R: the entries of each row of :attr:`cores`."""
        return len(self.cores[0])

    def core(self, stage: int, replica: int) -> Coord:
        """The core of (``stage``, ``replica``)."""
        return self.cores[stage][replica]

    def replica_group(self, stage: int) -> tuple[Coord, ...]:
        """The cores that all-reduce ``stage``'s gradients, in ring order."""
        return self.cores[stage]

    def pipeline(self, replica: int) -> tuple[Coord, ...]:
        """The cores of ``replica``'s stages 0 .. S-1."""
        return tuple(row[replica] for row in self.cores)

    def stage_hops(self, replica: int) -> tuple[int, ...]:
        """Hops from stage s to s+1 of ``replica``, for s = 0 .. S-2."""
        path = self.pipeline(replica)
        return tuple(self.torus.hops(a, b) for a, b in itertools.pairwise(path))

    def ring_hops(self, stage: int) -> tuple[int, ...]:
        """Hops around ``stage``'s replica group; the last entry is the closing link."""
        return self.torus.ring_hops(self.cores[stage])

    @property
    def rings_closed(self) -> bool:
        """Whether every replica group is a closed ring (always true for R ≤ 2)."""
        return all(self.torus.is_ring(row, closed=True) for row in self.cores)

    def __str__(self) -> str:
        mesh = f"stage:{self.num_stages};replica:{self.num_replicas}"
        stages = (
            "stages along " + "×".join(self.stage_factors) if self.stage_factors else "one stage"
        )
        if not self.replica_factors:
            return f"{mesh} on {self.torus}: {stages}, one replica"
        closed = "closed" if self.rings_closed else "open"
        rings = "×".join(self.replica_factors)
        return f"{mesh} on {self.torus}: {stages}, {closed} replica rings around {rings}"


def place(
    torus: Torus, stages: int, replicas: int, require_closed_rings: bool = False
) -> Placement:
    """Lays the S × R mesh onto every core of ``torus`` (see the module docstring).

    Every core is used exactly once: a mesh smaller than the slice is rejected rather than
    leaving cores idle; for a smaller mesh, describe the part of the slice to use.

    Args:
      torus: the slice.
      stages, replicas: S and R; S × R must equal ``torus.num_cores``.
      require_closed_rings: reject a layout whose replica groups are open chains (R > 2 on a
        slice without the wraparound links to close them) instead of returning it.

    Returns:
      The best layout: stage boundaries ≤ 1 hop, consecutive ring members ≤ 1 hop.

    Raises:
      ValueError: S or R is not a positive integer, S × R is not the number of cores, no
        layout of this kind fits, or (``require_closed_rings``) none closes its rings. The
        message lists the meshes that do fit.
    """
    _check_axis("stages", stages)
    _check_axis("replicas", replicas)
    if stages * replicas != torus.num_cores:
        raise ValueError(
            f"stage:{stages};replica:{replicas} needs {stages * replicas} TPU cores but the "
            f"slice has {torus.num_cores} ({torus}); a TPU mesh uses every core of the slice: "
            f"choose S × R = {torus.num_cores}, e.g. {_fitting(torus, require_closed_rings)}"
        )
    best: Placement | None = None
    best_score: tuple[int, int, int] | None = None
    for candidate, score in _candidates(torus, stages, replicas):
        if best_score is None or score < best_score:
            best, best_score = candidate, score
    if best is None:
        raise ValueError(
            f"stage:{stages};replica:{replicas} cannot be placed on {torus} with neighbouring "
            "stages on neighbouring chips and every replica group a chain of neighbours: stages "
            "and replicas each take whole axes (a wrapped axis of 4 also as two halves, a "
            f"chip's cores in any split). Meshes that fit: {_fitting(torus, False)}"
        )
    if require_closed_rings and not best.rings_closed:
        closing = max(best.ring_hops(s)[-1] for s in range(stages))
        raise ValueError(
            f"stage:{stages};replica:{replicas} on {torus}: the replica groups of {replicas} "
            f"cannot be closed rings (the best layout, {best}, has its last member {closing} "
            "hops from its first); a ring closes along an axis with wraparound, over an even "
            "number of chips on two or more axes, or with two cores per chip. Pass "
            "require_closed_rings=False to accept open chains, or use a mesh whose rings "
            f"close: {_fitting(torus, True)}"
        )
    return best


def feasible_meshes(
    torus: Torus, require_closed_rings: bool = False
) -> tuple[tuple[int, int], ...]:
    """Every (S, R) that ``place`` accepts on ``torus``, S ascending."""
    n = torus.num_cores
    found = []
    for s in range(1, n + 1):
        if n % s:
            continue
        closed = [score[0] == 0 for _, score in _candidates(torus, s, n // s)]
        if closed and (any(closed) or not require_closed_rings):
            found.append((s, n // s))
    return tuple(found)


# -- construction ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Split:
    """One chip axis as factors: the whole axis, or a wrapped 4-chip axis as halves (hi, lo)."""

    axis: int
    names: tuple[str, ...]

    def coordinate(self, position: dict[str, int]) -> int:
        """The chip coordinate along :attr:`axis` at ``position`` (factor name -> index)."""
        if len(self.names) == 1:
            return position[self.names[0]]
        return _HALVES[position[self.names[0]]][position[self.names[1]]]


def _axis_options(torus: Torus) -> list[list[_Split]]:
    """Per chip axis of more than one chip: its splits (whole; halves if wrapped and 4 long)."""
    options = []
    for axis, (name, n) in enumerate(zip(AXES, torus.chips, strict=True)):
        if n == 1:
            continue
        splits = [_Split(axis, (name,))]
        if n == 4 and torus.wrap[axis]:
            splits.append(_Split(axis, (f"{name}.hi", f"{name}.lo")))
        options.append(splits)
    return options


def _split_choices(torus: Torus) -> list[tuple[_Split, ...]]:
    """Every way to split the axes; whole axes first, then halves of x before y before z."""
    choices = list(itertools.product(*_axis_options(torus)))
    halved = [[len(split.names) == 2 for split in choice] for choice in choices]
    order = sorted(range(len(choices)), key=lambda i: (sum(halved[i]), [not h for h in halved[i]]))
    return [choices[i] for i in order]


def _candidates(
    torus: Torus, stages: int, replicas: int
) -> Iterator[tuple[Placement, tuple[int, int, int]]]:
    """Every layout of the construction with S stages and R replicas, checked, in order,
    with its score (see ``_score``)."""
    cores = torus.cores_per_chip
    for c_s in (d for d in range(1, cores + 1) if cores % d == 0):
        c_r = cores // c_s
        if stages % c_s or replicas % c_r:
            continue
        for splits in _split_choices(torus):
            names = [name for split in splits for name in split.names]
            for to_stage in itertools.product((True, False), repeat=len(names)):
                side = dict(zip(names, to_stage, strict=True))
                if any(
                    len(sp.names) == 2 and side[sp.names[0]] == side[sp.names[1]] for sp in splits
                ):
                    continue  # both halves on one side: the whole axis, already tried
                s_names = [n for n, st in zip(names, to_stage, strict=True) if st]
                r_names = [n for n, st in zip(names, to_stage, strict=True) if not st]
                if c_s * math.prod(_size(torus, n) for n in s_names) != stages:
                    continue
                path = _snake([c_s] + [_size(torus, n) for n in s_names])
                chips = _cycle([_size(torus, n) for n in r_names])
                for ring in _expand(chips, c_r):
                    placement = _assemble(torus, splits, s_names, r_names, path, ring, c_r)
                    score = _score(placement)
                    if score is not None:
                        yield placement, score


def _size(torus: Torus, name: str) -> int:
    """Positions along factor ``name``: 2 for a half, else the axis' chips."""
    return 2 if "." in name else torus.chips[AXES.index(name)]


def _assemble(
    torus: Torus,
    splits: Sequence[_Split],
    s_names: Sequence[str],
    r_names: Sequence[str],
    path: Sequence[tuple[int, ...]],
    ring: Sequence[tuple[tuple[int, ...], int]],
    c_r: int,
) -> Placement:
    """The placement whose (s, r) core is ``path[s]`` on the stage factors (and stage cores)
    and ``ring[r]`` on the replica factors (and replica cores)."""
    rows = []
    for step in path:
        row = []
        for chip, core_r in ring:
            position = dict(zip(s_names, step[1:], strict=True)) | dict(
                zip(r_names, chip, strict=True)
            )
            coord = [0, 0, 0, step[0] * c_r + core_r]
            for split in splits:
                coord[split.axis] = split.coordinate(position)
            row.append((coord[0], coord[1], coord[2], coord[3]))
        rows.append(tuple(row))
    c_s = torus.cores_per_chip // c_r
    s_cores = (f"core/{c_s}",) if c_s > 1 else ()
    r_cores = (f"core/{c_r}",) if c_r > 1 else ()
    return Placement(torus, tuple(rows), s_cores + tuple(s_names), tuple(r_names) + r_cores)


def _snake(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every point of the grid ``sizes``, consecutive points one step apart in one factor.

    The first factor varies fastest and turns back at each end (boustrophedon).
    """
    order: list[tuple[int, ...]] = [()]
    for n in sizes:
        order = [(*point, j) for j in range(n) for point in (order if j % 2 == 0 else order[::-1])]
    return order


def _cycle(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """A Hamiltonian cycle of the grid ``sizes`` (a comb), if it has ≥ 2 factors and an even
    number of points; otherwise the snake, which closes only through a wraparound link.

    Comb: the rows (all factors but ``col``) in snake order, each visiting col = 1 .. m-1 one
    way and back the next, then col = 0 of every row in reverse: the spine back to the start.
    """
    total = math.prod(sizes)
    if len(sizes) < 2 or total % 2:
        return _snake(sizes)
    col = next(i for i, m in enumerate(sizes) if (total // m) % 2 == 0)
    m = sizes[col]
    rows = _snake([n for i, n in enumerate(sizes) if i != col])
    order = []
    for i, row in enumerate(rows):
        for j in range(1, m) if i % 2 == 0 else range(m - 1, 0, -1):
            order.append((*row[:col], j, *row[col:]))
    order.extend((*row[:col], 0, *row[col:]) for row in reversed(rows))
    return order


def _expand(
    chips: Sequence[tuple[int, ...]], cores: int
) -> Iterator[list[tuple[tuple[int, ...], int]]]:
    """Ring orders over ``cores`` cores of every chip of the chip order ``chips``.

    Consecutive: a chip's cores one after another (closes iff the chip order closes).
    Out and back: core 0 of every chip, then the other cores of every chip in reverse (closes
    on the first chip, so it closes a chain of chips that has no wraparound).
    """
    yield [(chip, k) for chip in chips for k in range(cores)]
    if cores > 1 and len(chips) > 2:
        out = [(chip, 0) for chip in chips]
        yield out + [(chip, k) for chip in reversed(chips) for k in range(1, cores)]


def _score(p: Placement) -> tuple[int, int, int] | None:
    """None unless every core is used once, every stage boundary is ≤ 1 hop and every ring
    a chain of neighbours; else (0 if all rings close else 1, ring hops, pipeline hops).

    Fewest ring hops before fewest pipeline hops: a stage's gradients, all-reduced once a
    step, are more bytes than its activations (one per micro-batch).
    """
    t = p.torus
    if len({c for row in p.cores for c in row}) != t.num_cores:
        return None
    pipe = 0
    for above, below in itertools.pairwise(p.cores):
        for a, b in zip(above, below, strict=True):
            h = chip_hops(t, a, b)
            if h > 1:
                return None
            pipe += h
    ring, is_open = 0, False
    for row in p.cores:
        hops = [chip_hops(t, a, b) for a, b in zip(row, (*row[1:], row[0]), strict=True)]
        if len(row) > 1 and max(hops[:-1], default=0) > 1:
            return None
        ring += sum(hops) if len(row) > 1 else 0
        is_open = is_open or (len(row) > 1 and hops[-1] > 1)
    return (int(is_open), ring, pipe)


def _fitting(torus: Torus, require_closed_rings: bool) -> str:
    """The meshes ``place`` accepts on ``torus``, as ``stage:S;replica:R`` specs (or "none")."""
    meshes = feasible_meshes(torus, require_closed_rings)
    return ", ".join(f"stage:{s};replica:{r}" for s, r in meshes) or "none"


def _check_axis(name: str, value: int) -> None:
    """Raises ValueError unless ``value`` (the argument ``name``) is a positive integer."""
    if not is_positive_int(value):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
