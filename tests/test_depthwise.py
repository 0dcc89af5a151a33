"""Depthwise convolutions' filter gradients in XLA programs on a CPU
(``hybrid.engine.programs.depthwise``): TensorFlow's values, none of XLA:CPU's dense
C×C convolution, the same residuals, and a depthwise CNN on the mesh trained as Keras."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops

import hybrid
from hybrid.engine.programs import depthwise, split_programs

import runner

BACKPROP_FILTER = "DepthwiseConv2dNativeBackpropFilter"


def _op_types(fn, *args):
    return {op.type for op in fn.get_concrete_function(*args).graph.get_operations()}


def _gradients(cheap, strides, padding, dilations):
    def grads(x, w, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.depthwise_conv2d(x, w, strides, padding, dilations=dilations)
        with depthwise.cheap_filter_gradients(cheap):
            return tape.gradient(y, [x, w], output_gradients=dy)

    return tf.function(grads, jit_compile=True, autograph=False)


@pytest.mark.parametrize(
    "shape, kernel, multiplier, stride, dilation, padding",
    [
        ((2, 7, 7, 8), 3, 1, 1, 1, "SAME"),
        ((2, 8, 9, 8), 3, 2, 2, 1, "SAME"),  # strides, channel multiplier 2
        ((2, 9, 9, 4), 5, 1, 1, 2, "SAME"),  # dilations
        ((3, 10, 11, 6), 3, 3, 2, 1, "VALID"),
        ((2, 9, 8, 3), 3, 1, 2, 1, [[0, 0], [2, 0], [1, 3], [0, 0]]),  # explicit padding
        ((2, 2, 2, 8), 7, 1, 1, 1, "SAME"),  # a 7×7 filter on a 2×2 image (ConvNeXt's last)
    ],
)
def test_the_filter_gradient_is_tensorflows(shape, kernel, multiplier, stride, dilation, padding):
    x = tf.random.stateless_normal(shape, seed=[1, 2])
    w = tf.random.stateless_normal([kernel, kernel, shape[-1], multiplier], seed=[3, 4])
    y = tf.nn.depthwise_conv2d(x, w, [1, stride, stride, 1], padding, dilations=[dilation] * 2)
    dy = tf.random.stateless_normal(y.shape, seed=[5, 6])
    args = [1, stride, stride, 1], padding, [dilation] * 2
    want = _gradients(False, *args)(x, w, dy)
    got = _gradients(True, *args)(x, w, dy)
    np.testing.assert_array_equal(got[0], want[0])  # the input gradient is TensorFlow's own
    assert float(tf.reduce_max(tf.abs(want[1]))) > 1.0
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-4)
    # XLA:CPU's dense C×C convolution is gone from the cheap program, not from the other.
    assert BACKPROP_FILTER in _op_types(_gradients(False, *args), x, w, dy)
    assert BACKPROP_FILTER not in _op_types(_gradients(True, *args), x, w, dy)


def _conv_gradients(cheap):
    def grads(x, w, dy):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.nn.conv2d(x, w, [1, 1, 1, 1], "SAME")
        with depthwise.cheap_filter_gradients(cheap):
            return tape.gradient(y, [x, w], output_gradients=dy)

    return tf.function(grads, jit_compile=True, autograph=False)


@pytest.mark.parametrize(
    "in_channels, per_group, out_channels, cheap",
    [
        (6, 1, 12, True),  # Conv2D(groups=6): depthwise with multiplier 2
        (6, 1, 6, True),
        (6, 2, 6, False),  # two channels per group: TensorFlow's gradient
        (6, 6, 4, False),  # an ordinary convolution
        (1, 1, 4, False),  # one input channel: an ordinary convolution too
    ],
)
def test_a_conv2d_with_one_channel_per_group_is_depthwise(
    in_channels, per_group, out_channels, cheap
):
    x = tf.random.stateless_normal([2, 5, 5, in_channels], seed=[1, 2])
    w = tf.random.stateless_normal([3, 3, per_group, out_channels], seed=[3, 4])
    dy = tf.random.stateless_normal([2, 5, 5, out_channels], seed=[5, 6])
    want = _conv_gradients(False)(x, w, dy)
    got = _conv_gradients(True)(x, w, dy)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-4)
    found = _op_types(_conv_gradients(True), x, w, dy)
    assert ("Conv2DBackpropFilter" not in found) == cheap, found


def test_half_precision_keeps_tensorflows_gradient():
    x = tf.random.stateless_normal([2, 6, 6, 4], seed=[1, 2], dtype=tf.float16)
    w = tf.random.stateless_normal([3, 3, 4, 1], seed=[3, 4], dtype=tf.float16)
    dy = tf.ones([2, 6, 6, 4], tf.float16)
    assert BACKPROP_FILTER in _op_types(_gradients(True, [1] * 4, "SAME", [1, 1]), x, w, dy)


def test_the_context_swaps_tensorflows_registry_entry_and_restores_it():
    # Pins the TensorFlow internals the module relies on (the gradient registry's entries).
    original = ops._gradient_registry.lookup(depthwise.OPS[0])
    with depthwise.cheap_filter_gradients():
        inside = ops._gradient_registry.lookup(depthwise.OPS[0])
        assert inside is not original
        assert ops._gradient_registry.lookup(depthwise.OPS[1]) is not original
        with depthwise.cheap_filter_gradients():  # nested: the same, and still open after
            assert ops._gradient_registry.lookup(depthwise.OPS[0]) is inside
        assert ops._gradient_registry.lookup(depthwise.OPS[0]) is inside
    assert ops._gradient_registry.lookup(depthwise.OPS[0]) is original
    with depthwise.cheap_filter_gradients(enabled=False):
        assert ops._gradient_registry.lookup(depthwise.OPS[0]) is original
    with pytest.raises(RuntimeError), depthwise.cheap_filter_gradients():
        raise RuntimeError("restored on errors too")
    assert ops._gradient_registry.lookup(depthwise.OPS[0]) is original


def test_a_cut_program_keeps_the_same_residuals_as_with_tensorflows_gradient():
    """Every op of the cheap filter gradient but its product reads the output gradient, so
    the forward of a cut program hands over what it hands over with TensorFlow's gradient."""
    x = tf.random.stateless_normal([4, 6, 6, 8], seed=[1, 2])
    w = tf.random.stateless_normal([3, 3, 8, 1], seed=[3, 4])
    dy = tf.ones([4, 3, 3, 8])

    def joint(cheap):
        def computation(f_args, b_args):
            x, w = f_args
            with tf.GradientTape() as tape:
                tape.watch([x, w])
                y = tf.nn.relu(tf.nn.depthwise_conv2d(x, w, [1, 2, 2, 1], "SAME"))
            with depthwise.cheap_filter_gradients(cheap):
                grads = tape.gradient(y, [x, w], output_gradients=b_args[0])
            return [y], grads

        return computation

    shapes = {}
    for cheap in (False, True):
        cut = split_programs.split(joint(cheap), [x, w], [dy], [0], True)
        shapes[cheap] = sorted(tuple(r.shape) for r in cut.forward([x, w])[1])
        grads = cut.backward([x, w], cut.forward([x, w])[1], [dy])
        want = joint(False)([x, w], [dy])[1]
        np.testing.assert_allclose(grads[1], want[1], rtol=1e-5, atol=1e-5)
    assert shapes[True] == shapes[False], shapes


