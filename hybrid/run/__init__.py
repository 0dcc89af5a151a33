"""Operating a training run around the engine: data, checkpoints, the run directory and its
lock and record, resuming, the training loop and its callbacks, timelines, serving."""
