"""Reference models: each cuts into stages and trains exactly like the unpipelined model."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import hybrid
from hybrid import models

import reference
import runner

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def transformer():
    layers = models.transformer(seq_len=8, d_model=16, num_heads=2, num_blocks=2)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (8, 8)).astype("int32")
    return layers, x, np.roll(x, -1, axis=1)


def resnet():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6, 6, 3)).astype("float32")
    return models.resnet(10, width=4, num_blocks=2), x, rng.integers(0, 10, (8,)).astype("int32")


def mlp():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5)).astype("float32")
    return models.mlp(10, width=8, depth=2), x, rng.integers(0, 10, (8,)).astype("int32")


@pytest.mark.parametrize("make", [transformer, resnet, mlp], ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", [(2, 2), (3, 1)])
def test_pipelined_model_matches_the_unpipelined_one(make, shape):
    layers, x, y = make()
    pipe = hybrid.Pipeline(
        layers, mesh=hybrid.DeviceMesh.create(*shape), micro_batches=2, schedule="1f1b"
    )
    pipe.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS, jit_compile=False)
    pipe.build((None, *x.shape[1:]), x.dtype.name)
    twins, _, _ = make()  # same seeds: same initial weights, checked below
    single = keras.Sequential([keras.Input(x.shape[1:], dtype=x.dtype.name), *twins])
    reference.assert_weights_close(pipe.get_weights(), single.get_weights(), rtol=0, atol=0)
    with tf.GradientTape() as tape:
        loss = LOSS(y, single(x, training=True))
    expected = [
        tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, single.trainable_variables)
    ]
    reference.assert_weights_close(pipe.gradients(x, y), expected, rtol=1e-5, atol=1e-6)
    first = pipe.train_step(x, y)["loss"]
    np.testing.assert_allclose(first, float(loss), rtol=1e-5)
    for _ in range(3):
        last = pipe.train_step(x, y)["loss"]
    assert last < first  # the same batch again: the loss must fall


def small_transformer(**kwargs):
    return models.transformer(seq_len=8, d_model=16, num_heads=2, num_blocks=2, **kwargs)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_transformer_graph_spells_out_the_layer_list(tie):
    _, x, _ = transformer()
    chain = keras.Sequential(
        [keras.Input((8,), dtype="int32"), *small_transformer(tie_embeddings=tie)]
    )
    graph = small_transformer(tie_embeddings=tie, graph=True)  # same seeds, same weights
    assert (
        len(graph.get_weights()) == len(chain.get_weights()) == (36 if tie else 38)
    )  # tied: no head kernel, bias
    assert len(graph.layers) > 2 * len(chain.layers)  # blocks called sublayer by sublayer
    np.testing.assert_allclose(graph(x), chain(x), atol=1e-5)


def test_tied_transformer_graph_trains_as_keras_with_cuts_inside_blocks():
    _, x, y = transformer()
    keras_model = small_transformer(tie_embeddings=True, graph=True)
    keras_model.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9), loss=LOSS)
    pipe = hybrid.Pipeline(
        small_transformer(tie_embeddings=True, graph=True),
        mesh=hybrid.DeviceMesh.create(3, 1),
        micro_batches=2,
        schedule="1f1b",
        balance=[3, 8, 6],
    )
    pipe.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9), loss=LOSS, jit_compile=False)
    for _ in range(2):
        np.testing.assert_allclose(
            pipe.train_step(x, y)["loss"], keras_model.train_on_batch(x, y), rtol=1e-5
        )
    reference.assert_weights_close(pipe.get_weights(), keras_model.get_weights())


def test_catalog_counts_the_layers_without_building():
    assert models.num_layers("transformer", 4) == len(models.transformer(num_blocks=4)) == 7
    assert models.num_layers("resnet", 3) == len(models.resnet(num_blocks=3)) == 6
    assert models.num_layers("mlp", 2) == len(models.mlp(depth=2)) == 7
    with pytest.raises(ValueError, match="unknown model 'gpt'; choose one of"):
        models.num_layers("gpt", 1)


def test_bad_transformer_width_is_refused():
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by num_heads \(4\)"):
        models.transformer(d_model=30, num_heads=4)


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
