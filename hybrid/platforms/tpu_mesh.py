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

The pure core (``Torus``, ``place``) needs no TensorFlow; ``layout`` reads task and device
ordinals from a ``Topology`` and builds the ``DeviceAssignment``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hybrid.core.mesh import DeviceMesh

__all__ = [
    "Coord",
    "Placement",
    "Torus",
    "TpuLayout",
    "default_wrap",
    "feasible_meshes",
    "layout",
    "place",
    "tpu_strategy",
]

Coord = tuple[int, int, int, int]
"""A core of the slice: (x, y, z, core on the chip)."""

_AXES = ("x", "y", "z")
# A wrapped axis of 4 chips is also a 2 × 2 square: position (hi, lo) sits at chip
# _HALVES[hi][lo]. Changing lo moves 0-1 or 3-2, changing hi moves 1-2 or 3-0 (wraparound).
_HALVES = ((0, 1), (3, 2))


def default_wrap(chips: Sequence[int]) -> tuple[bool, bool, bool]:
    """Whether each chip axis wraps, when the caller does not say.

    Every axis wraps iff every side of the chip grid is a multiple of 4: v4 and v5p slices of
    4 × 4 × 4 chips and larger are tori. Otherwise no axis wraps: smaller 3-D slices, 2-D
    v5e/v6e slices and v2/v3 slices have no wraparound links. Pass ``wrap`` explicitly for
    anything else (a full v5e pod, a twisted torus).
    """
    torus = all(int(n) % 4 == 0 for n in chips)
    return (torus, torus, torus)


@dataclasses.dataclass(frozen=True)
class Torus:
    """The fabric of a TPU slice: X × Y × Z chips, ``cores_per_chip`` each, per-axis wraparound.

    Attributes:
      chips: (X, Y, Z), chips along each axis.
      cores_per_chip: cores on one chip; cores of one chip are 0 hops apart.
      wrap: for each chip axis, whether its last chip links back to its first.
    """

    chips: tuple[int, int, int]
    cores_per_chip: int = 1
    wrap: tuple[bool, bool, bool] = (False, False, False)

    def __post_init__(self) -> None:
        if len(self.chips) != 3 or not all(_is_positive_int(n) for n in self.chips):
            raise ValueError(f"chips must be 3 positive integers (X, Y, Z), got {self.chips!r}")
        if not _is_positive_int(self.cores_per_chip):
            raise ValueError(
                f"cores_per_chip must be a positive integer, got {self.cores_per_chip!r}"
            )
        if len(self.wrap) != 3 or not all(isinstance(w, bool) for w in self.wrap):
            raise ValueError(f"wrap must be 3 booleans (x, y, z), got {self.wrap!r}")

    @classmethod
    def from_mesh_shape(
        cls, mesh_shape: Sequence[int], wrap: bool | Sequence[bool] | None = None
    ) -> Torus:
        """The torus of a Topology's ``mesh_shape`` (X, Y, Z, cores per chip).

        Args:
          mesh_shape: 4 positive integers.
          wrap: one flag for all axes, one per axis (x, y, z), or None for ``default_wrap``.
        """
        if len(mesh_shape) != 4:
            raise ValueError(
                f"a TPU mesh_shape has 4 entries (X, Y, Z, cores per chip), got {list(mesh_shape)}"
            )
        shape = [int(n) for n in mesh_shape]
        chips = (shape[0], shape[1], shape[2])
        if wrap is None:
            wraps = default_wrap(chips)
        elif isinstance(wrap, (bool, np.bool_)):
            wraps = (bool(wrap),) * 3
        else:
            flags = list(wrap)
            if len(flags) != 3 or not all(isinstance(w, (bool, np.bool_)) for w in flags):
                raise ValueError(f"wrap must be a bool or 3 bools (x, y, z), got {wrap!r}")
            wraps = (bool(flags[0]), bool(flags[1]), bool(flags[2]))
        return cls(chips, shape[3], wraps)

    @property
    def num_cores(self) -> int:
        return math.prod(self.chips) * self.cores_per_chip

    def cores(self) -> tuple[Coord, ...]:
        """Every core of the slice, in (x, y, z, core) order."""
        X, Y, Z = self.chips
        ranges = (range(X), range(Y), range(Z), range(self.cores_per_chip))
        return tuple((x, y, z, c) for x, y, z, c in itertools.product(*ranges))

    def hops(self, a: Coord, b: Coord) -> int:
        """Chip-to-chip links on a shortest route from core ``a`` to core ``b`` (0: same chip).

        Per axis ``|a - b|``, or ``min(|a - b|, n - |a - b|)`` along an axis that wraps.
        """
        self._check(a)
        self._check(b)
        return _hops(self, a, b)

    def ring_hops(self, members: Sequence[Coord]) -> tuple[int, ...]:
        """Hops between consecutive members, then from the last back to the first.

        ``()`` for fewer than two members.
        """
        if len(members) < 2:
            return ()
        return tuple(
            self.hops(a, b) for a, b in zip(members, [*members[1:], members[0]], strict=True)
        )

    def is_ring(self, members: Sequence[Coord], closed: bool = True) -> bool:
        """Whether consecutive members are neighbours (≤ 1 hop), and, if ``closed``, the last
        and the first too."""
        hops = self.ring_hops(members)
        if not hops:
            return True
        return all(h <= 1 for h in hops[:-1]) and (not closed or hops[-1] <= 1)

    def __str__(self) -> str:
        X, Y, Z = self.chips
        wraps = "".join(a for a, w in zip(_AXES, self.wrap, strict=True) if w) or "none"
        return f"{X}×{Y}×{Z} chips × {self.cores_per_chip} cores (wraparound: {wraps})"

    def _check(self, coord: Coord) -> None:
        bounds = (*self.chips, self.cores_per_chip)
        if len(coord) != 4 or not all(0 <= c < n for c, n in zip(coord, bounds, strict=True)):
            raise ValueError(f"core {tuple(coord)} is outside the slice {self}")


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
        return len(self.cores)

    @property
    def num_replicas(self) -> int:
        return len(self.cores[0])

    def core(self, stage: int, replica: int) -> Coord:
        return self.cores[stage][replica]

    def replica_group(self, stage: int) -> tuple[Coord, ...]:
        """The cores that all-reduce ``stage``'s gradients, in ring order."""
        return self.cores[stage]

    def pipeline(self, replica: int) -> tuple[Coord, ...]:
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


