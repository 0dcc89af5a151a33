"""The proof behind deferred weight gradients (``hybrid.engine.programs.row_sums``): a traced weight
program run once on M micro-batches' rows joined computes the sum of its M runs, or the
proof names what stops it; and ``deferral.run`` feeds it."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import hybrid
from hybrid.engine.programs import deferral, row_sums, shape_values, split_programs
from hybrid.engine.programs.residuals import Kept

ROWS, M, WIDTH = 4, 3, 5


def _joint(body, need_dx=True):
    """joint([x, w1, w2], [dy]) -> ([y], [dx, dw1, dw2]) for ``y = body(x, w1, w2)`` (no
    dx unless ``need_dx``: a first stage's)."""

    def joint(f_args, b_args):
        x, weights = f_args[0], f_args[1:]
        with tf.GradientTape() as tape:
            tape.watch([x] + weights)
            y = body(x, *weights)
        sources = ([x] if need_dx else []) + weights
        return [y], tape.gradient(y, sources, output_gradients=b_args[0])

    return joint


def _mlp(x, w1, w2):
    return tf.tanh(tf.nn.relu(x @ w1) @ w2)


def _batch_size_scaled(x, w1, w2):
    """A penalty divided by the batch size, as Keras divides an activity regularizer's."""
    h = x @ w1
    return tf.tanh(h @ w2) + tf.reduce_sum(h**2) / float(x.shape[0])


def _cross_row(x, w1, w2):
    """Every row sees the batch's mean: the rows are not independent."""
    h = tf.nn.relu(x @ w1)
    return (h - tf.reduce_mean(h, axis=0, keepdims=True)) @ w2


def _batch_mean(x, w1, w2):
    """A weight that only sees the batch's mean input."""
    return tf.tanh(x @ w1) + tf.reduce_mean(x, axis=0, keepdims=True) @ w2


def _traces(body, need_dx=True):
    """The programs at ROWS rows and at M × ROWS rows (the backward cut after dx when
    ``need_dx``), and M micro-batches' tensors."""
    weights = [tf.random.stateless_normal([WIDTH, WIDTH], seed=[i, 0]) for i in range(1, 3)]

    def trace(rows):
        specs = [tf.TensorSpec([rows, WIDTH])] + [tf.TensorSpec(w.shape) for w in weights]
        first = 1 if need_dx else None
        dys = [tf.TensorSpec([rows, WIDTH])]
        return split_programs.split(_joint(body, need_dx), specs, dys, [0], False, first)

    xs = [tf.random.stateless_normal([ROWS, WIDTH], seed=[10, m]) for m in range(M)]
    dys = [tf.random.stateless_normal([ROWS, WIDTH], seed=[20, m]) for m in range(M)]
    return trace(ROWS), trace(M * ROWS), weights, xs, dys


def _kept(micro, x, weights, dy, need_dx=True):
    args = [x] + weights
    _, residuals = micro.forward(args)
    kept = Kept(micro, args, residuals, need_dx, split=True)  # a split backward
    if need_dx:
        kept.backward([dy], [True], need_dx=True, need_dw=False)  # B: keeps what W reads
    return kept


def test_a_deferred_mlp_weight_gradient_is_the_sum_of_the_micro_batches():
    micro, full, weights, xs, dys = _traces(_mlp)
    plan = row_sums.plan(full, micro, M, [True, False, False], [True])
    assert isinstance(plan, row_sums.Plan), plan
    kept = [_kept(micro, x, weights, dy) for x, dy in zip(xs, dys, strict=True)]
    once = deferral.run(plan, full, kept, [[dy] for dy in dys])
    per_micro_batch = [
        k.backward([dy], [True], False, True)[1] for k, dy in zip(kept, dys, strict=True)
    ]
    summed = [sum(gs) for gs in zip(*per_micro_batch, strict=True)]
    assert len(once) == len(summed) == 2
    for got, want in zip(once, summed, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The same as one whole-batch backward (what plain Keras computes).
    whole = _joint(_mlp)([tf.concat(xs, 0)] + weights, [tf.concat(dys, 0)])[1][1:]
    for got, want in zip(once, whole, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The weights are passed once, the activations and gradients joined.
    assert plan.args == [True, False, False]
    assert plan.carried and all(joined for _, joined in plan.carried)
    assert any(joined for _, joined in plan.residuals)


@pytest.mark.parametrize(
    "body,need_dx,reason",
    [
        # In a first stage's W (no input gradient to carry): the rows meet.
        (_batch_size_scaled, False, "a value that depends on the batch size"),
        (_cross_row, False, "spreads a sum over the batch's rows"),
        # A weight gradient off the input gradient's path, from the batch's mean.
        (_batch_mean, True, "differs per micro-batch but is not per row"),
    ],
)
def test_a_weight_program_that_is_not_a_sum_over_rows_is_not_deferred(body, need_dx, reason):
    micro, full, weights, xs, dys = _traces(body, need_dx)
    plan = row_sums.plan(full, micro, M, [True, False, False], [True])
    assert isinstance(plan, str) and reason in plan, plan
    if need_dx:
        return  # (the mean is one row per micro-batch: W cannot even take them joined)
    # Deferred anyway, it would compute something else: the proof is needed.
    kept = [_kept(micro, x, weights, dy, need_dx) for x, dy in zip(xs, dys, strict=True)]
    runs = [k.backward([dy], [True], False, True)[1] for k, dy in zip(kept, dys, strict=True)]
    summed = [sum(gs) for gs in zip(*runs, strict=True)]
    forced = row_sums.Plan(
        [True, False, False],
        [(micro.residual_names.index(n), True) for n in full.weights.residuals],
        [True],
        [],
    )
    wrong = deferral.run(forced, full, kept, [[dy] for dy in dys])
    assert not all(np.allclose(g, w, rtol=1e-4) for g, w in zip(wrong, summed, strict=True))


def test_per_row_tensors_that_cross_rows_in_b_are_deferred_exactly():
    """A batch-mean or a 1 / b penalty on the input gradient's path is B's (carried to W
    per row): W stays a sum over rows and deferral is exact."""
    for body in (_cross_row, _batch_size_scaled):
        micro, full, weights, xs, dys = _traces(body)
        plan = row_sums.plan(full, micro, M, [True, False, False], [True])
        assert isinstance(plan, row_sums.Plan), plan
        kept = [_kept(micro, x, weights, dy) for x, dy in zip(xs, dys, strict=True)]
        once = deferral.run(plan, full, kept, [[dy] for dy in dys])
        runs = [k.backward([dy], [True], False, True)[1] for k, dy in zip(kept, dys, strict=True)]
        for got, want in zip(once, [sum(gs) for gs in zip(*runs, strict=True)], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _twins(template, micro_batches):
    """Two pipelines of copies of ``template`` (same weights) on 2 stages, one deferring
    its weight gradients: {deferred: pipeline}."""
    pipes = {}
    for defer in (False, True):
        twin = keras.models.clone_model(template)
        twin.set_weights(template.get_weights())
        pipes[defer] = hybrid.Pipeline(
            twin,
            mesh=hybrid.DeviceMesh.create(2, 1),
            micro_batches=micro_batches,
            balance=[2, 3],
            remat="never",
            defer_weight_gradients=defer,
        )
        pipes[defer].compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=False,
        )
    return pipes


def test_a_stage_whose_weight_program_is_not_a_sum_computes_it_per_micro_batch():
    """BatchNormalization normalizes each micro-batch by its own statistics, and its
    weight gradients read them (one row per micro-batch, not per example): the proof
    refuses, each stage warns and computes W per micro-batch, and the gradients are the
    undeferred pipeline's."""
    keras.utils.set_random_seed(0)
    template = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3),
        ]
    )
    x = np.random.default_rng(0).normal(size=(16, 6)).astype("float32")
    y = np.arange(16) % 3
    grads = {}
    for defer, pipe in _twins(template, 4).items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grads[defer] = pipe.gradients(x, y)
        said = [str(w.message) for w in caught if "per micro-batch, not once" in str(w.message)]
        states = [row[0].deferral for row in pipe.stages]
    assert sorted(m[:16] for m in said) == ["stage 0 computes", "stage 1 computes"], said
    assert all("differs per micro-batch but is not per row" in m for m in said), said
    assert all(isinstance(state, str) for state in states), states
    for got, want in zip(grads[True], grads[False], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_convolutional_model_defers_and_trains_as_keras_trains_it():
    """Convolutions (their filter gradient: a sum over the batch's rows, sizes from the
    joined input's shape), pooling and a skip, 2 stages × 4 micro-batches, weight
    gradients deferred on both stages: the losses and weights of plain Keras."""

    def build(seed):
        keras.utils.set_random_seed(seed)
        x_in = keras.Input((8, 8, 3))
        h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(x_in)
        r = keras.layers.Conv2D(4, 3, padding="same")(h)
        h = keras.layers.Add()([h, r])
        h = keras.layers.Conv2D(6, 3, strides=2, activation="relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
        return keras.Model(x_in, keras.layers.Dense(3)(h))

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = build(0)
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss)
    twin = build(1)
    twin.set_weights(reference.get_weights())
    pipe = hybrid.Pipeline(
        twin,
        mesh=hybrid.DeviceMesh.create(2, 1),
        micro_batches=4,
        schedule="1f1b",
        remat="never",
        defer_weight_gradients=True,
    )
    pipe.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss, jit_compile=False)
    rng = np.random.default_rng(0)
    for _ in range(2):
        x = rng.normal(size=(16, 8, 8, 3)).astype("float32")
        y = rng.integers(0, 3, size=(16,))
        want = reference.train_on_batch(x, y)
        np.testing.assert_allclose(pipe.train_step(x, y)["loss"], want, rtol=1e-5)
    assert all(isinstance(row[0].deferral, row_sums.Plan) for row in pipe.stages)
    for got, want in zip(pipe.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_dropout_masks_are_kept_per_micro_batch_and_deferral_is_exact():
    """A deferring stage keeps each micro-batch's Dropout mask (drawn from its seed) for the
    whole-batch W instead of drawing one mask for all rows: both stages defer, and the
    gradients are those of the undeferred pipeline (the same masks)."""
    keras.utils.set_random_seed(0)
    template = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.3, seed=1),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.3, seed=2),
            keras.layers.Dense(4),
        ]
    )
    x = np.random.default_rng(0).normal(size=(8, 8)).astype("float32")
    y = np.arange(8) % 4
    grads = {}
    for defer, pipe in _twins(template, 2).items():
        grads[defer] = pipe.gradients(x, y)
    assert all(isinstance(row[0].deferral, row_sums.Plan) for row in pipe.stages)
    for got, want in zip(grads[True], grads[False], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _plan_of(joint, rows):
    """``row_sums.plan`` of ``joint``'s backward (no input gradient: all of it is W) at
    ``rows`` and M × rows."""
    weights = [tf.TensorSpec([WIDTH, WIDTH]), tf.TensorSpec([WIDTH, WIDTH])]

    def trace(n):
        specs = [tf.TensorSpec([n, WIDTH])] + weights
        return split_programs.split(joint, specs, [tf.TensorSpec([n, WIDTH])], [0], False)

    return row_sums.plan(trace(M * rows), trace(rows), M, [True, False, False], [True])


def _rounded_gradient(f_args, b_args):
    """A hand-made W that casts a kernel gradient (a sum over rows) to integers."""
    x, w1, w2 = f_args
    y = x @ w1 @ w2
    dw1 = tf.cast(
        tf.cast(tf.matmul(x, b_args[0] @ tf.transpose(w2), transpose_a=True), "int32"), "float32"
    )
    return [y], [dw1, tf.zeros_like(w2)]


def _batch_picked_column(f_args, b_args):
    """A hand-made W that reads the column of the output gradient given by the batch size (1
    at 4 rows, 3 at 12 rows): the two traces pick other elements of every row."""
    x, w1, w2 = f_args
    column = min(x.shape[0] // 4, WIDTH - 1)
    dh = b_args[0] @ tf.transpose(w2)
    picked = tf.concat([tf.slice(dh, [0, column], [-1, 1])] * WIDTH, axis=1)
    return [x @ w1 @ w2], [tf.matmul(x, picked, transpose_a=True), tf.zeros_like(w2)]


def _float_range_column(f_args, b_args):
    """The column of the output gradient picked through a float ``Range`` of the batch size
    (column 1 at 4 rows, 2 at 12): a value that truncating the floats would call equal."""
    x, w1, w2 = f_args
    dh = b_args[0] @ tf.transpose(w2)
    start = 0.0625 * tf.cast(tf.shape(dh)[0], "float32") - 0.25
    column = tf.cast(tf.reduce_sum(tf.range(start, start + 2.0, 1.0)), "int32")
    picked = tf.strided_slice(dh, [0, column], [0, column + 1], [1, 1], begin_mask=1, end_mask=1)
    return [x @ w1 @ w2], [
        tf.matmul(x, tf.concat([picked] * WIDTH, 1), transpose_a=True),
        tf.zeros_like(w2),
    ]


@pytest.mark.parametrize(
    "joint,rows,reason",
    [
        # code that branches on the batch size: the two traces are two computations
        (
            _joint(
                lambda x, w1, w2: tf.nn.leaky_relu(x @ w1, 0.1 if x.shape[0] == 1 else 0.3) @ w2,
                False,
            ),
            1,
            "differs between the traces of the two sizes",
        ),
        # a per-row scalar [b] broadcast against [b, 3] lines b up with the last axis at b = 1
        (
            _joint(
                lambda x, w1, w2: ((x @ w1)[:, :M] * tf.tanh(tf.reduce_sum(x, 1))) @ w2[:M], False
            ),
            1,
            "broadcasts",
        ),
        # a sum cast to integers is not the sum of the casts
        (_rounded_gradient, 4, "Cast"),
        # the batch size as a slice's begin on the columns
        (_batch_picked_column, 4, "the batch size reaches more than the rows"),
        (_float_range_column, 4, "the batch size reaches more than the rows"),
    ],
)
def test_what_the_proof_must_not_accept(joint, rows, reason):
    """Programs a review found the first version of the proof accepted although their W
    over joined rows is not the sum of the micro-batches' (checked numerically then)."""
    found = _plan_of(joint, rows)
    assert isinstance(found, str) and reason in found, found


def test_shape_values_are_read_from_static_shapes_and_batch_sizes_only_in_the_rows():
    """The values row_sums compares: shapes rebuilt the way gradients rebuild them
    (``ShapeN``, a strided slice of a shape, ``ConcatOffset``), and the rule that a shape
    may differ between the traces in its first entry only, by the factor M."""
    made = {}

    @tf.function(autograph=False)
    def trace(x, y, free):
        made["rebuilt"] = tf.concat([[tf.size(x) // 35], tf.shape(x)[1:]], 0)
        shapes = tf.raw_ops.ShapeN(input=[x, y])
        made["offset"] = tf.raw_ops.ConcatOffset(concat_dim=1, shape=shapes)[1]
        made["axes"] = tf.raw_ops.BroadcastGradientArgs(s0=tf.shape(x), s1=tf.shape(y[0, :1]))[1]
        made["unknown"] = tf.shape(free)
        made["column"], made["other"] = tf.constant([0, 3]), tf.constant([0, 1])
        made["small"] = tf.constant([4, 5, 7])
        return x

    specs = [tf.TensorSpec([12, 5, 7]), tf.TensorSpec([12, 2, 7]), tf.TensorSpec([None, 5])]
    trace.get_concrete_function(*specs)
    np.testing.assert_array_equal(shape_values.value(made["rebuilt"]), [12, 5, 7])
    np.testing.assert_array_equal(shape_values.value(made["offset"]), [0, 5, 0])
    np.testing.assert_array_equal(shape_values.value(made["axes"]), [0, 1])
    assert shape_values.value(made["unknown"]) is None
    rebuilt, small, column = made["rebuilt"], made["small"], made["column"]
    assert shape_values.beyond_rows(rebuilt, small, 3, rows=True) is None
    assert "reaches more than the rows" in shape_values.beyond_rows(rebuilt, small, 3, False)
    assert "reaches more than the rows" in shape_values.beyond_rows(rebuilt, small, 2, True)
    assert shape_values.beyond_rows(column, column, 3, rows=False) is None
    assert "[0, 3] for the whole batch, [0, 1]" in shape_values.beyond_rows(
        column, made["other"], 3, rows=True
    )


def _long_shape_chain(f_args, b_args):
    """A reshape whose target went through 1500 additions: no recursion limit is hit."""
    x, w1, w2 = f_args
    dh = b_args[0] @ tf.transpose(w2)
    width = tf.shape(dh)[1]
    for _ in range(1500):
        width = width + 0
    dh = tf.reshape(dh, tf.stack([tf.shape(dh)[0], width]))
    return [x @ w1 @ w2], [tf.matmul(x, dh, transpose_a=True), tf.zeros_like(w2)]


def _broadcast_bias(x, w1, b):
    """A bias added across a broadcast axis: at one row per micro-batch the bias gradient
    sums axes [1] of [1, 2, 5] where the whole batch sums [0, 1] of [3, 2, 5]."""
    h = tf.reshape(x @ w1, [-1, 1, WIDTH]) * tf.ones([1, 2, 1])
    return tf.reduce_sum(h + tf.reshape(b, [1, 1, WIDTH]), 1)


@pytest.mark.parametrize("rows", [1, 2])
def test_programs_that_are_sums_are_proved_at_one_row_and_through_long_shape_chains(rows):
    """One row per micro-batch (where deferral saves the most) and a long chain of shape
    ops are still proved; each proof's W over joined rows is the sum of the micro-batches'."""
    cases = [(_long_shape_chain, [WIDTH, WIDTH]), (_joint(_broadcast_bias, False), [WIDTH])]
    for joint, bias in cases:
        shapes = [[WIDTH, WIDTH], bias]
        specs = [tf.TensorSpec(s) for s in shapes]

        def trace(n, joint=joint, specs=specs):
            inputs = [tf.TensorSpec([n, WIDTH]), *specs]
            return split_programs.split(joint, inputs, [tf.TensorSpec([n, WIDTH])], [0], False)

        found = row_sums.plan(trace(M * rows), trace(rows), M, [True, False, False], [True])
        assert isinstance(found, row_sums.Plan), found
        weights = [tf.random.stateless_normal(s, seed=[i, 1]) for i, s in enumerate(shapes)]
        xs = [tf.random.stateless_normal([rows, WIDTH], seed=[30, m]) for m in range(M)]
        dys = [tf.random.stateless_normal([rows, WIDTH], seed=[40, m]) for m in range(M)]
        whole = joint([tf.concat(xs, 0), *weights], [tf.concat(dys, 0)])[1]
        parts = [joint([x, *weights], [dy])[1] for x, dy in zip(xs, dys, strict=True)]
        for got, *each in zip(whole, *parts, strict=True):
            np.testing.assert_allclose(got, tf.add_n(each), rtol=1e-5, atol=1e-5)
