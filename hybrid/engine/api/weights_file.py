"""The optimizer's state in a Keras weights file, where Keras keeps it.

``keras.Model.save_weights`` of a compiled model writes, beside the layers' variables, its
optimizer's variables (in ``optimizer.variables`` order)::

    layers/<layer>/vars/<j>     the model's weights (written by Keras, from the user's model)
    optimizer/vars/<i>          optimizer variable i

The pipeline writes its one logical optimizer there in the same form, so a file moves both
ways between plain Keras and the pipeline (``ModelCheckpoint(save_weights_only=True)``,
``BackupAndRestore``) with the optimizer's state.
"""

from __future__ import annotations

import warnings
from typing import Any

import h5py
import numpy as np

__all__ = ["read_optimizer", "write_optimizer"]

_GROUP = "optimizer/vars"


def write_optimizer(path: str, optimizer: Any) -> None:
    """Writes ``optimizer``'s variables (``save_own_variables``) into the weights file
    ``path``, replacing what the model's own optimizer (if it had one) left there."""
    with h5py.File(path, "a") as f:
        if "optimizer" in f:
            del f["optimizer"]
        group = f.create_group(_GROUP)
        store: dict[str, Any] = {}
        optimizer.save_own_variables(store)
        for key, value in store.items():
            group[key] = value


def read_optimizer(path: str, optimizer: Any) -> None:
    """Loads the optimizer variables of the weights file ``path`` into ``optimizer``
    (``load_own_variables``); a file without them leaves it as it is, one of another
    optimizer (another count of variables) too, with Keras's warning."""
    with h5py.File(path, "r") as f:
        if _GROUP not in f:
            return
        store = {key: np.asarray(value) for key, value in f[_GROUP].items()}
    try:
        optimizer.load_own_variables(store)  # refuses a store of another optimizer
    except ValueError as err:
        warnings.warn(f"skipped loading the optimizer's variables: {err}", stacklevel=3)
