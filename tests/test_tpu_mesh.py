"""TPU placement on hand-built topologies: every core once, stage neighbours adjacent, rings.

Hop distances are checked against a breadth-first search over the chip graph (links between
chips one apart along an axis, plus the wraparound links), not against the library's formula.
"""

import collections
import functools
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import hybrid
from hybrid.platforms import torus_placement, tpu_mesh
from hybrid.platforms.tpu_mesh import Torus

import runner

# -- references ----------------------------------------------------------------------------------


def build_topology(chips, cores, host=(2, 2, 1), drop=(), repeat=()):
    """A Topology whose hosts (tasks) each own a block of ``host`` chips.

    A task lists its devices core-major (all chips' core 0, then core 1, ...), chips x-fastest,
    so the device ordinal is not the core's index in (x, y, z, core) order. ``drop`` leaves
    cores out and ``repeat`` lists cores twice (in place of the next core).

    Returns:
      The Topology and {core: (task, ordinal)}.
    """
    X, Y, Z = chips
    hx, hy, hz = (min(h, n) for h, n in zip(host, chips, strict=True))
    tasks, expected = [], {}
    for bz, by, bx in itertools.product(range(0, Z, hz), range(0, Y, hy), range(0, X, hx)):
        devices = []
        for c, z, y, x in itertools.product(
            range(cores), range(bz, bz + hz), range(by, by + hy), range(bx, bx + hx)
        ):
            core = (x, y, z, c)
            if core in drop:
                continue
            expected[core] = (len(tasks), len(devices))
            devices.append(list(repeat[0]) if core in repeat[1:] else list(core))
        tasks.append(devices)
    topology = tf.tpu.experimental.Topology(
        mesh_shape=[X, Y, Z, cores], device_coordinates=np.array(tasks, dtype=np.int32)
    )
    return topology, expected


@functools.cache
def chip_distances(chips, wrap):
    """{(chip_a, chip_b): links on a shortest route}, by breadth-first search."""
    points = list(itertools.product(*(range(n) for n in chips)))

    def neighbours(p):
        for axis, n in enumerate(chips):
            for step in (-1, 1):
                q = p[axis] + step
                if wrap[axis]:
                    q %= n
                if 0 <= q < n and q != p[axis]:
                    yield p[:axis] + (q,) + p[axis + 1 :]

    dist = {}
    for source in points:
        seen, queue = {source: 0}, collections.deque([source])
        while queue:
            p = queue.popleft()
            for q in neighbours(p):
                if q not in seen:
                    seen[q] = seen[p] + 1
                    queue.append(q)
        dist.update(((source, q), d) for q, d in seen.items())
    return dist


def hops(torus, a, b):
    return chip_distances(torus.chips, torus.wrap)[(a[:3], b[:3])]


def check_placement(p, stages, replicas, closed):
    """Every core once; stage s -> s+1 at most one link; every replica group a chain of
    neighbours, whose last member is next to its first iff ``closed``."""
    t = p.torus
    assert (p.num_stages, p.num_replicas) == (stages, replicas)
    flat = [c for row in p.cores for c in row]
    assert sorted(flat) == sorted(t.cores()) and len(flat) == t.num_cores
    for r in range(replicas):
        path = p.pipeline(r)
        assert [hops(t, a, b) for a, b in itertools.pairwise(path)] == list(p.stage_hops(r))
        assert all(h <= 1 for h in p.stage_hops(r)), (r, p.stage_hops(r))
    for s in range(stages):
        ring = p.replica_group(s)
        if replicas == 1:
            continue
        links = [hops(t, a, b) for a, b in zip(ring, (*ring[1:], ring[0]), strict=True)]
        assert links == list(p.ring_hops(s))
        assert all(h <= 1 for h in links[:-1]), (s, links)
        assert (links[-1] <= 1) == closed, (s, links)
    assert p.rings_closed == closed


# -- the torus ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "chips,wrap",
    [
        ((4, 4, 4), (True, True, True)),
        ((8, 8, 1), (False, False, False)),
        ((3, 1, 1), (True, False, False)),
        ((4, 2, 3), (True, False, True)),
    ],
)
def test_hops_equal_shortest_routes(chips, wrap):
    t = Torus(chips, 2, wrap)
    dist = chip_distances(chips, wrap)
    for a, b in itertools.product(t.cores(), repeat=2):
        assert t.hops(a, b) == dist[(a[:3], b[:3])]


