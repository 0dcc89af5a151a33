"""A persistent XLA compile cache, and whether a pipeline's first step should fill it
replica by replica.

TensorFlow keeps compiled XLA programs per device, so on R replicas every stage program is
compiled R times. With a persistent cache (``TF_XLA_FLAGS=--tf_xla_persistent_cache_directory
=DIR``) a program compiled on one device is written to DIR under a key without the device,
and a second device that asks for it afterwards loads it (measured here: 2.8 ms instead of a
38 ms compile; a ResNet50 stage backward, seconds). Only afterwards: replicas that compile
at once both miss. A pipeline whose cache is on therefore runs its first training step
replica by replica (``MeshStep.gradients(ordered=True)``): replica 0 compiles, the others
load. The cache is keyed by each program's fingerprint, so it never changes a result, and
it outlives the process: a restarted run loads its programs too.

Turning the cache on (before TensorFlow reads its flags) is ``hybrid.core.xla_cache``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybrid.core.xla_cache import directory

__all__ = ["FirstStep", "ordered"]


def ordered(replicas: int, jit_compile: bool, strategy: Any, collectives: bool = False) -> bool:
    """Whether a pipeline's first training step should run its replicas in turn: R > 1
    replicas over the mesh's own devices (not a ``tf.distribute`` strategy's), XLA stage
    programs, a persistent cache for the later replicas to load them from, and no
    ``collectives`` inside an action (synchronized BatchNormalization all-reduces each
    micro-batch's moments across the replicas: they must run at once)."""
    if collectives or strategy is not None:
        return False
    return replicas > 1 and jit_compile and directory() is not None


class FirstStep:
    """Which traced step of a kind (``train``, ``gradients``, ``evaluate``, ``predict``) runs
    next: for each new ``Steps`` (each M) its ``first_<kind>`` once per kind when
    ``ordered()``, else and afterwards the plain one. Whichever kind runs first compiles the
    programs (a ``gradients`` call before any training step, an ``evaluate`` of a
    pipeline that never trained): each kind's first call runs the replicas in turn."""

    def __init__(self) -> None:
        self._steps: Any = None  # the Steps whose first calls are counted in _ran
        self._ran: set[str] = set()

    def ran(self, steps: Any, kind: str) -> bool:
        """Whether ``steps`` ran ``kind`` already (its programs compiled)."""
        return self._steps is steps and kind in self._ran

    def function(self, steps: Any, ordered: Callable[[], bool], kind: str) -> Any:
        """``steps.first_<kind>`` the first time ``steps`` runs ``kind`` and ``ordered()``
        (asked then only), else ``steps.<kind>``."""
        if self._steps is not steps:
            self._steps, self._ran = steps, set()
        if kind in self._ran:
            return getattr(steps, kind)
        self._ran.add(kind)
        return getattr(steps, f"first_{kind}" if ordered() else kind)
