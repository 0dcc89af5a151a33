"""The filter gradient of a depthwise convolution in a stage's XLA program on a CPU: one
product-sum per filter tap, not XLA:CPU's dense convolution.

A depthwise convolution is ``DepthwiseConv2dNative`` (Keras's DepthwiseConv2D and
SeparableConv2D) or a ``Conv2D`` with one input channel per group (``Conv2D(groups=C)``,
ConvNeXt's). XLA:CPU compiles their filter gradient into a convolution
over all C×C channel pairs whose diagonal it then masks out and sums: k_h·k_w·C² elements
whatever the batch (measured, C = 960, 3×3 filter, 1×1 image: 44–58 ms at 4 and at 16
examples; TensorFlow's own kernel 0.6 ms). Keras's one program pays that once a step; a
micro-batched pipeline once per micro-batch (MobileNetV2's last blocks cost a 2-stage
pipeline ~60 ms per micro-batch of 4 examples). Within :func:`cheap_filter_gradients` the
tape computes instead, for input x (NHWC, padded as the forward pads it), output gradient
dy, strides s, dilations d and channel multiplier m,

    dW[i, j, c, q] = Σ_{b, y, x} x[b, y·s_h + i·d_h, x·s_w + j·d_w, c] · dy[b, y, x, c·m + q]

a product-sum per tap (0.3–1.4 ms there, written as one op per tap; here every tap's
operand is taken by two gathers, since XLA compiles k² ops slowly): the same sum in another
order, equal to rounding (written for the program cut's sake with ``dy`` moved, not ``x``:
:func:`filter_gradient`). The input gradient is TensorFlow's own. Other layouts, unknown
shapes and half-precision types keep TensorFlow's gradient.

TensorFlow's tape looks each op's gradient up in its registry when ``tape.gradient`` runs,
by op type (``gradient_override_map`` reaches only ``tf.gradients``): the context swaps the
registry's entries for the op types while it is open (one thread at a time).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import tensorflow as tf
from tensorflow.python.framework import ops, registry

__all__ = ["OPS", "cheap_filter_gradients", "filter_gradient"]

# A Conv2D is depthwise when each group holds one input channel (Keras's
# Conv2D(groups=channels), as ConvNeXt's blocks use it): its filter is [kh, kw, 1, C·m].
OPS = ("DepthwiseConv2dNative", "Conv2D")
_DTYPES = (tf.float32, tf.float64)
_lock = threading.RLock()
# TensorFlow's registered gradients of OPS (used where filter_gradient does not apply).
_TENSORFLOWS = {name: ops._gradient_registry.lookup(name) for name in OPS}  # noqa: SLF001


def _text(op: Any, name: str) -> str:
    value = op.get_attr(name)
    return value.decode() if isinstance(value, bytes) else value


def _before(op: Any, size: int, kernel: int, stride: int, dilation: int, axis: int) -> int:
    """The padding before spatial ``axis`` (1: height, 2: width) as the forward pads it."""
    padding = _text(op, "padding")
    if padding == "VALID":
        return 0
    if padding == "EXPLICIT":
        return list(op.get_attr("explicit_paddings"))[2 * axis]
    reach = (kernel - 1) * dilation + 1
    total = max((-(-size // stride) - 1) * stride + reach - size, 0)
    return total // 2


def filter_gradient(op: Any, grad: tf.Tensor) -> tf.Tensor | None:
    """``dW`` of the depthwise convolution ``op`` against its output gradient ``grad`` as
    the module docstring writes it; None where that formula is not used (NCHW, unknown
    shapes, a type other than float32/float64).

    Every op of it but the product reads ``grad``, so a program cut after the forward
    (``split_programs.py``) computes all of it in the backward and keeps only ``x``, as for
    TensorFlow's own gradient: each tap places ``grad`` (spread by the strides) where its
    taps read ``x``, zeros elsewhere, and sums its product with the unpadded ``x``."""
    x, w = op.inputs[0], op.inputs[1]
    if _text(op, "data_format") != "NHWC" or x.dtype not in _DTYPES:
        return None
    if not (x.shape.is_fully_defined() and w.shape.is_fully_defined()):
        return None
    if not grad.shape.is_fully_defined():
        return None
    batch, height, width, channels = x.shape
    kh, kw, per_group, multiplier = w.shape
    if op.type == "Conv2D":  # depthwise only: one input channel per group, more than one group
        if per_group != 1 or channels == 1 or multiplier % channels:
            return None
        multiplier //= channels
    _, sh, sw, _ = op.get_attr("strides")
    _, dh, dw, _ = op.get_attr("dilations")
    top = _before(op, height, kh, sh, dh, 1)
    left = _before(op, width, kw, sw, dw, 2)
    _, out_h, out_w, _ = grad.shape
    spread = tf.reshape(grad, [batch, out_h, 1, out_w, 1, channels, multiplier])
    spread = tf.pad(spread, [[0, 0], [0, 0], [0, sh - 1], [0, 0], [0, sw - 1], [0, 0], [0, 0]])
    spread = tf.reshape(spread, [batch, out_h * sh, out_w * sw, channels, multiplier])
    spread = spread[:, : (out_h - 1) * sh + 1, : (out_w - 1) * sw + 1]  # dy[y, x] at y·s, x·s
    # Tap (i, j) reads x[Y, X] where dy[y, x] sits at Y = y·s_h + i·d_h - top: the spread
    # dy shifted by i·d_h - top. One frame, padded once, holds every shift; two gathers
    # take them all (one op each, not one per tap: XLA compiles a program of k² ops slowly).
    (front, back), starts_h = _frame(height, spread.shape[1], kh, dh, top)
    (left_pad, right_pad), starts_w = _frame(width, spread.shape[2], kw, dw, left)
    frame = tf.pad(spread, [[0, 0], [front, back], [left_pad, right_pad], [0, 0], [0, 0]])
    rows = [[a + y for y in range(height)] for a in starts_h]  # [kh, H]
    cols = [[b + x for x in range(width)] for b in starts_w]  # [kw, W]
    shifted = tf.gather(tf.gather(frame, rows, axis=1), cols, axis=3)  # [B, kh, H, kw, W, C, m]
    taps = tf.einsum("biyjxcq,byxc->ijcq", shifted, x)
    return tf.reshape(taps, w.shape)  # a Conv2D's output channel c·m + q: (c, q)


def _frame(size: int, length: int, kernel: int, dilation: int, before: int) -> tuple:
    """Along one spatial axis: the (front, back) zeros that put the spread output gradient
    (``length`` long) into a frame from which each tap's copy shifted by
    ``tap·dilation - before`` is the slice of ``size`` at the returned start."""
    shifts = [tap * dilation - before for tap in range(kernel)]
    front = max(max(shifts), 0)
    back = max(size - min(shifts) - length, 0)
    return (front, back), [front - shift for shift in shifts]


def _gradient(op: Any, grad: tf.Tensor) -> list[tf.Tensor]:
    """The op's input gradient as TensorFlow computes it, its filter gradient by
    :func:`filter_gradient` where that applies (else both TensorFlow's)."""
    cheap = filter_gradient(op, grad)
    if cheap is None:
        return list(_TENSORFLOWS[op.type](op, grad))
    attrs = {
        name: op.get_attr(name)
        for name in ("strides", "padding", "explicit_paddings", "data_format", "dilations")
    }
    backprop = (
        tf.raw_ops.Conv2DBackpropInput
        if op.type == "Conv2D"
        else tf.raw_ops.DepthwiseConv2dNativeBackpropInput
    )
    dx = backprop(
        input_sizes=tf.shape(op.inputs[0]), filter=op.inputs[1], out_backprop=grad, **attrs
    )
    return [dx, cheap]


@contextlib.contextmanager
def cheap_filter_gradients(enabled: bool = True) -> Iterator[None]:
    """While open (and ``enabled``), ``tape.gradient`` differentiates depthwise
    convolutions with :func:`filter_gradient`."""
    if not enabled:
        yield
        return
    entries = ops._gradient_registry._registry  # noqa: SLF001 - pinned by test_depthwise
    tag = registry._TYPE_TAG  # noqa: SLF001
    with _lock:
        if entries[OPS[0]][tag] is _gradient:  # already open
            yield
            return
        saved = {name: entries[name] for name in OPS}
        for name, entry in saved.items():
            entries[name] = {**entry, tag: _gradient}
        try:
            yield
        finally:
            entries.update(saved)
