"""The machine a plan is for: link speeds, per-action and per-step overheads, memory per
device, and the time of a ring all-reduce over a link.

Conventions: times in seconds, sizes in bytes, bandwidths in bytes per second.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["ALLOCATOR_HEADROOM", "Hardware", "Link", "all_gather_time", "all_reduce_time"]

# The share of a device's memory its allocator needs beyond what the tensors request at
# their peak (what the profile predicts), under TensorFlow's BFC allocator with its pool held
# as one region (a GPU's default; the capped simulated devices reserve theirs so,
# ``hybrid.launch.worker``): it serves a request with a free chunk of less than twice its
# size unsplit, and a large tensor needs contiguous free bytes. Measured with ``hybrid-train
# --memory_per_device`` on capped devices (docs/guide/meshes.md): a layout whose tensors
# request 14.3 MiB at their peak (predicted 14.0) trained under a 15 MiB cap and not under
# 14 MiB; every layout the planner chose in ``benchmarks/memory_wall.py`` trained under it.
ALLOCATOR_HEADROOM = 0.1


@dataclasses.dataclass(frozen=True)
class Link:
    """One mesh axis's links: a message of n bytes takes ``latency + n / bandwidth``.

    Attributes:
      bandwidth: bytes per second (``math.inf``: free).
      latency: seconds per message.
    """

    bandwidth: float = math.inf
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(
                f"a link needs bandwidth > 0 and latency >= 0; got bandwidth={self.bandwidth}, "
                f"latency={self.latency}"
            )

    def time(self, nbytes: float) -> float:
        """Seconds to send one message of ``nbytes``."""
        return self.latency + nbytes / self.bandwidth

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float]) -> Link:
        """The least-squares line ``seconds = latency + size / bandwidth`` through measured
        (size, seconds) pairs; a flat or falling line gives an infinite bandwidth.

        Raises:
          ValueError: fewer than two pairs, or lengths that differ.
        """
        if len(sizes) != len(seconds) or len(sizes) < 2:
            raise ValueError(
                f"fitting a link needs two or more (size, seconds) pairs; got {len(sizes)} "
                f"sizes and {len(seconds)} times"
            )
        n = len(sizes)
        mx, my = sum(sizes) / n, sum(seconds) / n
        sxx = sum((x - mx) ** 2 for x in sizes)
        sxy = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds, strict=True))
        slope = sxy / sxx if sxx > 0 else 0.0
        if slope <= 0:
            return cls(math.inf, max(0.0, my))
        return cls(1.0 / slope, max(0.0, my - slope * mx))


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The machine the plan is for.

    Attributes:
      memory_per_device: bytes one device can hold; None: no limit.
      allocator_headroom: the share of ``memory_per_device`` a plan leaves to the
        allocator (:data:`ALLOCATOR_HEADROOM`): a layout fits when its predicted peak (the
        bytes its tensors request) is at most ``usable_memory``.
      pipeline: the links between consecutive stages (activations and their gradients).
      replica: the links inside a replica group (the gradient all-reduce).
      action_overhead: seconds every scheduled action costs beyond its compute (launching a
        program, control dependencies).
      tensor_overhead: seconds per weight array for every backward: adding one
        micro-batch's gradient into the step's accumulator is one op per array.
      step_overhead: seconds every step costs once (calling the step, feeding the batch,
        reading the loss back).
      dispatch_overhead: seconds of the host's per action of the step, over the whole mesh:
        the runtime launches the R · |schedule| actions one after another, so a step takes
        at least ``step_overhead + actions × dispatch_overhead`` however little they
        compute (measured per host: :mod:`hybrid.planning.host_calibration`).
      compute_scale: factor on every profiled compute time (a device faster or slower than
        the one profiled, or a calibration).
      host_cores: for simulated devices that share one host: the cores they share (fitted,
        it may be below the core count: two busy cores of one host each run slower than
        one alone). The devices that compute at once, R · min(S, M) of an S × R mesh
        with M micro-batches, then each compute max(1, R · min(S, M) / host_cores)
        times slower; a step takes at least (all devices' work) / host_cores, and the sum
        of every device's gradient accumulations (``tensor_overhead``: framework ops outside
        the device programs, which run one at a time on the host). None: every device is
        its own hardware (GPUs, TPU cores).
    """

    memory_per_device: float | None = None
    allocator_headroom: float = ALLOCATOR_HEADROOM
    pipeline: Link = Link()
    replica: Link = Link()
    action_overhead: float = 0.0
    tensor_overhead: float = 0.0
    step_overhead: float = 0.0
    dispatch_overhead: float = 0.0
    compute_scale: float = 1.0
    host_cores: float | None = None

    def __post_init__(self) -> None:
        if self.memory_per_device is not None and not self.memory_per_device > 0:
            raise ValueError(f"memory_per_device must be positive, got {self.memory_per_device}")
        if not 0 <= self.allocator_headroom < 1:
            raise ValueError(
                f"allocator_headroom is a share of memory_per_device in [0, 1), got "
                f"{self.allocator_headroom}"
            )
        if self.host_cores is not None and not self.host_cores > 0:
            raise ValueError(f"host_cores must be positive or None, got {self.host_cores}")
        overheads = (
            self.action_overhead,
            self.tensor_overhead,
            self.step_overhead,
            self.dispatch_overhead,
        )
        if min(overheads) < 0 or not self.compute_scale > 0:
            raise ValueError(
                f"overheads must be >= 0 and compute_scale > 0; got action_overhead="
                f"{self.action_overhead}, tensor_overhead={self.tensor_overhead}, "
                f"step_overhead={self.step_overhead}, dispatch_overhead="
                f"{self.dispatch_overhead}, compute_scale={self.compute_scale}"
            )

    @property
    def usable_memory(self) -> float | None:
        """The bytes a layout's predicted peak may reach on one device: ``memory_per_device``
        less the allocator's headroom; None: no limit."""
        if self.memory_per_device is None:
            return None
        return self.memory_per_device * (1.0 - self.allocator_headroom)


def all_reduce_time(nbytes: float, replicas: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``replicas`` devices.

    A ring sends 2(R−1) messages of nbytes/R per device (reduce-scatter, then all-gather)::

        time = 2(R−1)/R · nbytes / bandwidth + 2(R−1) · latency        (0 when R = 1)
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    if replicas == 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (replicas - 1)
    return steps / replicas * nbytes / link.bandwidth + steps * link.latency


def all_gather_time(nbytes: float, replicas: int, link: Link) -> float:
    """Seconds for ``replicas`` devices that each own 1/R of ``nbytes`` to give every device
    all of them (ZeRO-1's updated weights, sent by their owners after the update)::

        time = (R−1)/R · nbytes / bandwidth + (R−1) · latency        (0 when R = 1)
    """
    return all_reduce_time(nbytes, replicas, link) / 2
