"""Reference models, each a list of Keras layers that cuts cleanly into pipeline stages.

``catalog`` (what each model is, without TensorFlow) imports cheaply; the model functions
load Keras on first use.
"""

from typing import TYPE_CHECKING

from hybrid.core.lazy import attributes

if TYPE_CHECKING:
    from hybrid.models.catalog import MODEL_NAMES, num_layers
    from hybrid.models.mlp import mlp
    from hybrid.models.resnet import resnet
    from hybrid.models.transformer import transformer

__all__ = ["MODEL_NAMES", "mlp", "num_layers", "resnet", "transformer"]

__getattr__, __dir__ = attributes(
    "hybrid.models",
    globals(),
    {
        "MODEL_NAMES": ("hybrid.models.catalog", "MODEL_NAMES"),
        "num_layers": ("hybrid.models.catalog", "num_layers"),
        "mlp": ("hybrid.models.mlp", "mlp"),
        "resnet": ("hybrid.models.resnet", "resnet"),
        "transformer": ("hybrid.models.transformer", "transformer"),
    },
)
