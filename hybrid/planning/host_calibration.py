"""What a training step costs the host beyond the devices' compute, measured once per host.

A step of the engine is one traced function that launches R · |schedule| actions (one
stage program on one micro-batch each) and then the updates. On a tiny model the devices
finish each action at once and the step is the host's: a fixed cost (calling the step,
feeding the batch, reading the loss back) and a cost per action (launching a program and
ordering it), the actions launched one after another. Measured here on a tiny model
(4 × Dense(8)) over a few meshes and micro-batch counts, fitted by least squares::

    step seconds = fixed + per_action × actions,   actions = R · |schedule actions|

``fixed`` is the :class:`~hybrid.planning.hardware.Hardware`'s ``step_overhead`` and
``per_action`` its ``dispatch_overhead`` (the cost model takes a step as at least
``fixed + per_action × actions``). With two devices or more, the replicas' gradient
all-reduce is measured too (the engine's collective over two devices, a few sizes), its
line ``seconds = latency + bytes / bandwidth`` the ``Hardware``'s ``replica`` link: on
simulated devices it is host work (copies and a collective's launch), not free. A
calibration is cached per host, TensorFlow version, device kind, device count and XLA
setting in a JSON file under the user's cache directory (``hybrid.core.user_cache``), so
the next plan on the machine reuses it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import time
from collections.abc import Sequence
from typing import Any

from hybrid.core import user_cache
from hybrid.planning.hardware import Hardware, Link

__all__ = [
    "CALIBRATION",
    "HostOverheads",
    "cache_path",
    "calibrated",
    "measure_host",
    "shared_cores",
]

# (stages, replicas, micro_batches) timed; cut to the devices there are.
MESHES = ((1, 1, 1), (1, 1, 8), (2, 1, 2), (2, 1, 8), (1, 2, 4), (2, 2, 4))


@dataclasses.dataclass(frozen=True)
class HostOverheads:
    """A host's fitted step cost (seconds) and the measurements it was fitted on.

    Attributes:
      fixed: seconds every step costs once.
      per_action: seconds per action of the step (all replicas' actions together).
      rows: ``(stages, replicas, micro_batches, actions, median step seconds)`` measured.
      replica: the replicas' all-reduce as a link, (bandwidth in bytes per second,
        latency in seconds) for :func:`hybrid.planning.hardware.all_reduce_time`; None:
        not measured (one device).
    """

    fixed: float
    per_action: float
    rows: tuple[tuple[int, int, int, int, float], ...]
    replica: tuple[float, float] | None = None

    def hardware(self, base: Hardware | None = None, host_cores: float | None = None) -> Hardware:
        """``base`` (default: free links, no memory limit) with these overheads (and
        ``host_cores`` when given: devices that share the host's cores)."""
        changes: dict[str, Any] = {
            "step_overhead": self.fixed,
            "dispatch_overhead": self.per_action,
        }
        if host_cores is not None:
            changes["host_cores"] = host_cores
        if self.replica is not None:
            changes["replica"] = Link(*self.replica)
        return dataclasses.replace(base or Hardware(), **changes)


def shared_cores(devices: Sequence[str]) -> float | None:
    """The cores simulated CPU devices share (this process's), or None for devices that
    are each their own hardware (GPUs, TPU cores)."""
    if not devices or not all("CPU" in d.rsplit("/", 1)[-1] for d in devices):
        return None
    return float(len(os.sched_getaffinity(0)))


def cache_path() -> str:
    """The JSON file calibrations are kept in."""
    return os.path.join(user_cache.root(), "host_calibration.json")


# What a calibration measures, numbered as the profiler's ``profile_cache.PROFILER``: one
# filed by another number is measured again (2: the replicas' all-reduce, the ``replica``
# link; 3: the engine's own step got cheaper on the host — logs returned by the step, the
# metrics reset in one call — so what 2 measured is stale; 4: the meshes timed in
# alternating rounds: three calibrations on 2 devices fitted 19.8, 20.5, 20.7 µs per action,
# where one mesh after the other gave 20.1, 20.9, 33.8).
CALIBRATION = 4


def _key(devices: Sequence[str], jit_compile: bool) -> str:
    import tensorflow as tf

    kind = devices[0].rsplit("/", 1)[-1].rsplit(":", 1)[0] if devices else "none"
    return (
        f"{platform.node()}|tf {tf.__version__}|{kind}×{len(devices)}|xla={jit_compile}"
        f"|calibration {CALIBRATION}"
    )


def calibrated(
    devices: Sequence[str] | None = None, jit_compile: bool = True, verbose: int = 0
) -> HostOverheads:
    """This host's overheads: the cached calibration for these devices, else measured
    (:func:`measure_host`, a few seconds) and cached."""
    from hybrid.core.mesh import local_devices

    devices = list(devices) if devices is not None else list(local_devices())
    key, path = _key(devices, jit_compile), cache_path()
    stored = _read(path)
    if key in stored:
        entry = stored[key]
        replica = entry.get("replica")
        return HostOverheads(
            entry["fixed"],
            entry["per_action"],
            tuple(map(tuple, entry["rows"])),
            tuple(replica) if replica is not None else None,
        )
    if verbose:
        print(f"measuring the host's cost per step and per action on {len(devices)} devices")
    found = measure_host(devices, jit_compile)
    stored[key] = dataclasses.asdict(found)
    user_cache.write_json(path, stored)
    return found


def _read(path: str) -> dict[str, Any]:
    stored = user_cache.read_json(path)
    return stored if isinstance(stored, dict) else {}


def measure_host(
    devices: Sequence[str], jit_compile: bool = True, steps: int = 15, rounds: int = 5
) -> HostOverheads:
    """Times training steps of a tiny model on the meshes of :data:`MESHES` that
    ``devices`` allow and fits ``fixed + per_action × actions``: each mesh's pipeline built
    and warmed up (two steps), then ``rounds`` rounds in which every mesh takes its share
    of ``steps`` in turn (a busy moment of a shared machine falls on every mesh alike, not
    on one mesh's whole measurement), each mesh's median step kept."""
    import keras
    import numpy as np

    from hybrid.core.mesh import DeviceMesh
    from hybrid.core.schedule import get
    from hybrid.engine.api.pipeline import Pipeline

    timed: list[tuple[tuple[int, int, int, int], Any, Any, Any, list[float]]] = []
    rng = np.random.default_rng(0)
    for stages, replicas, micro in MESHES:
        if stages * replicas > len(devices):
            continue
        batch = 4 * replicas * micro
        x = rng.normal(size=(batch, 8)).astype("float32")
        y = rng.integers(0, 8, size=(batch,)).astype("int32")
        mesh = DeviceMesh.from_devices(devices[: stages * replicas], stages, replicas)
        layers = [keras.layers.Dense(8, activation="relu") for _ in range(3)]
        pipe = Pipeline([*layers, keras.layers.Dense(8)], mesh, micro_batches=micro)
        pipe.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
        for _ in range(2):
            pipe.train_step(x, y)
        actions = replicas * get(pipe.config.schedule, stages, micro).num_actions
        timed.append(((stages, replicas, micro, actions), pipe, x, y, []))
    for _ in range(rounds):
        for _, pipe, x, y, times in timed:
            for _ in range(-(-steps // rounds)):
                start = time.perf_counter()
                pipe.train_step(x, y)
                times.append(time.perf_counter() - start)
    rows = [(*mesh, float(np.median(times))) for mesh, _, _, _, times in timed]
    fixed, per_action = _fit([r[3] for r in rows], [r[4] for r in rows])
    return HostOverheads(fixed, per_action, tuple(rows), _replica_link(devices))


# Vector sizes the all-reduce is timed at: 64 KiB, 1 MiB, 8 MiB.
ALL_REDUCE_BYTES = (2**16, 2**20, 2**23)


def _replica_link(devices: Sequence[str]) -> tuple[float, float] | None:
    """The all-reduce of two of ``devices`` as (bandwidth, latency) of the ring formula
    (:func:`hybrid.planning.hardware.all_reduce_time`: with R = 2 it takes
    ``bytes / bandwidth + 2 × latency``), fitted to the engine's collective timed at
    :data:`ALL_REDUCE_BYTES`; None with one device."""
    if len(devices) < 2:
        return None
    from hybrid.planning.link_timing import measure_all_reduce

    seconds = measure_all_reduce(devices[:2], ALL_REDUCE_BYTES)
    line = Link.fit(ALL_REDUCE_BYTES, seconds)
    return line.bandwidth, line.latency / 2


def _fit(actions: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least squares ``seconds = fixed + per_action × actions``, both kept >= 0: the line
    :meth:`Link.fit` fits (its latency the fixed cost, its time per byte the cost per
    action)."""
    line = Link.fit(actions, seconds)
    return line.latency, 0.0 if math.isinf(line.bandwidth) else 1.0 / line.bandwidth
