"""The child of ``test_compile_cache.py``: a process whose first XLA compile comes after its
persistent cache is on (TensorFlow reads its XLA flags once).

    python tests/compile_cache_child.py CACHE_DIR [--no-cache]

Trains a 2 × 2 pipeline (M = 2, Adam) two steps beside plain Keras on one device from the
same weights, then evaluates twice, and prints ``RESULT {json}``: which traced step each
pipeline call ran, the largest weight difference from Keras, the evaluation's difference
from Keras's, and the cache's files after each call.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.core import xla_cache  # noqa: E402  (no TensorFlow yet)


def main() -> int:
    cache = sys.argv[1]
    if "--no-cache" not in sys.argv:
        xla_cache.enable(cache)
    import keras
    import numpy as np

    import hybrid

    hybrid.simulate_cpu_devices(4)
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(16, activation="relu") for _ in range(3)] + [keras.layers.Dense(4)]
    model = keras.Sequential([keras.Input((8,)), *layers])
    initial = model.get_weights()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16, 8)).astype("float32")
    y = rng.integers(0, 4, size=(16,)).astype("int32")

    def loss() -> keras.losses.Loss:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    pipe = hybrid.Pipeline(model, hybrid.DeviceMesh.create(stages=2, replicas=2), micro_batches=2)
    pipe.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss())
    ran, files = [], []
    steps = pipe._steps  # which of its traced functions each step runs
    calls = {"train": 0, "first_train": 0, "evaluate": 0, "first_evaluate": 0}
    for name in calls:
        traced = getattr(steps, name)

        def counted(*args: object, _name: str = name, _traced: object = traced) -> object:
            calls[_name] += 1
            return _traced(*args)  # type: ignore[operator]

        object.__setattr__(steps, name, counted)
    for call in (pipe.train_step, pipe.train_step, pipe.evaluate, pipe.evaluate):
        call(x, y)
        ran.append(dict(calls))
        files.append(len(os.listdir(cache)) if os.path.isdir(cache) else 0)
    evaluated = pipe.evaluate(x, y, verbose=0)
    got = pipe.get_weights()
    model.set_weights(initial)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss(), jit_compile=True)
    for _ in range(2):
        model.train_on_batch(x, y)
    want = model.get_weights()
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want, strict=True))
    evaluation = abs(evaluated - model.evaluate(x, y, verbose=0))
    result = {"ran": ran, "files": files, "max_diff": diff, "evaluation_diff": evaluation}
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
