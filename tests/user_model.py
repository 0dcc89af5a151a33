"""A model and data of a user's own, for the launcher's --model and --data flags."""

import keras
import numpy as np
import tensorflow as tf

FEATURES = 12


def model():
    """A functional model with a skip connection, its loss and metrics."""
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    hidden = keras.layers.Add()([hidden, keras.layers.Dense(16, activation="tanh")(hidden)])
    return {
        "model": keras.Model(inputs, keras.layers.Dense(3)(hidden)),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "metrics": ["accuracy"],
    }


def chain():
    """A Sequential model compiled with its loss: a chain of layer calls, which the planner
    profiles (--mesh=auto, --dry_run)."""
    model = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
    )
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(global_batch_size):
    """Endless (x, y) global batches of a learnable task: the class of the largest of the
    first three features."""
    x = np.random.default_rng(0).normal(size=(1024, FEATURES)).astype("float32")
    y = np.argmax(x[:, :3], axis=1)
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch_size)