def test_hops_examples_and_rings():
    cube = Torus((4, 4, 4), 2, (True, True, True))
    assert cube.hops((0, 0, 0, 0), (3, 3, 3, 1)) == 3
    assert cube.hops((1, 2, 3, 0), (1, 2, 3, 1)) == 0  # cores of one chip
    flat = Torus((8, 8, 1))
    assert flat.hops((0, 0, 0, 0), (7, 7, 0, 0)) == 14
    line = [(x, 0, 0, 0) for x in range(8)]
    assert flat.ring_hops(line) == (1, 1, 1, 1, 1, 1, 1, 7)
    assert flat.is_ring(line, closed=False) and not flat.is_ring(line)
    assert Torus((8, 8, 1), 1, (True, False, False)).is_ring(line)
    assert not flat.is_ring([(0, 0, 0, 0), (2, 0, 0, 0), (1, 0, 0, 0)], closed=False)
    assert flat.ring_hops([(0, 0, 0, 0)]) == () and flat.is_ring([(0, 0, 0, 0)])
    with pytest.raises(ValueError, match=r"core \(8, 0, 0, 0\) is outside the slice 8×8×1"):
        flat.hops((8, 0, 0, 0), (0, 0, 0, 0))


@pytest.mark.parametrize(
    "chips,wraps",
    [
        ((4, 4, 4), True),
        ((4, 4, 8), True),
        ((16, 16, 16), True),
        ((2, 4, 4), False),
        ((2, 2, 2), False),
        ((8, 8, 1), False),
        ((16, 16, 1), False),
    ],
)
def test_default_wrap(chips, wraps):
    assert tpu_mesh.default_wrap(chips) == (wraps,) * 3
    assert Torus.from_mesh_shape([*chips, 1]).wrap == (wraps,) * 3


def test_torus_from_mesh_shape():
    t = Torus.from_mesh_shape(np.array([2, 2, 1, 2], dtype=np.int32))
    assert t == Torus((2, 2, 1), 2, (False, False, False)) and t.num_cores == 8
    assert Torus.from_mesh_shape([4, 4, 1, 1], wrap=True).wrap == (True, True, True)
    assert Torus.from_mesh_shape([4, 4, 1, 1], wrap=(True, False, False)).wrap[:2] == (True, False)


@pytest.mark.parametrize(
    "mesh_shape,wrap,match",
    [
        ([2, 2, 2], None, r"4 entries \(X, Y, Z, cores per chip\), got \[2, 2, 2\]"),
        ([2, 0, 1, 1], None, r"chips must be 3 positive integers .* got \(2, 0, 1\)"),
        ([2, 2, 1, 0], None, "cores_per_chip must be a positive integer, got 0"),
        ([2, 2, 1, 1], (True, False), r"wrap must be a bool or 3 bools"),
        ([2, 2, 1, 1], (1, 0, 0), r"wrap must be a bool or 3 bools"),
    ],
)
def test_bad_mesh_shapes(mesh_shape, wrap, match):
    with pytest.raises(ValueError, match=match):
        Torus.from_mesh_shape(mesh_shape, wrap)


@pytest.mark.parametrize("sizes", [(2,), (5,), (2, 2), (4, 2), (3, 4), (2, 3, 3), (2, 2, 2, 2)])
def test_cycle_is_hamiltonian(sizes):
    order = torus_placement._cycle(sizes)
    assert sorted(order) == sorted(itertools.product(*(range(n) for n in sizes)))
    steps = list(zip(order, (*order[1:], order[0]), strict=True))
    gaps = [sum(abs(p - q) for p, q in zip(a, b, strict=True)) for a, b in steps]
    assert all(g == 1 for g in gaps[:-1])
    # A cycle needs ≥ 2 factors and an even count (or ≤ 2 points); else the snake stays open.
    assert (gaps[-1] == 1) == (len(order) <= 2 or (len(sizes) > 1 and len(order) % 2 == 0))


def test_torus_math_imports_no_tensorflow():
    # The placement search is plain Python: a fresh process imports it without TensorFlow.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "import sys, hybrid.platforms.torus, hybrid.platforms.torus_placement; "
        "assert 'tensorflow' not in sys.modules, sorted(m for m in sys.modules if 'tensor' in m)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert tpu_mesh.place is torus_placement.place and tpu_mesh.Torus is Torus


# -- placements on hand-built topologies --------------------------------------------------------

SLICES = {
    "2x2x1 2 cores": ((2, 2, 1), 2),  # v2/v3-8 style, no wraparound
    "2x2x2": ((2, 2, 2), 1),  # small 3-D slice, no wraparound
    "4x4x4": ((4, 4, 4), 1),  # v4 style cube: every axis wraps
    "8x8": ((8, 8, 1), 1),  # v5e style 2-D slice: no wraparound
}

