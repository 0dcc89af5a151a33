"""TensorBoard's event files of a run that resumes: what a dead run logged after its last
checkpoint is dropped, so no step shows twice.

A run that dies after step 10 with its newest checkpoint at step 5 has written scalars for
steps 6 … 10; the resumed run trains them again and logs them again. Before it opens its
writer, every event file in the folder is rewritten without the events past the restored
step (each file replaced whole, so a reader never sees half of one), as Keras's
``TensorBoard`` leaves a run restarted at ``purge_step`` and TensorBoard itself discards
"orphaned" steps. Events of no step (the file's version record) are kept.
"""

from __future__ import annotations

import os

import tensorflow as tf

__all__ = ["drop_after"]


def drop_after(folder: str, step: int) -> int:
    """Rewrites each ``events.out.tfevents.*`` file in ``folder`` without its events of a
    step greater than ``step``; returns how many events were dropped (0: nothing changed)."""
    if not tf.io.gfile.isdir(folder):
        return 0
    dropped = 0
    for name in sorted(tf.io.gfile.listdir(folder)):
        if not name.startswith("events.out.tfevents."):
            continue
        path = os.path.join(folder, name)
        events = list(tf.compat.v1.train.summary_iterator(path))
        kept = [e for e in events if e.step <= step]
        if len(kept) == len(events):
            continue
        dropped += len(events) - len(kept)
        partial = path + ".partial"
        with tf.io.TFRecordWriter(partial) as writer:
            for event in kept:
                writer.write(event.SerializeToString())
        tf.io.gfile.rename(partial, path, overwrite=True)
    return dropped
