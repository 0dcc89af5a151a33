"""Compression of what crosses a stage boundary: the forward activations a stage sends to the
next and the gradients the next sends back.

    sender's device:    wire = encode(t)      (float32 -> bfloat16, or int8 and a scale)
    (the transfer carries the wire format: half or a quarter of the bytes)
    receiver's device:  t' = decode(wire)     (back to t's dtype)

``"bfloat16"`` rounds each value to 8 bits of mantissa (relative error ≤ 2⁻⁹); ``"int8"``
quantizes each tensor with one scale, max |t| / 127 (absolute error ≤ scale / 2, and a
tensor of zeros stays zeros). Only float32 and float64 tensors are compressed: integer
inputs (token ids), masks and tensors already in 16 bits cross as they are.

This changes the numbers the next stage sees, so training is no longer Keras's step: it is
off by default, meant for links slow enough that transfers dominate the step (several hosts,
PCIe between GPUs), and its error against float32 transfers is measured in
``tests/test_pipeline_api.py``. Every replica compresses alike, so replicas stay equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hybrid.core.config import BOUNDARY_DTYPES

__all__ = ["BOUNDARY_DTYPES", "Codec", "Wire", "check_boundary_dtype", "codec_for"]


_WIDE = (tf.float32, tf.float64)


def check_boundary_dtype(name: Any) -> str | None:
    """``name`` (None: not compressed) after checking it is one of BOUNDARY_DTYPES.

    Raises:
      ValueError: another value, naming the choices.
    """
    if name is None or name in BOUNDARY_DTYPES:
        return None if name in (None, "float32") else str(name)
    raise ValueError(
        f"boundary_dtype={name!r}: choose None or one of {BOUNDARY_DTYPES} (bfloat16 halves "
        "and int8 quarters the bytes crossing each stage boundary, inexactly)"
    )


class Wire:
    """One tensor as it crosses the boundary: its wire parts (the tensor itself when not
    compressed) and the dtype it is decoded back to."""

    def __init__(self, parts: list[tf.Tensor], dtype: tf.DType) -> None:
        self.parts, self.dtype = parts, dtype


class Codec:
    """Encodes tensors for the wire on the sender's device and decodes them on the
    receiver's (the caller places each call under the right ``tf.device``)."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype

    def encode(self, tensors: Sequence[tf.Tensor | None]) -> list[Wire | None]:
        """Each tensor's wire form (None stays None: an input without a gradient)."""
        return [None if t is None else Wire(self._parts(t), t.dtype) for t in tensors]

    def _parts(self, t: tf.Tensor) -> list[tf.Tensor]:
        if t.dtype not in _WIDE:
            return [t]
        if self.dtype == "bfloat16":
            return [tf.cast(t, tf.bfloat16)]
        scale = tf.reduce_max(tf.abs(t)) / 127.0
        scale = tf.where(scale > 0, scale, tf.ones_like(scale))
        return [tf.cast(tf.round(t / scale), tf.int8), tf.cast(scale, tf.float32)]

    @staticmethod
    def decode(wires: Sequence[Wire | None]) -> list[tf.Tensor | None]:
        """The tensors back in their dtypes (on the device this runs under)."""
        out: list[tf.Tensor | None] = []
        for wire in wires:
            if wire is None or wire.parts[0].dtype == wire.dtype:
                out.append(None if wire is None else wire.parts[0])
            elif len(wire.parts) == 1:
                out.append(tf.cast(wire.parts[0], wire.dtype))
            else:
                values, scale = wire.parts
                out.append(tf.cast(values, wire.dtype) * tf.cast(scale, wire.dtype))
        return out

    @staticmethod
    def tensors(wires: Sequence[Wire | None]) -> list[tf.Tensor]:
        """Every tensor that crosses: what an action sending ``wires`` outputs."""
        return [part for wire in wires if wire is not None for part in wire.parts]


def codec_for(dtype: str | None) -> Codec | None:
    """The codec of a checked ``boundary_dtype`` (None: no compression)."""
    return None if dtype is None else Codec(dtype)
