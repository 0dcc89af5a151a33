"""Input data: a synthetic classification task whose labels a model can learn."""

from __future__ import annotations

import numpy as np

__all__ = ["teacher_batches"]


def teacher_batches(
    batch_size: int, features: int, num_classes: int, seed: int = 0
):  # -> Iterator[tuple[np.ndarray, np.ndarray]]
    """Endless batches (x, y): x ~ N(0, 1), y = argmax of a fixed random two-layer teacher.

    The teacher is fixed by ``seed``, so the task is learnable and the loss falls.
    """
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(features, 4 * num_classes)).astype("float32")
    head = rng.normal(size=(4 * num_classes, num_classes)).astype("float32")
    while True:
        x = rng.normal(size=(batch_size, features)).astype("float32")
        y = np.argmax(np.tanh(x @ hidden) @ head, axis=1).astype("int32")
        yield x, y
