"""A decoder-only Transformer language model that cuts into stages.

    tokens (B, T) int ─ Embedding(token) + Embedding(position) ─┐
                                                                 │  (B, T, d)
        block_0 … block_{N-1}:  x += attn(LN(x))  (causal)       │
                                x += mlp(LN(x))                  │
        LayerNorm ─ head  ─> logits (B, T, vocab)                ┘

``transformer()`` returns either a list of N + 3 layers (each residual block one layer, its
skip connections inside it: every cut between layers is a stage boundary), or with
``graph=True`` a functional model with the residual structure spelled out (LayerNorm,
attention, Add, ...), so a cut can fall inside a block and the residual stream crosses it.
With ``tie_embeddings=True`` the head is :class:`TiedHead`: logits are the final features
times the transposed token embedding matrix, one variable read on the first and last stage.
"""

from __future__ import annotations

from typing import Any

import keras

__all__ = ["PositionalEmbedding", "TiedHead", "TransformerBlock", "transformer"]


@keras.saving.register_keras_serializable(package="hybrid")
class PositionalEmbedding(keras.layers.Layer):
    """Token ids (B, T) -> token embedding + learned position embedding, (B, T, d)."""

    def __init__(
        self, vocab_size: int, max_length: int, d_model: int, seed: int = 0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.vocab_size, self.max_length, self.d_model, self.seed = (
            vocab_size,
            max_length,
            d_model,
            seed,
        )
        init = keras.initializers.RandomNormal(stddev=0.02, seed=seed)
        self.tokens = keras.layers.Embedding(
            vocab_size, d_model, embeddings_initializer=init, name="tokens"
        )
        self.positions = keras.layers.Embedding(
            max_length,
            d_model,
            embeddings_initializer=keras.initializers.RandomNormal(stddev=0.01, seed=seed + 1),
            name="positions",
        )

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.tokens.build(input_shape)
        self.positions.build((input_shape[-1],))

    def call(self, ids: Any) -> Any:
        length = keras.ops.shape(ids)[-1]
        return self.tokens(ids) + self.positions(keras.ops.arange(length))

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return (*input_shape, self.d_model)

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "vocab_size": self.vocab_size,
            "max_length": self.max_length,
            "d_model": self.d_model,
            "seed": self.seed,
        }


