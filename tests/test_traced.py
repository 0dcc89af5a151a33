"""``hybrid.engine.traced.Traced``: a graph function called as its concrete function per input
signature gives what the ``tf.function`` gives, traces once per signature (Python constants
and keyword constants included), passes anything else to the ``tf.function``, and warns of a
function that keeps retracing. It calls TensorFlow's private ``ConcreteFunction._call_flat``:
these tests pin it."""

import sys

import numpy as np
import tensorflow as tf

from hybrid.engine.traced import RETRACING_WINDOW, Keyed, Traced, signature

import runner


def affine(parts, scale=1.0, training=False):
    xs, (w, b) = parts
    out = [x @ w + b for x in xs]
    return [o * scale if training else o for o in out]


def test_calls_give_the_functions_values_eagerly_and_inside_a_trace():
    program = Traced(affine)
    w, b = tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([0.5, -0.5])
    xs = [tf.constant([[1.0, 0.0]]), tf.constant([[0.0, 1.0]])]
    want = [x.numpy() @ w.numpy() + b.numpy() for x in xs]
    for got in (program((xs, (w, b))), tf.function(lambda: program((xs, (w, b))))()):
        for g, expected in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, expected)
    doubled = program((xs, (w, b)), 2.0, training=True)
    np.testing.assert_array_equal(doubled[0], 2.0 * want[0])
    # one trace per signature: the tensors' shapes and dtypes, the structure, the constants
    assert program.experimental_get_tracing_count() == 2
    program((xs, (w, b)))
    program(([tf.constant([[5.0, 5.0]])] * 2, (w, b)))
    assert program.experimental_get_tracing_count() == 2
    program(([tf.constant([[5.0, 5.0], [1.0, 1.0]])] * 2, (w, b)))
    assert program.experimental_get_tracing_count() == 3
    assert len(program.concrete_functions()) == 3


def test_a_keyed_list_is_called_as_the_plain_list_without_walking_it_again():
    """A :class:`Keyed` list (what the feeding thread makes of a batch) has the plain list's
    signature, calls the same trace with the same tensors, and is read from its key."""
    program = Traced(lambda parts: [x @ w for x, w in parts])
    w = tf.constant([[1.0], [2.0]])
    items = [(tf.constant([[1.0, 1.0]]), w), (tf.constant([[0.0, 3.0]]), w)]
    keyed = Keyed(items)
    assert signature(keyed) == signature(items) and type(keyed) is Keyed
    want = program(items)
    got = program(keyed)
    assert program.experimental_get_tracing_count() == 1
    np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))  # [[3], [6]]
    keyed.key = signature([items[0]])  # what it says it is counts, not what it holds
    assert signature(keyed) == signature([items[0]])


def test_other_arguments_go_to_the_tf_function():
    v = tf.Variable([1.0, 2.0])
    program = Traced(lambda variable, x: variable.assign_add(x))
    program(v, tf.constant([1.0, 1.0]))
    np.testing.assert_array_equal(v.numpy(), [2.0, 3.0])


def test_a_function_that_keeps_retracing_warns(caplog):
    program = Traced(lambda x: x + 1)
    for _ in range(3 * RETRACING_WINDOW):  # one signature: never retraced
        program(tf.zeros([2]))
    assert "retracing" not in caplog.text
    for size in range(RETRACING_WINDOW // 2):
        program(tf.zeros([3 + size]))
    assert "triggered tf.function retracing" in caplog.text


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