CASES = [
    ("2x2x1 2 cores", 1, 8, True),
    ("2x2x1 2 cores", 2, 4, True),
    ("2x2x1 2 cores", 4, 2, True),
    ("2x2x1 2 cores", 8, 1, True),
    ("2x2x2", 1, 8, True),
    ("2x2x2", 2, 4, True),
    ("2x2x2", 4, 2, True),
    ("2x2x2", 8, 1, True),
    ("4x4x4", 1, 64, True),
    ("4x4x4", 2, 32, True),
    ("4x4x4", 4, 16, True),
    ("4x4x4", 8, 8, True),
    ("4x4x4", 16, 4, True),
    ("4x4x4", 32, 2, True),
    ("4x4x4", 64, 1, True),
    ("8x8", 1, 64, True),
    ("8x8", 8, 8, False),  # a line of 8 chips cannot close without wraparound
    ("8x8", 64, 1, True),
]


@functools.cache
def slice_topology(name):
    chips, cores = SLICES[name]
    return build_topology(chips, cores)


@pytest.mark.parametrize("name,stages,replicas,closed", CASES)
def test_layout_on_topology(name, stages, replicas, closed):
    topology, expected = slice_topology(name)
    layout = tpu_mesh.layout(topology, stages, replicas)
    p = layout.placement
    check_placement(p, stages, replicas, closed)

    for s, r in itertools.product(range(stages), range(replicas)):
        task, ordinal = expected[p.core(s, r)]
        assert layout.devices[s][r] == f"/job:worker/replica:0/task:{task}/device:TPU:{ordinal}"

    assignment = layout.device_assignment()
    assert isinstance(assignment, tf.tpu.experimental.DeviceAssignment)
    assert (assignment.num_replicas, assignment.num_cores_per_replica) == (replicas, stages)
    assert assignment.core_assignment.shape == (replicas, stages, 4)
    for s, r in itertools.product(range(stages), range(replicas)):
        assert assignment.coordinates(r, s) == p.core(s, r)
        assert assignment.tpu_device(r, s, job="worker") == layout.devices[s][r].replace(
            "/replica:0", ""
        )


def test_open_chain_on_a_slice_without_wraparound():
    layout = tpu_mesh.layout(slice_topology("8x8")[0], 8, 8)
    p = layout.placement
    assert (p.stage_factors, p.replica_factors) == (("x",), ("y",))
    for s in range(8):
        assert p.ring_hops(s) == (1, 1, 1, 1, 1, 1, 1, 7)
        assert {c[0] for c in p.replica_group(s)} == {s}


def test_stages_along_x_and_rings_around_y_z_on_a_cube():
    p = tpu_mesh.layout(slice_topology("4x4x4")[0], 4, 16).placement
    assert (p.stage_factors, p.replica_factors) == (("x",), ("y", "z"))
    for r in range(16):
        path = p.pipeline(r)
        assert [c[0] for c in path] == [0, 1, 2, 3] and len({c[1:] for c in path}) == 1


def test_halves_of_a_wrapped_axis():
    """S = 2 on a 4×4×4 torus: stage 0 on x ∈ {0, 1}, stage 1 on x ∈ {3, 2} (wraparound)."""
    p = tpu_mesh.layout(slice_topology("4x4x4")[0], 2, 32).placement
    assert p.stage_factors == ("x.hi",) and p.replica_factors == ("x.lo", "y", "z")
    assert {c[0] for c in p.replica_group(0)} == {0, 1}
    assert {(a[0], b[0]) for a, b in zip(*p.cores, strict=True)} == {(0, 3), (1, 2)}


def test_ring_links_on_chip_before_pipeline_links():
    """2×2 chips × 2 cores, S=2, R=4: each ring uses both cores of its chips (gradients are
    the bigger traffic), the stage boundary crosses a link."""
    p = tpu_mesh.layout(slice_topology("2x2x1 2 cores")[0], 2, 4).placement
    for s in range(2):
        assert sorted(p.ring_hops(s)) == [0, 0, 1, 1]
    assert all(p.stage_hops(r) == (1,) for r in range(4))
    # Stages only: consecutive stages share a chip, then step to the next chip.
    p = tpu_mesh.layout(slice_topology("2x2x1 2 cores")[0], 8, 1).placement
    assert p.stage_hops(0) == (0, 1, 0, 1, 0, 1, 0)


def test_three_member_ring_closes_only_with_wraparound_or_two_cores():
    line = Torus((3, 1, 1))
    p = tpu_mesh.place(line, 1, 3)
    assert p.ring_hops(0) == (1, 1, 2) and not p.rings_closed
    with pytest.raises(ValueError, match=r"replica groups of 3 cannot be closed rings .* 2 hops"):
        tpu_mesh.place(line, 1, 3, require_closed_rings=True)
    ring = tpu_mesh.place(Torus((3, 1, 1), 1, (True, False, False)), 1, 3)
    assert ring.ring_hops(0) == (1, 1, 1)
    # Two cores per chip close a chain of chips: out on core 0, back on core 1.
    p = tpu_mesh.place(Torus((3, 1, 1), 2), 1, 6)
    check_placement(p, 1, 6, closed=True)
    assert p.ring_hops(0) == (1, 1, 0, 1, 1, 0)


