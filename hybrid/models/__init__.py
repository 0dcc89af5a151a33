"""Reference models, each a list of Keras layers that cuts cleanly into pipeline stages."""

from hybrid.models.catalog import MODEL_NAMES, num_layers
from hybrid.models.mlp import mlp
from hybrid.models.resnet import resnet
from hybrid.models.transformer import transformer

__all__ = ["MODEL_NAMES", "mlp", "num_layers", "resnet", "transformer"]
