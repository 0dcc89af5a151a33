"""TPU meshes on a real slice: ``place`` on a ``tf.tpu.experimental.Topology``, with the
TensorFlow device name of every core, its ``DeviceAssignment`` and a ``TPUStrategy``.

    tpu = layout(resolver_or_topology, stages=4, replicas=2)   # TpuLayout
    pipe = Pipeline(layers, tpu.mesh, ...)                     # a DeviceMesh of TPU names
    strategy = tpu_strategy(resolver, tpu)

The placement itself (which core holds stage s of replica r) is TensorFlow-free and lives in
:mod:`hybrid.platforms.torus` (the slice's fabric) and :mod:`hybrid.platforms.torus_placement`
(the search); their public names are re-exported here. TensorFlow is imported only by the
functions that need it, so importing this module stays cheap.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from hybrid.core.mesh import DeviceMesh
from hybrid.platforms.torus import Coord, Torus, default_wrap
from hybrid.platforms.torus_placement import Placement, feasible_meshes, place

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
    """The Topology, and the job of its TPU devices (initialising the system from a resolver)."""
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
    """The torus of ``topology``'s mesh shape, checked to list each of its cores once."""
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
    """The TensorFlow name of the TPU device at ``core``: its task and ordinal in ``job``."""
    task = int(topology.task_ordinal_at_coordinates(core))
    ordinal = int(topology.tpu_device_ordinal_at_coordinates(core))
    return f"/job:{job}/replica:0/task:{task}/device:TPU:{ordinal}"