@pytest.mark.parametrize(
    "torus",
    [Torus((4, 4, 8), 1, (True,) * 3), Torus((4, 4, 4), 2, (True,) * 3)],
    ids=str,
)
def test_every_factorization_of_a_cube_is_closed(torus):
    meshes = tpu_mesh.feasible_meshes(torus)
    n = torus.num_cores
    assert meshes == tuple((s, n // s) for s in range(1, n + 1) if n % s == 0)
    for s, r in meshes:
        check_placement(tpu_mesh.place(torus, s, r, require_closed_rings=True), s, r, True)


def test_feasible_meshes_of_a_2d_slice():
    flat = Torus((8, 8, 1))
    assert tpu_mesh.feasible_meshes(flat) == ((1, 64), (8, 8), (64, 1))
    assert tpu_mesh.feasible_meshes(flat, require_closed_rings=True) == ((1, 64), (64, 1))


# -- impossible requests -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,stages,replicas,match",
    [
        ("2x2x1 2 cores", 2, 2, r"needs 4 TPU cores but the slice has 8 .* stage:2;replica:4"),
        ("2x2x1 2 cores", 4, 4, "needs 16 TPU cores but the slice has 8"),
        ("2x2x1 2 cores", 0, 8, "stages must be a positive integer, got 0"),
        ("2x2x1 2 cores", 8, -1, "replicas must be a positive integer, got -1"),
        ("2x2x1 2 cores", 2.0, 4, "stages must be a positive integer, got 2.0"),
        (
            "8x8",
            2,
            32,
            r"stage:2;replica:32 cannot be placed on 8×8×1 .* Meshes that fit: "
            r"stage:1;replica:64, stage:8;replica:8, stage:64;replica:1$",
        ),
        ("8x8", 4, 16, r"cannot be placed .* stage:8;replica:8"),
    ],
)
def test_impossible_meshes(name, stages, replicas, match):
    with pytest.raises(ValueError, match=match):
        tpu_mesh.layout(slice_topology(name)[0], stages, replicas)


def test_open_rings_rejected_on_request():
    with pytest.raises(
        ValueError,
        match=r"replica groups of 8 cannot be closed rings .* 7 hops from its first.*"
        r"rings close: stage:1;replica:64, stage:64;replica:1$",
    ):
        tpu_mesh.layout(slice_topology("8x8")[0], 8, 8, require_closed_rings=True)


def test_incomplete_topologies():
    missing, _ = build_topology((2, 2, 1), 2, drop={(1, 1, 0, 1)})
    with pytest.raises(ValueError, match=r"lacks 1 of its 8 cores \(first: \[\(1, 1, 0, 1\)\]\)"):
        tpu_mesh.layout(missing, 1, 8)
    twice, _ = build_topology((2, 2, 1), 1, repeat=((0, 0, 0, 0), (1, 0, 0, 0)))
    with pytest.raises(ValueError, match=r"lists the cores \[\(0, 0, 0, 0\)\] more than once"):
        tpu_mesh.layout(twice, 1, 4)


def test_bad_arguments():
    with pytest.raises(TypeError, match="expected a tf.tpu.experimental.Topology or a"):
        tpu_mesh.layout("2x2", 1, 4)
    with pytest.raises(ValueError, match="job must be a non-empty string"):
        tpu_mesh.layout(slice_topology("2x2x2")[0], 2, 4, job="")


# -- the layout as a DeviceMesh -----------------------------------------------------------------


def test_layout_mesh():
    topology, expected = slice_topology("2x2x1 2 cores")
    tpu = tpu_mesh.layout(topology, stages=2, replicas=4)
    mesh = tpu.mesh
    assert mesh.shape == (2, 4) and mesh.spec == "stage:2;replica:4"
    assert mesh.devices == tpu.devices
    names = {f"/job:worker/replica:0/task:{t}/device:TPU:{o}" for t, o in expected.values()}
    assert {d for row in mesh.devices for d in row} == names
    group = tpu.placement.replica_group(1)
    assert mesh.replica_group(1) == tuple(
        "/job:worker/replica:0/task:{}/device:TPU:{}".format(*expected[c]) for c in group
    )
    assert mesh == hybrid.DeviceMesh(mesh.devices)
    assert tpu.device_assignment().num_cores_per_replica == 2

    local = tpu_mesh.layout(topology, 8, job="localhost").mesh
    assert local.shape == (8, 1)
    assert set(local.pipeline(0)) == {n.replace("job:worker", "job:localhost") for n in names}

    with pytest.raises(ValueError, match="needs 6 TPU cores but the slice has 8"):
        tpu_mesh.layout(topology, 3, 2)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