def _depthwise_cnn():
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [
            keras.Input((10, 10, 3)),
            keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
            keras.layers.DepthwiseConv2D(3, strides=2, depth_multiplier=2, padding="same"),
            keras.layers.ReLU(),
            keras.layers.SeparableConv2D(12, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(12, 3, padding="same", groups=12),  # ConvNeXt's depthwise
            keras.layers.DepthwiseConv2D(5, padding="same"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ]
    )


@pytest.mark.parametrize("remat", ["never", "always"])
def test_a_depthwise_cnn_on_the_mesh_trains_as_keras_with_xla(remat):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 10, 10, 3)).astype("float32")
    y = rng.integers(0, 4, size=(16,)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = _depthwise_cnn()
    start = reference.get_weights()
    reference.compile(keras.optimizers.Adam(1e-2), loss, jit_compile=True)
    model = _depthwise_cnn()
    model.set_weights(start)
    pipe = hybrid.Pipeline(
        model, hybrid.DeviceMesh.create(2, 1), micro_batches=2, schedule="1f1b", remat=remat
    )
    pipe.compile(keras.optimizers.Adam(1e-2), loss, jit_compile=True)
    for _ in range(2):
        want = reference.train_on_batch(x, y, return_dict=True)
        got = pipe.train_step(x, y)
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    moved = max(np.abs(a - b).max() for a, b in zip(reference.get_weights(), start, strict=True))
    assert moved > 1e-3
    # Adam moves a weight whose gradient is near 0 by ~its learning rate whatever that
    # gradient's rounding: the tolerance of test_model_zoo's comparisons.
    for g, w in zip(pipe.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-3 * moved + 1e-6)
    # The stage programs computed no filter gradient the dense way.
    found = set()
    for row in pipe.stages:
        for program in row[0].traced_programs():
            if isinstance(program, split_programs.SplitPrograms):
                found |= {op.type for op in program.weights.graph.get_operations()}
            else:
                for concrete in program.concrete_functions():
                    found |= {op.type for op in concrete.graph.get_operations()}
    assert {"DepthwiseConv2dNative", "Conv2D"} <= found
    assert BACKPROP_FILTER not in found
    assert "Conv2DBackpropFilter" in found  # the ordinary convolution's


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
