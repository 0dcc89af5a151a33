"""What carrying an Embedding's gradient as IndexedSlices costs and saves: a language model
with a --vocab-row token embedding, its step with the gradient applied as Keras applies it
(sparse: each micro-batch's slices joined, gathered across replicas, the optimizer's sparse
update) against the same pipeline with the gradient densified (vocab × d summed per
micro-batch and all-reduced: the engine before sparse gradients, and what a dense-only
framework does), and plain Keras on one device (sparse, XLA), timed in alternation.

    model: Embedding(vocab, d) → --depth × Dense(d, gelu) → Dense(--head) logits per token
    python benchmarks/sparse_embedding.py [--vocab=32000] [--stages=2 --replicas=2]

The densified pipeline is not Keras's update (Adam squares each slice): it is here only as
the cost that sparse gradients replace. Reported: ms per step, and the bytes of embedding
gradient each replica group exchanges per step (dense: vocab × d × 4; sparse: tokens × (d + 1)
× 4 for each replica's share).
"""

from __future__ import annotations

from typing import Any

from absl import app, flags

import common

flags.DEFINE_integer("vocab", 32000, "Embedding rows.")
flags.DEFINE_integer("d_model", 128, "Embedding width and Dense width.")
flags.DEFINE_integer("depth", 2, "Dense layers after the embedding.")
flags.DEFINE_integer(
    "head", 256, "Output classes per token (a small head keeps the step about the embedding)."
)
flags.DEFINE_integer("seq_len", 32, "Tokens per example.")
flags.DEFINE_integer("batch", 32, "Global batch.")
flags.DEFINE_integer("stages", 2, "Pipeline stages.")
flags.DEFINE_integer("replicas", 2, "Data-parallel replicas.")
flags.DEFINE_integer("micro_batches", 2, "Micro-batches.")
common.define_timing_flags(rounds=5, steps_per_round=3)
FLAGS = flags.FLAGS


def build_model(seed: int = 0) -> Any:
    import keras

    keras.utils.set_random_seed(seed)
    ids = keras.Input((FLAGS.seq_len,), dtype="int32")
    h = keras.layers.Embedding(FLAGS.vocab, FLAGS.d_model, name="tokens")(ids)
    for _ in range(FLAGS.depth):
        h = keras.layers.Dense(FLAGS.d_model, activation="gelu")(h)
    return keras.Model(ids, keras.layers.Dense(FLAGS.head)(h))


def pipeline(dense: bool) -> Any:
    """The model on the mesh; ``dense``: its embedding's gradient densified (the probe that
    finds sparse gradients answers 'none')."""
    import keras

    import hybrid
    from hybrid.engine.model import sparse
    from hybrid.engine.step import assembly

    found = sparse.gradient_kinds
    if dense:  # no variable sparse; the unused ones as found
        assembly.sparse.gradient_kinds = lambda *args: (set(), found(*args)[1])  # type: ignore[attr-defined]
    try:
        pipe = hybrid.Pipeline(
            build_model(),
            mesh=hybrid.DeviceMesh.create(FLAGS.stages, FLAGS.replicas),
            micro_batches=FLAGS.micro_batches,
        )
        pipe.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        pipe.build((None, FLAGS.seq_len), "int32")
    finally:
        assembly.sparse.gradient_kinds = found  # type: ignore[attr-defined]
    return pipe


def main(argv: list[str]) -> None:
    del argv
    env = common.start("sparse_embedding", devices=FLAGS.stages * FLAGS.replicas)
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, FLAGS.vocab, size=(FLAGS.batch, FLAGS.seq_len)).astype("int32")
    y = rng.integers(0, FLAGS.head, size=(FLAGS.batch, FLAGS.seq_len)).astype("int32")
    reference = build_model()
    reference.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    sparse_pipe, dense_pipe = pipeline(dense=False), pipeline(dense=True)
    assert any(sparse_pipe.stages[0][0].sparse) and not any(dense_pipe.stages[0][0].sparse)
    candidates = {
        "keras_one_device": lambda: reference.train_on_batch(x, y),
        "pipeline_sparse": common.train_step(sparse_pipe, x, y),
        "pipeline_densified": common.train_step(dense_pipe, x, y),
    }
    samples, ms = common.time_steps(candidates, warmup=2)
    common.print_ms(ms, 20)
    tokens = FLAGS.batch * FLAGS.seq_len // FLAGS.replicas
    exchanged = {
        "dense_bytes": FLAGS.vocab * FLAGS.d_model * 4,
        "sparse_bytes": tokens * (FLAGS.d_model + 1) * 4,
    }
    print(
        f"  embedding gradient per replica and step: dense {exchanged['dense_bytes'] / 2**20:.1f}"
        f" MiB, slices {exchanged['sparse_bytes'] / 2**20:.2f} MiB"
    )
    config = common.flag_values(
        "vocab",
        "d_model",
        "depth",
        "head",
        "seq_len",
        "batch",
        "stages",
        "replicas",
        "micro_batches",
        "rounds",
        "steps_per_round",
    )
    speedup = ms["pipeline_densified"] / ms["pipeline_sparse"]
    common.write_timed(
        "sparse_embedding",
        env,
        config,
        samples,
        ms,
        f"{FLAGS.vocab}-row embedding LM, {FLAGS.stages}×{FLAGS.replicas} M={FLAGS.micro_batches}",
        exchanged=exchanged,
        densified_over_sparse=speedup,
    )
    print(
        f"SUMMARY sparse_embedding vocab={FLAGS.vocab} sparse_ms={ms['pipeline_sparse']:.1f} "
        f"densified_ms={ms['pipeline_densified']:.1f} keras_ms={ms['keras_one_device']:.1f} "
        f"densified_over_sparse={speedup:.2f}"
    )


if __name__ == "__main__":
    app.run(main)
