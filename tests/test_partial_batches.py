"""Partial batches (a batch that does not split into replicas × micro_batches equal parts)
are padded and the padding counts for nothing: per-token losses, 2-D sample weights and
masked tokens, against Keras's train_on_batch and fit on the real examples alone.

Found by a review: the per-example flag multiplied per-token values along the wrong axis
(a crash, or, when the sequence length equalled the micro-batch, a silently different
loss), and zero-filled padding made a fully masked example's mean 0/0 = NaN."""

from __future__ import annotations

import sys

import keras
import numpy as np
import pytest

import hybrid

import runner

SEQ, VOCAB, CLASSES = 5, 16, 4


def token_model(mask_zero: bool) -> keras.Model:
    """Per-token logits: labels of shape (batch, SEQ)."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=mask_zero)(ids)
    h = keras.layers.Dense(8, activation="tanh")(h)
    return keras.Model(ids, keras.layers.Dense(CLASSES)(h))


def pooled_model() -> keras.Model:
    """A masked mean over tokens: an all-zero example is fully masked (0 / 0)."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=True)(ids)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(8)(h))
    return keras.Model(ids, keras.layers.Dense(CLASSES)(h))


# Each model is built from one seed: the reference and the pipeline start equal.


def data(n: int, per_token: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, VOCAB, size=(n, SEQ)).astype("int32")
    x[:, -1] = 0  # a masked position in every example
    y = rng.integers(0, CLASSES, size=(n, SEQ) if per_token else (n,)).astype("int32")
    return x, y


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize(
    "name,build,per_token,weights,mesh",
    [
        ("per_token", lambda: token_model(False), True, False, (1, 2, 1)),
        ("per_token_mask", lambda: token_model(True), True, False, (2, 1, 2)),
        ("sample_weight_2d", lambda: token_model(False), True, True, (1, 2, 2)),
        ("masked_pool", pooled_model, False, False, (2, 2, 1)),
    ],
)
def test_a_padded_batch_steps_as_keras_on_the_real_examples(name, build, per_token, weights, mesh):
    """7 examples on R·M = 2 or 4 (and 5 with R·M = 4 and SEQ = 5: the micro-batch the
    length of the sequence)."""
    S, R, M = mesh
    batches = [data(7, per_token, 0), data(5 if R * M == 4 else 7, per_token, 1)]
    reference = build()
    reference.compile(keras.optimizers.Adam(1e-2), loss())
    pipe = hybrid.Pipeline(build(), mesh=hybrid.DeviceMesh.create(S, R), micro_batches=M)
    pipe.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss(), jit_compile=False)
    for x, y in batches:
        w = (np.arange(y.size).reshape(y.shape) % 3).astype("float32") if weights else None
        want = reference.train_on_batch(x, y, sample_weight=w)
        got = pipe.train_step(x, y, sample_weight=w)["loss"]
        np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(pipe.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6)


def test_fit_with_a_partial_last_batch_of_fully_masked_padding_is_finite():
    x, y = data(20, False)
    reference = pooled_model()
    reference.compile(keras.optimizers.Adam(1e-2), loss())
    want = reference.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"]
    pipe = hybrid.Pipeline(pooled_model(), mesh=hybrid.DeviceMesh.create(1, 1))
    pipe.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss(), jit_compile=False)
    got = pipe.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(
        pipe.evaluate(x, y, verbose=0), reference.evaluate(x, y, verbose=0), rtol=1e-5
    )


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
