"""Per-host input: ``Pipeline.distribute_datasets_from_function`` trains as plain Keras trains
on the same global batches (the replicas' elements joined in replica order).

In one process the mesh has one input host; ``tests/test_multihost.py`` runs two, each
feeding its own replicas on its own CPU.
"""

import sys

import numpy as np
import pytest
import tensorflow as tf
from test_fit import adam_moments, assert_history_equal, pair

from hybrid.engine.api.per_host import input_hosts

import reference as ref
import runner

R, PER_REPLICA = 2, 8
GLOBAL = R * PER_REPLICA


def examples(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, ref.IN_FEATURES)).astype("float32")
    y = (x[:, :2].sum(axis=1) > 0).astype("float32")[:, None]
    w = rng.uniform(0.5, 2.0, size=n).astype("float32")
    return x, y, w


def dataset_fn(context: tf.distribute.InputContext, n=96, weighted=True, seed=0):
    """Each pipeline's shard of the examples in per-replica batches (TensorFlow's idiom)."""
    x, y, w = examples(n, seed)
    data = tf.data.Dataset.from_tensor_slices((x, y, w) if weighted else (x, y))
    data = data.shard(context.num_input_pipelines, context.input_pipeline_id)
    return data.batch(context.get_per_replica_batch_size(GLOBAL), drop_remainder=True)


def joined(context_fn, n=96, weighted=True, seed=0):
    """The global batches a one-host mesh trains on, stacked: ``[steps, R × rows, ...]``
    per tensor (R consecutive elements joined)."""
    elements = list(context_fn(tf.distribute.InputContext(1, 0, R), n, weighted, seed))
    steps = len(elements) // R
    return tuple(
        np.stack(
            [np.concatenate([e[k] for e in elements[s * R : (s + 1) * R]]) for s in range(steps)]
        )
        for k in range(len(elements[0]))
    )


@pytest.mark.parametrize("stages,micro_batches,prefetch", [(2, 2, 2), (1, 4, 0)])
def test_fit_and_evaluate_on_per_host_datasets_match_keras(stages, micro_batches, prefetch):
    keras_model, pipe = pair(stages, R, micro_batches, prefetch=prefetch)
    train = pipe.distribute_datasets_from_function(dataset_fn)
    assert train.global_batch == GLOBAL and len(train.hosts) == 1  # one process: one host
    validation = pipe.distribute_datasets_from_function(
        lambda c: dataset_fn(c, n=32, weighted=False, seed=1)
    )
    got = pipe.fit(train, epochs=2, validation_data=validation, verbose=0).history

    val_x, val_y = (np.concatenate(t) for t in joined(dataset_fn, 32, False, 1))
    want = keras_model.fit(
        tf.data.Dataset.from_tensor_slices(joined(dataset_fn)), epochs=2,
        validation_data=(val_x, val_y), validation_batch_size=GLOBAL, shuffle=False, verbose=0,
    ).history  # fmt: skip
    assert_history_equal(got, want)
    assert int(pipe.optimizer.iterations.numpy()) == 2 * 6  # 96 examples, 16 a step
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())
    stage_optimizers = [row[0].optimizer for row in pipe.stages]
    ref.assert_weights_close(adam_moments(stage_optimizers), adam_moments([keras_model.optimizer]))
    np.testing.assert_allclose(
        pipe.evaluate(validation, verbose=0),
        keras_model.evaluate(val_x, val_y, batch_size=GLOBAL, verbose=0),
        rtol=1e-5,
    )


def test_an_endless_dataset_runs_steps_per_epoch_and_keeps_its_place():
    keras_model, pipe = pair(2, R, 2, prefetch=1)
    train = pipe.distribute_datasets_from_function(lambda c: dataset_fn(c).repeat())
    pipe.fit(train, epochs=3, steps_per_epoch=4, verbose=0)  # 12 steps: 2 passes over 6
    xs, ys, ws = joined(dataset_fn)
    for step in list(range(len(xs))) * 2:
        keras_model.train_on_batch(xs[step], ys[step], sample_weight=ws[step])
    ref.assert_weights_close(pipe.get_weights(), keras_model.get_weights())


def test_bad_datasets_and_arguments_are_refused():
    _, pipe = pair(2, R, 2, prefetch=0)
    with pytest.raises(ValueError, match="dataset_fn returned list for input pipeline 0"):
        pipe.distribute_datasets_from_function(lambda c: [1, 2])
    with pytest.raises(ValueError, match=r"batch dimensions are \['None'\].*drop_remainder=True"):
        pipe.distribute_datasets_from_function(
            lambda c: tf.data.Dataset.from_tensor_slices(examples()[:2]).batch(8)
        )
    train = pipe.distribute_datasets_from_function(dataset_fn)
    with pytest.raises(ValueError, match="fit: a per-host dataset yields its own labels"):
        pipe.fit(train, np.zeros(3))
    with pytest.raises(ValueError, match="predict reads its inputs on the client"):
        pipe.predict(train)
    odd = pipe.distribute_datasets_from_function(  # 2 × 3 = 6 rows a step, M = 2 per replica
        lambda c: tf.data.Dataset.from_tensor_slices(examples()).batch(3, drop_remainder=True)
    )
    with pytest.raises(ValueError, match="batch of 3 rows does not split into micro_batches=2"):
        pipe.fit(odd, verbose=0)
    wide = pipe.distribute_datasets_from_function(  # built by the first fit for 8 features
        lambda c: tf.data.Dataset.from_tensor_slices(
            (np.zeros((16, 5), "float32"), np.zeros((16, 1), "float32"))
        ).batch(4, drop_remainder=True)
    )
    with pytest.raises(ValueError, match=r"built for inputs .* \[\(\(8,\), 'float32'\)\]; the "):
        pipe.fit(wide, verbose=0)


def test_input_hosts_are_the_tasks_of_the_first_stages_in_replica_order():
    firsts = [
        "/job:worker/replica:0/task:1/device:CPU:0",
        "/job:worker/replica:0/task:0/device:CPU:1",
        "/job:worker/replica:0/task:1/device:CPU:1",
    ]
    assert input_hosts(firsts) == [
        ("/job:worker/replica:0/task:1/device:CPU:0", [0, 2]),
        ("/job:worker/replica:0/task:0/device:CPU:0", [1]),
    ]


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
