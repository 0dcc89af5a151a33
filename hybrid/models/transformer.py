"""A decoder-only Transformer language model as a list of layers that cuts into stages.

    tokens (B, T) int ─ Embedding(token) + Embedding(position) ─┐
                                                                 │  (B, T, d)
        block_0 … block_{N-1}:  x += attn(LN(x))  (causal)       │
                                x += mlp(LN(x))                  │
        LayerNorm ─ Dense(vocab)  ─> logits (B, T, vocab)        ┘

Each residual block is one Keras layer (its skip connections stay inside it), so the model
is a plain sequence of N + 3 layers and every cut between layers is a valid stage boundary.
"""

from __future__ import annotations

from typing import Any

import keras

__all__ = ["PositionalEmbedding", "TransformerBlock", "transformer"]


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
        self.norm_attn = keras.layers.LayerNormalization(epsilon=1e-5, name="norm_attn")
        self.attn = keras.layers.MultiHeadAttention(
            num_heads, d_model // num_heads, kernel_initializer=init, name="attn"
        )
        self.norm_mlp = keras.layers.LayerNormalization(epsilon=1e-5, name="norm_mlp")
        self.hidden = keras.layers.Dense(
            mlp_ratio * d_model, activation="gelu", kernel_initializer=init, name="hidden"
        )
        self.out = keras.layers.Dense(d_model, kernel_initializer=init, name="out")
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


def transformer(
    vocab_size: int = 256,
    seq_len: int = 64,
    d_model: int = 64,
    num_heads: int = 4,
    num_blocks: int = 4,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
    seed: int = 0,
) -> list[keras.layers.Layer]:
    """Embedding, ``num_blocks`` Transformer blocks, a final LayerNorm and the vocabulary head.

    The model maps token ids (B, seq_len) to next-token logits (B, seq_len, vocab_size);
    train it with ``SparseCategoricalCrossentropy(from_logits=True)`` against the ids shifted
    by one. ``num_blocks + 3`` layers.
    """
    layers: list[keras.layers.Layer] = [
        PositionalEmbedding(vocab_size, seq_len, d_model, seed=seed, name="embedding")
    ]
    layers += [
        TransformerBlock(
            d_model, num_heads, mlp_ratio, dropout, seed=seed + 10 + i, name=f"block_{i}"
        )
        for i in range(num_blocks)
    ]
    layers += [
        keras.layers.LayerNormalization(epsilon=1e-5, name="final_norm"),
        keras.layers.Dense(
            vocab_size,
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 2),
            name="head",
        ),
    ]
    return layers
