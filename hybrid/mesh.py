"""DeviceMesh: an immutable S × R grid of device names (pipeline stages × data replicas).

Device ``(stage, replica)`` is the ``stage * R + replica``-th device of the list, so each
stage's replica group is a run of neighbouring devices (the fast links of a host) and the
pipeline steps across groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid.tpu_mesh import TpuLayout

__all__ = ["DeviceMesh"]

_AXES = ("stage", "replica")


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """Devices arranged as ``devices[stage][replica]``.

    Attributes:
      devices: one tuple per stage with that stage's device name for every replica.
      tpu: for a mesh made by ``from_tpu``, its TPU layout (core coordinates, the
        ``DeviceAssignment``); None otherwise. Not part of equality: the device names are.
    """

    devices: tuple[tuple[str, ...], ...]
    tpu: TpuLayout | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.devices or not self.devices[0]:
            raise ValueError("a DeviceMesh needs at least one stage and one replica")
        widths = {len(row) for row in self.devices}
        if len(widths) != 1:
            raise ValueError(f"every stage needs the same number of replicas, got {self.devices}")
        flat = [d for row in self.devices for d in row]
        if len(set(flat)) != len(flat):
            raise ValueError(f"a device appears twice in the mesh {self.devices}")

    @classmethod
    def from_devices(cls, devices: Sequence[str], stages: int, replicas: int) -> DeviceMesh:
        """Lays out the first ``stages * replicas`` of ``devices`` stage-major."""
        _check_axis("stages", stages)
        _check_axis("replicas", replicas)
        need = stages * replicas
        if need > len(devices):
            raise ValueError(
                f"mesh stage:{stages};replica:{replicas} needs {need} devices but only "
                f"{len(devices)} are available ({list(devices)}); use a smaller mesh, or on a "
                f"CPU call hybrid.simulate_cpu_devices({need}) before TensorFlow starts"
            )
        rows = tuple(
            tuple(devices[s * replicas + r] for r in range(replicas)) for s in range(stages)
        )
        return cls(rows)

    @classmethod
    def create(cls, stages: int, replicas: int = 1, device_type: str | None = None) -> DeviceMesh:
        """The first S*R local devices of ``device_type`` (default: GPU if present, else CPU)."""
        from hybrid import devices  # TensorFlow is only needed to discover devices.

        _check_axis("stages", stages)
        _check_axis("replicas", replicas)
        return cls.from_devices(devices.local_devices(device_type), stages, replicas)

    @classmethod
    def from_spec(cls, spec: str, device_type: str | None = None) -> DeviceMesh:
        """Builds a mesh from a mesh-tensorflow style spec, e.g. ``"stage:2;replica:4"``."""
        stages, replicas = parse_spec(spec)
        return cls.create(stages, replicas, device_type)

    @classmethod
    def from_tpu(
        cls,
        resolver_or_topology: Any,
        stages: int,
        replicas: int = 1,
        *,
        wrap: bool | Sequence[bool] | None = None,
        job: str | None = None,
        require_closed_rings: bool = False,
    ) -> DeviceMesh:
        """Every core of a TPU slice, with neighbouring stages on neighbouring chips and each
        replica group on a ring of neighbours (``hybrid.tpu_mesh.layout``).

        Args:
          resolver_or_topology: a ``tf.tpu.experimental.Topology``, or a
            ``TPUClusterResolver`` (then ``initialize_tpu_system`` runs here; needs a TPU).
          stages, replicas: S and R with S × R = the cores of the slice.
          wrap: wraparound links per chip axis; None: every axis wraps iff each side of the
            chip grid is a multiple of 4 (v4/v5p cubes), else none (2-D slices, small 3-D).
          job: the job in the device names (default: ``"worker"``, or the TPU devices' job).
          require_closed_rings: reject open replica chains instead of accepting them.

        Returns:
          The mesh of TPU device names; ``mesh.tpu`` keeps the layout, and
          ``mesh.tpu.device_assignment()`` gives the ``DeviceAssignment`` (R replicas of S
          logical cores) for ``TPUStrategy``.
        """
        from hybrid import tpu_mesh  # TensorFlow is only needed for the topology.

        layout = tpu_mesh.layout(
            resolver_or_topology,
            stages,
            replicas,
            wrap=wrap,
            job=job,
            require_closed_rings=require_closed_rings,
        )
        return cls(layout.devices, tpu=layout)

    @classmethod
    def from_cluster(
        cls,
        cluster: Any,
        stages: int,
        replicas: int = 1,
        order: str = "replica_groups_in_host",
        device_type: str | None = None,
        job: str = "worker",
        timeout_s: float = 60.0,
    ) -> DeviceMesh:
        """The devices of every task of a TensorFlow cluster (``hybrid.cluster``).

        Args:
          cluster: a ``hybrid.cluster.Cluster`` from ``cluster.connect``, or anything it
            accepts (a ClusterResolver, a ClusterSpec, a ``{job: [address, ...]}`` mapping,
            its JSON, None for TF_CONFIG): then this connects first, within ``timeout_s``.
          stages, replicas: S and R.
          order: ``"replica_groups_in_host"`` keeps each stage's replica group inside one
            task and lets the pipeline cross tasks; ``"pipelines_in_host"`` the reverse.
          device_type: "GPU", "CPU", ...; default GPU if any task has one, else CPU.
          job: the job whose tasks hold the mesh.
        """
        from hybrid import cluster as cluster_lib  # TensorFlow is only needed to connect.

        _check_axis("stages", stages)
        _check_axis("replicas", replicas)
        return cls(
            cluster_lib.mesh_devices(cluster, stages, replicas, order, device_type, job, timeout_s)
        )

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.devices), len(self.devices[0]))

    @property
    def num_stages(self) -> int:
        return len(self.devices)

    @property
    def num_replicas(self) -> int:
        return len(self.devices[0])

    @property
    def size(self) -> int:
        return self.num_stages * self.num_replicas

    @property
    def spec(self) -> str:
        return f"stage:{self.num_stages};replica:{self.num_replicas}"

    def device(self, stage: int, replica: int) -> str:
        """The device that runs ``stage`` for ``replica``."""
        if not (0 <= stage < self.num_stages and 0 <= replica < self.num_replicas):
            raise IndexError(
                f"(stage={stage}, replica={replica}) is outside the mesh of shape {self.shape}"
            )
        return self.devices[stage][replica]

    def replica_group(self, stage: int) -> tuple[str, ...]:
        """The devices holding copies of ``stage``: they all-reduce its gradients."""
        return self.devices[stage]

    def pipeline(self, replica: int) -> tuple[str, ...]:
        """The devices of one replica's pipeline, stage 0 first."""
        return tuple(row[replica] for row in self.devices)

    def __str__(self) -> str:
        return f"DeviceMesh({self.spec})"


def _check_axis(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def parse_spec(spec: str) -> tuple[int, int]:
    """``"stage:2;replica:4"`` -> (2, 4). Axes may come in any order; a missing axis is 1."""
    sizes = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, sep, value = part.partition(":")
        name = name.strip()
        if not sep or name not in _AXES or not value.strip().isdigit():
            raise ValueError(
                f"bad mesh spec {spec!r}: each part must be 'stage:N' or 'replica:N' with a "
                "positive integer N, separated by ';' (e.g. 'stage:2;replica:4')"
            )
        if name in sizes:
            raise ValueError(f"bad mesh spec {spec!r}: axis {name!r} appears twice")
        sizes[name] = int(value)
    if not sizes:
        raise ValueError(f"empty mesh spec {spec!r}; e.g. 'stage:2;replica:4'")
    stages, replicas = sizes.get("stage", 1), sizes.get("replica", 1)
    _check_axis("stage", stages)
    _check_axis("replica", replicas)
    return stages, replicas
