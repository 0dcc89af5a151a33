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


def per_host_data(global_batch_size, input_context):
    """The same task read per host (``--data`` with an ``input_context`` parameter): input
    pipeline p makes the per-replica batches of its replicas (assumed contiguous: p·k ...
    p·k + k - 1, k = replicas / pipelines), each example generated from its index alone,
    so the joined global batch of step s is examples s·B ... s·B + B - 1 on any number of
    hosts."""
    rows = input_context.get_per_replica_batch_size(global_batch_size)
    k = input_context.num_replicas_in_sync // input_context.num_input_pipelines

    def element(e):
        replica = input_context.input_pipeline_id * k + e % k
        first = (e // k) * global_batch_size + replica * rows
        x = tf.map_fn(
            lambda i: tf.random.stateless_normal([FEATURES], tf.stack([i, 7])),
            first + tf.range(rows, dtype=tf.int64),
            fn_output_signature=tf.float32,
        )
        return x, tf.argmax(x[:, :3], axis=1)

    return tf.data.Dataset.range(1 << 40).map(element)


def gpt2():
    """A KerasHub task model (its backbone nested, token ids and a padding mask of open
    length), compiled with its loss."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32,
        max_sequence_length=8, dropout=0.0,
    )  # fmt: skip
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def tokens(global_batch_size):
    """Endless ({token_ids, padding_mask}, next tokens) batches of 8 tokens."""
    ids = np.random.default_rng(0).integers(1, 64, size=(256, 9)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((256, 8), "int32")}
    return tf.data.Dataset.from_tensor_slices((x, ids[:, 1:])).repeat().batch(global_batch_size)
