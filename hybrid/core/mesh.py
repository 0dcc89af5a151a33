"""DeviceMesh: an immutable S × R grid of device names (pipeline stages × data replicas).

Device ``(stage, replica)`` is the ``stage * R + replica``-th device of the list, so each
stage's replica group is a run of neighbouring devices (the fast links of a host) and the
pipeline steps across groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["DeviceMesh", "local_devices", "parse_spec"]

_AXES = ("stage", "replica")


@dataclasses.dataclass(frozen=True)
class DeviceMesh:
    """Devices arranged as ``devices[stage][replica]``.

    Attributes:
      devices: one tuple per stage with that stage's device name for every replica.

    Meshes over other device sources are made where those live:
    ``hybrid.platforms.tpu_mesh.layout(...).mesh`` (a TPU slice, stages on neighbouring
    chips) and ``hybrid.platforms.cluster.mesh(...)`` (the tasks of a TensorFlow cluster).
    """

    devices: tuple[tuple[str, ...], ...]

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
        """The first S*R local devices of ``device_type`` (default: GPU if present, else CPU).

        Asks the TensorFlow runtime which devices exist, so this (and only this) imports
        TensorFlow, at call time: importing the core never does.
        """
        _check_axis("stages", stages)
        _check_axis("replicas", replicas)
        return cls.from_devices(local_devices(device_type), stages, replicas)

    @classmethod
    def from_spec(cls, spec: str, device_type: str | None = None) -> DeviceMesh:
        """Builds a mesh from a mesh-tensorflow style spec, e.g. ``"stage:2;replica:4"``."""
        stages, replicas = parse_spec(spec)
        return cls.create(stages, replicas, device_type)

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


def local_devices(device_type: str | None = None) -> tuple[str, ...]:
    """Names of the local logical devices of ``device_type`` ('GPU', 'TPU', 'CPU').

    With no type, the best present: GPU if any, else CPU.
    """
    import tensorflow as tf  # the runtime's device list; see DeviceMesh.create

    from hybrid.core.quiet import quiet_start

    with quiet_start():  # perhaps the runtime's first look at its devices
        if device_type is None:
            device_type = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
        return tuple(d.name for d in tf.config.list_logical_devices(device_type.upper()))


def _check_axis(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def parse_spec(spec: str) -> tuple[int, int]:
    """``"stage:2,replica:4"`` (or ``"stage:2;replica:4"``, Mesh TensorFlow's form) -> (2, 4).

    Axes may come in any order; a missing axis is 1. The comma form is the one to type on a
    command line: an unquoted ``;`` ends the shell command there.
    """
    sizes = {}
    for part in filter(None, (p.strip() for p in spec.replace(",", ";").split(";"))):
        name, sep, value = part.partition(":")
        name = name.strip()
        if not sep or name not in _AXES or not value.strip().isdigit():
            raise ValueError(
                f"bad mesh spec {spec!r}: each part must be 'stage:N' or 'replica:N' with a "
                "positive integer N, separated by ',' or ';' (e.g. 'stage:2,replica:4')"
            )
        if name in sizes:
            raise ValueError(f"bad mesh spec {spec!r}: axis {name!r} appears twice")
        sizes[name] = int(value)
    if not sizes:
        raise ValueError(f"empty mesh spec {spec!r}; e.g. 'stage:2,replica:4'")
    stages, replicas = sizes.get("stage", 1), sizes.get("replica", 1)
    _check_axis("stage", stages)
    _check_axis("replica", replicas)
    return stages, replicas
