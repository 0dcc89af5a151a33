"""A traced forward + backward cut into two programs
(``hybrid.engine.programs.split_programs``), and the stages that keep activations with it
(``remat="never"``)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from hybrid.engine.programs import split_programs

import reference as ref


def _dense_joint(model):
    """joint([x, *weights], [dy, *sums]) -> ([y], [dx, *(sums + dW)]) for ``model``."""

    def joint(f_args, b_args):
        x, weights = f_args[0], f_args[1:]
        dy, sums = b_args[0], b_args[1:]
        mapping = list(zip(model.trainable_variables, weights, strict=True))
        with tf.GradientTape() as tape:
            tape.watch([x] + weights)
            with keras.StatelessScope(state_mapping=mapping):
                y = model(x, training=True)
        grads = tape.gradient(y, [x] + weights, output_gradients=dy)
        return [y], [grads[0]] + [s + g for s, g in zip(sums, grads[1:], strict=True)]

    return joint


@pytest.mark.parametrize("jit_compile", [False, True])
def test_the_cut_computes_the_joint_and_keeps_only_activations(jit_compile):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="relu", dtype="mixed_float16"),
            keras.layers.Dense(5),
        ]
    )
    weights = [tf.convert_to_tensor(v) for v in model.trainable_variables]
    x = tf.random.stateless_normal([6, 12], seed=[1, 2])
    dy = tf.random.stateless_normal([6, 5], seed=[3, 4])
    sums = [tf.ones_like(w) for w in weights]
    joint = _dense_joint(model)
    programs = split_programs.split(joint, [x] + weights, [dy] + sums, [0], jit_compile)

    out, residuals = programs.forward([x] + weights)
    grads = programs.backward([x] + weights, residuals, [dy] + sums)

    # The forward hands over activations only: never an input (x, a weight) copied out.
    shapes = sorted(tuple(r.shape) for r in residuals)
    assert all(s[0] == 6 for s in shapes), shapes
    assert len(residuals) <= 3, shapes
    # The same numbers as the joint computation (the float16 kernel cast again, not stored).
    want_out, want_grads = joint([x] + weights, [dy] + sums)
    np.testing.assert_allclose(out[0], want_out[0], rtol=1e-6, atol=1e-6)
    assert len(grads) == len(want_grads) == 1 + len(weights)
    for got, want in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _matmuls(program, *args):
    """How many MatMul ops the traced ``program(*args)`` runs."""
    graph = program.get_concrete_function(*args).graph
    return sum(op.type == "MatMul" for op in graph.get_operations())


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_split_backward_runs_each_gradient_op_once(jit_compile):
    """Cut after its input gradient, the backward's B computes dx (one MatMul per layer)
    and W the weight gradients (one MatMul per layer) from what B carried over: the same
    numbers as the whole backward, and no op of B again in W."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(5),
        ]
    )
    weights = [tf.convert_to_tensor(v) for v in model.trainable_variables]
    x = tf.random.stateless_normal([6, 12], seed=[1, 2])
    dy = tf.random.stateless_normal([6, 5], seed=[3, 4])
    sums = [tf.ones_like(w) for w in weights]
    programs = split_programs.split(
        _dense_joint(model), [x] + weights, [dy] + sums, [0], jit_compile, first=1
    )
    assert programs.cut_backward
    args = [x] + weights
    _, residuals = programs.forward(args)
    whole = programs.backward(args, residuals, [dy] + sums)
    dx, carried = programs.input_backward(args, residuals, [dy] + sums)
    dw = programs.weight_backward(args, residuals, [dy] + sums, carried)
    assert len(dx) == 1 and len(dw) == len(weights)
    for got, want in zip(dx + dw, whole, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # B: dx through 3 layers; W: dW of 3 layers; the whole backward: both, nothing twice.
    b_args = (args, residuals, [dy] + sums)
    assert _matmuls(programs._parts[0], *b_args) == 3
    assert _matmuls(programs._parts[1], *b_args, carried) == 3
    assert _matmuls(programs._backward, *b_args) == 6
    # The uncut programs have no parts.
    assert not split_programs.split(_dense_joint(model), args, [dy] + sums, [0], False).cut_backward


def test_an_input_passed_through_and_a_gradient_the_output_does_not_reach():
    """A forward output that is one of its inputs (a skip tensor carried through a stage)
    comes back as it is; a weight that does not reach the output has a zero gradient (a
    forward value the backward returns as it is)."""

    def joint(f_args, b_args):
        x, w, unused = f_args
        with tf.GradientTape() as tape:
            tape.watch([w, unused])
            y = tf.matmul(x, w)
        dw, du = tape.gradient(y, [w, unused], output_gradients=b_args[0])
        return [y, x], [dw, tf.zeros_like(unused) if du is None else du]

    x, w, unused = tf.ones([2, 3]), tf.ones([3, 4]), tf.ones([5])
    programs = split_programs.split(joint, [x, w, unused], [tf.ones([2, 4])], [0], True)
    out, residuals = programs.forward([x, w, unused])
    np.testing.assert_array_equal(out[1], x)
    dw, du = programs.backward([x, w, unused], residuals, [tf.ones([2, 4])])
    np.testing.assert_array_equal(dw, np.full([3, 4], 2.0))
    np.testing.assert_array_equal(du, np.zeros([5]))


def test_a_gradient_that_is_the_output_gradient_itself():
    """y = x + b: both gradients are the output gradient, an argument of the backward."""

    def joint(f_args, b_args):
        x, b = f_args
        with tf.GradientTape() as tape:
            tape.watch([x, b])
            y = x + b
        return [y], tape.gradient(y, [x, b], output_gradients=b_args[0])

    x, b, dy = tf.ones([3]), tf.zeros([3]), tf.constant([1.0, 2.0, 3.0])
    programs = split_programs.split(joint, [x, b], [dy], [0], True)
    out, residuals = programs.forward([x, b])
    assert residuals == []
    for grad in programs.backward([x, b], residuals, [dy]):
        np.testing.assert_array_equal(grad, dy)


def test_a_forward_output_that_needs_the_output_gradient_is_refused():
    def joint(f_args, b_args):
        return [f_args[0] * b_args[0]], [b_args[0]]

    with pytest.raises(ValueError, match="depends on a backward argument"):
        split_programs.split(joint, [tf.ones([2])], [tf.ones([2])], [0], False)


def test_stage_zero_keeps_no_weight_and_computes_no_input_gradient():
    pipe = ref.pipeline(2, 1, micro_batches=2, remat="never", jit_compile=False)
    pipe.build((None, ref.IN_FEATURES))
    stage = pipe.stages[0][0]
    x = tf.zeros([4, ref.IN_FEATURES])
    seed = tf.constant([0, 0], tf.int64)

    found = {}

    @tf.function(autograph=False)
    def run():
        saved = stage.forward([x], None, seed, remat=False, split=False, need_dx=False)
        dys = [tf.ones_like(y) for y in saved.output]
        found["kept"] = saved.kept
        found["dx"], dw = stage.backward(saved, dys, need_dx=False, need_dw=True)
        return dw

    dw = run()
    kept = found["kept"]
    weight_shapes = {tuple(v.shape) for v in stage.trainable_variables}
    assert not weight_shapes & {tuple(r.shape) for r in kept.residuals}
    assert found["dx"] is None and len(dw) == len(stage.trainable_variables)
    assert not kept.need_dx

    @tf.function(autograph=False)
    def asks_for_dx():
        saved = stage.forward([x], None, seed, remat=False, split=False, need_dx=False)
        stage.backward(saved, [tf.ones_like(y) for y in saved.output], True, True)

    with pytest.raises(ValueError, match="need_dx=False"):
        asks_for_dx()