# -- TensorFlow: device names, DeviceAssignment, TPUStrategy ---------------------------------


@dataclasses.dataclass(frozen=True)
class TpuLayout:
    """A placement on a ``tf.tpu.experimental.Topology``: cores and TensorFlow device names.

    Attributes:
      placement: the core of every (stage, replica).
      devices: ``devices[stage][replica]``, ``/job:{job}/replica:0/task:{task}/device:TPU:{n}``
        with ``task`` and ``n`` read from the topology at that core
        (``task_ordinal_at_coordinates``, ``tpu_device_ordinal_at_coordinates``).
      topology: the Topology the placement was made on.
    """

    placement: Placement
    devices: tuple[tuple[str, ...], ...]
    topology: Any = dataclasses.field(compare=False, repr=False)

    @property
    def mesh(self) -> DeviceMesh:
        """The placement as a DeviceMesh of TPU device names (what ``Pipeline`` takes)."""
        return DeviceMesh(self.devices)

    def core_assignment(self) -> np.ndarray:
        """``[R, S, 4]`` int32 array: entry ``[r, s]`` is the core of (stage s, replica r)."""
        p = self.placement
        cores = [[p.core(s, r) for s in range(p.num_stages)] for r in range(p.num_replicas)]
        return np.array(cores, dtype=np.int32)

    def device_assignment(self) -> Any:
        """The mesh as a ``tf.tpu.experimental.DeviceAssignment``.

        Computes ``DeviceAssignment(topology, core_assignment())``: replica r of the
        computation is the pipeline ``mesh[:, r]`` and its logical core s is stage s, so
        ``num_replicas`` = R and ``num_cores_per_replica`` = S. (``DeviceAssignment.build``
        is not used: it chooses cores by its own rule.) Under
        ``TPUStrategy(resolver, experimental_device_assignment=...)``:

        * ``num_replicas_in_sync`` is R; ``strategy.run(step)`` compiles ``step`` once for
          the TPU and runs copy r on the S cores of pipeline r;
        * ops run on logical core 0 (stage 0) unless annotated:
          ``strategy.experimental_assign_to_logical_device(t, s)`` puts ``t`` on stage s;
        * variables created under ``strategy.extended.experimental_logical_device(s)`` get
          one copy per replica, on ``mesh[s, :]``: stage s's replica group;
        * a cross-replica ``all_reduce`` of a value on logical core s reduces over the R
          copies of logical core s, i.e. over ``mesh[s, :]``;
        * the distributed dataset is loaded onto logical core 0 (stage 0) of every replica.
        """
        import tensorflow as tf

        return tf.tpu.experimental.DeviceAssignment(self.topology, self.core_assignment())


def layout(
    resolver_or_topology: Any,
    stages: int,
    replicas: int = 1,
    *,
    wrap: bool | Sequence[bool] | None = None,
    job: str | None = None,
    require_closed_rings: bool = False,
) -> TpuLayout:
    """``place`` on a TPU slice, with the TensorFlow device name of every core.

    Args:
      resolver_or_topology: a ``tf.tpu.experimental.Topology``, or a ``TPUClusterResolver``:
        then ``tf.tpu.experimental.initialize_tpu_system(resolver)`` runs here (it resets the
        TPU system; connect first with ``tf.config.experimental_connect_to_cluster`` where
        the TPU is remote, and pass the Topology instead if the system is already up).
      stages, replicas: S and R, with S × R = every core of the slice.
      wrap: wraparound per chip axis (see ``Torus.from_mesh_shape``); None: ``default_wrap``.
      job: the job in the device names; None: the job of the TPU devices after
        initialising from a resolver, or ``"worker"`` for a Topology (``"localhost"`` on a
        TPU VM that is not connected to a cluster).
      require_closed_rings: see ``place``.

    Raises:
      TypeError: ``resolver_or_topology`` is neither.
      ValueError: the topology misses cores, or ``place`` rejects the mesh.
    """
    topology, found_job = _topology_of(resolver_or_topology)
    if job is not None and (not isinstance(job, str) or not job):
        raise ValueError(f"job must be a non-empty string or None, got {job!r}")
    job = job or found_job
    placement = place(_torus_of(topology, wrap), stages, replicas, require_closed_rings)
    devices = tuple(tuple(_device_name(topology, c, job) for c in row) for row in placement.cores)
    return TpuLayout(placement, devices, topology)


