"""The floor that runs a step with TensorFlow: simulated devices, stage programs on their
devices, collectives, lowering of a schedule into ops, and ``Pipeline``."""

from hybrid.core.quiet import import_tensorflow

import_tensorflow()  # TensorFlow loaded without its start-up noise (hybrid.core.quiet)
