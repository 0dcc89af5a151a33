"""Reference models, each a list of Keras layers that cuts cleanly into pipeline stages."""

from hybrid.models.mlp import mlp

__all__ = ["mlp"]