def tpu_strategy(resolver: Any, tpu_layout: TpuLayout) -> Any:
    """``tf.distribute.TPUStrategy(resolver, experimental_device_assignment=...)`` for the
    layout (see ``TpuLayout.device_assignment`` for what the strategy then does).

    Needs a TPU; not exercised by the tests.
    """
    import tensorflow as tf

    return tf.distribute.TPUStrategy(
        resolver, experimental_device_assignment=tpu_layout.device_assignment()
    )


def _topology_of(resolver_or_topology: Any) -> tuple[Any, str]:
    import tensorflow as tf

    if isinstance(resolver_or_topology, tf.tpu.experimental.Topology):
        return resolver_or_topology, "worker"
    if isinstance(resolver_or_topology, tf.distribute.cluster_resolver.TPUClusterResolver):
        topology = tf.tpu.experimental.initialize_tpu_system(resolver_or_topology)
        tpus = tf.config.list_logical_devices("TPU")
        job = tf.DeviceSpec.from_string(tpus[0].name).job if tpus else None
        return topology, job or "worker"
    raise TypeError(
        "expected a tf.tpu.experimental.Topology or a "
        f"tf.distribute.cluster_resolver.TPUClusterResolver, got {type(resolver_or_topology)}"
    )


def _torus_of(topology: Any, wrap: bool | Sequence[bool] | None) -> Torus:
    torus = Torus.from_mesh_shape(list(topology.mesh_shape), wrap)
    listed = [
        (int(a), int(b), int(c), int(d))
        for a, b, c, d in np.asarray(topology.device_coordinates).reshape(-1, 4)
    ]
    twice = sorted(c for c, n in collections.Counter(listed).items() if n > 1)
    if twice:
        raise ValueError(f"the topology lists the cores {twice} more than once ({torus})")
    missing = sorted(set(torus.cores()) - set(listed))
    if missing:
        raise ValueError(
            f"the topology of {torus} lacks {len(missing)} of its {torus.num_cores} cores "
            f"(first: {missing[:4]}); a TPU mesh needs a complete slice"
        )
    return torus


def _device_name(topology: Any, core: Coord, job: str) -> str:
    task = int(topology.task_ordinal_at_coordinates(core))
    ordinal = int(topology.tpu_device_ordinal_at_coordinates(core))
    return f"/job:{job}/replica:0/task:{task}/device:TPU:{ordinal}"


# -- construction ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Split:
    """One chip axis as factors: the whole axis, or a wrapped 4-chip axis as halves (hi, lo)."""

    axis: int
    names: tuple[str, ...]

    def coordinate(self, position: dict[str, int]) -> int:
        if len(self.names) == 1:
            return position[self.names[0]]
        return _HALVES[position[self.names[0]]][position[self.names[1]]]


def _axis_options(torus: Torus) -> list[list[_Split]]:
    options = []
    for axis, (name, n) in enumerate(zip(_AXES, torus.chips, strict=True)):
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
    return 2 if "." in name else torus.chips[_AXES.index(name)]


def _assemble(
    torus: Torus,
    splits: Sequence[_Split],
    s_names: Sequence[str],
    r_names: Sequence[str],
    path: Sequence[tuple[int, ...]],
    ring: Sequence[tuple[tuple[int, ...], int]],
    c_r: int,
) -> Placement:
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
            h = _hops(t, a, b)
            if h > 1:
                return None
            pipe += h
    ring, is_open = 0, False
    for row in p.cores:
        hops = [_hops(t, a, b) for a, b in zip(row, (*row[1:], row[0]), strict=True)]
        if len(row) > 1 and max(hops[:-1], default=0) > 1:
            return None
        ring += sum(hops) if len(row) > 1 else 0
        is_open = is_open or (len(row) > 1 and hops[-1] > 1)
    return (int(is_open), ring, pipe)


def _hops(t: Torus, a: Coord, b: Coord) -> int:
    total = 0
    for axis in range(3):
        d = abs(a[axis] - b[axis])
        total += min(d, t.chips[axis] - d) if t.wrap[axis] else d
    return total


def _fitting(torus: Torus, require_closed_rings: bool) -> str:
    meshes = feasible_meshes(torus, require_closed_rings)
    return ", ".join(f"stage:{s};replica:{r}" for s, r in meshes) or "none"


def _is_positive_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value > 0)


def _check_axis(name: str, value: int) -> None:
    if not _is_positive_int(value):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
