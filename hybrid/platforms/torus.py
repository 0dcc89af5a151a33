"""The fabric of a TPU slice: X × Y × Z chips, ``cores_per_chip`` cores each, and the
chip-to-chip hops between two cores (no TensorFlow).

A core is named by ``(x, y, z, core)``, the coordinates of ``tf.tpu.experimental.Topology``.
Along an axis that wraps (a torus), the last chip is also linked to the first, so the hops
along that axis are ``min(|a - b|, n - |a - b|)`` rather than ``|a - b|``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

__all__ = ["AXES", "Coord", "Torus", "chip_hops", "default_wrap", "is_positive_int"]

Coord = tuple[int, int, int, int]
"""A core of the slice: (x, y, z, core on the chip)."""

AXES = ("x", "y", "z")
"""The names of the chip axes, in coordinate order."""


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
        if len(self.chips) != 3 or not all(is_positive_int(n) for n in self.chips):
            raise ValueError(f"chips must be 3 positive integers (X, Y, Z), got {self.chips!r}")
        if not is_positive_int(self.cores_per_chip):
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
        """Cores of the slice: X · Y · Z · cores_per_chip."""
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
        return chip_hops(self, a, b)

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
        wraps = "".join(a for a, w in zip(AXES, self.wrap, strict=True) if w) or "none"
        return f"{X}×{Y}×{Z} chips × {self.cores_per_chip} cores (wraparound: {wraps})"

    def _check(self, coord: Coord) -> None:
        """Raises ValueError unless ``coord`` is a core of the slice."""
        bounds = (*self.chips, self.cores_per_chip)
        if len(coord) != 4 or not all(0 <= c < n for c, n in zip(coord, bounds, strict=True)):
            raise ValueError(f"core {tuple(coord)} is outside the slice {self}")


def chip_hops(t: Torus, a: Coord, b: Coord) -> int:
    """Chip-to-chip links between cores ``a`` and ``b`` of ``t`` (no bounds check)."""
    total = 0
    for axis in range(3):
        d = abs(a[axis] - b[axis])
        total += min(d, t.chips[axis] - d) if t.wrap[axis] else d
    return total


def is_positive_int(value: object) -> bool:
    """Whether ``value`` is an int (numpy's included, bool excluded) above 0."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and bool(value > 0)