@keras.saving.register_keras_serializable(package="hybrid")
class TransformerBlock(keras.layers.Layer):
    """Pre-LayerNorm decoder block: x + attn(LN(x)) with a causal mask, then x + mlp(LN(x)).

    ``mlp`` is Dense(mlp_ratio·d, gelu) → Dense(d); ``dropout`` applies to both residual
    branches (its masks come from the stage's seeded generators, so remat is exact).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if d_model % num_heads:
            raise ValueError(
                f"d_model ({d_model}) must be divisible by num_heads ({num_heads}); "
                "choose a width that is a multiple of the head count"
            )
        self.d_model, self.num_heads, self.mlp_ratio, self.dropout, self.seed = (
            d_model,
            num_heads,
            mlp_ratio,
            dropout,
            seed,
        )
        init = keras.initializers.GlorotUniform(seed=seed)
        self.norm_attn = keras.layers.LayerNormalization(
            epsilon=1e-5, name=f"{self.name}_norm_attn"
        )
        self.attn = keras.layers.MultiHeadAttention(
            num_heads, d_model // num_heads, kernel_initializer=init, name=f"{self.name}_attn"
        )
        self.norm_mlp = keras.layers.LayerNormalization(epsilon=1e-5, name=f"{self.name}_norm_mlp")
        self.hidden = keras.layers.Dense(
            mlp_ratio * d_model,
            activation="gelu",
            kernel_initializer=init,
            name=f"{self.name}_hidden",
        )
        self.out = keras.layers.Dense(d_model, kernel_initializer=init, name=f"{self.name}_out")
        self.drop = keras.layers.Dropout(dropout, seed=seed) if dropout else None

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.norm_attn.build(input_shape)
        self.attn.build(input_shape, input_shape)
        self.norm_mlp.build(input_shape)
        self.hidden.build(input_shape)
        self.out.build((*input_shape[:-1], self.mlp_ratio * self.d_model))

    def _dropped(self, x: Any, training: bool | None) -> Any:
        return self.drop(x, training=training) if self.drop is not None else x

    def call(self, x: Any, training: bool | None = None) -> Any:
        h = self.norm_attn(x)
        x = x + self._dropped(self.attn(h, h, use_causal_mask=True, training=training), training)
        h = self.out(self.hidden(self.norm_mlp(x)))
        return x + self._dropped(h, training)

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return input_shape

    def get_config(self) -> dict[str, Any]:
        return {
            **super().get_config(),
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "mlp_ratio": self.mlp_ratio,
            "dropout": self.dropout,
            "seed": self.seed,
        }


class TiedHead(keras.layers.Layer):
    """Logits from features (B, T, d): ``features · embedding.embeddings^T`` (B, T, vocab).

    The standard weight tying of language models: the head has no variable of its own and
    reads the token embedding's matrix, wherever the pipeline puts the two.
    """

    def __init__(self, embedding: keras.layers.Embedding, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, features: Any) -> Any:
        return keras.ops.matmul(features, keras.ops.transpose(self.embedding.embeddings))

    def compute_output_shape(self, input_shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
        return (*input_shape[:-1], self.embedding.input_dim)


def _head(
    vocab_size: int, embedding: PositionalEmbedding, tie: bool, seed: int
) -> keras.layers.Layer:
    if tie:
        return TiedHead(embedding.tokens, name="head")
    return keras.layers.Dense(
        vocab_size, kernel_initializer=keras.initializers.GlorotUniform(seed=seed), name="head"
    )


def _graph(
    embedding: PositionalEmbedding,
    blocks: list[TransformerBlock],
    final: keras.layers.Layer,
    head: keras.layers.Layer,
    seq_len: int,
) -> keras.Model:
    """The same layers' computation as a functional graph: each block's sublayers are called
    one by one, with its two residual additions as Add layers."""
    ids = keras.Input((seq_len,), dtype="int32", name="tokens")
    x = embedding(ids)
    for block in blocks:
        h = block.norm_attn(x)
        h = block.attn(h, h, use_causal_mask=True)
        if block.drop is not None:
            h = block.drop(h)
        x = keras.layers.Add(name=f"{block.name}_attn_residual")([x, h])
        h = block.out(block.hidden(block.norm_mlp(x)))
        if block.drop is not None:
            h = block.drop(h)
        x = keras.layers.Add(name=f"{block.name}_mlp_residual")([x, h])
    return keras.Model(ids, head(final(x)), name="transformer")


def transformer(
    vocab_size: int = 256,
    seq_len: int = 64,
    d_model: int = 64,
    num_heads: int = 4,
    num_blocks: int = 4,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
    seed: int = 0,
    tie_embeddings: bool = False,
    graph: bool = False,
) -> Any:
    """Embedding, ``num_blocks`` Transformer blocks, a final LayerNorm and the vocabulary head.

    The model maps token ids (B, seq_len) to next-token logits (B, seq_len, vocab_size);
    train it with ``SparseCategoricalCrossentropy(from_logits=True)`` against the ids shifted
    by one.

    Returns:
      ``num_blocks + 3`` layers; with ``graph=True`` a functional ``keras.Model`` of the
      same layers whose blocks are spelled out as calls of their sublayers (7 calls per
      block, 9 with dropout, + 3), computing the same function.
    """
    embedding = PositionalEmbedding(vocab_size, seq_len, d_model, seed=seed, name="embedding")
    blocks = [
        TransformerBlock(
            d_model, num_heads, mlp_ratio, dropout, seed=seed + 10 + i, name=f"block_{i}"
        )
        for i in range(num_blocks)
    ]
    final = keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm")
    head = _head(vocab_size, embedding, tie_embeddings, seed + 2)
    if graph:
        return _graph(embedding, blocks, final, head, seq_len)
    return [embedding, *blocks, final, head]
