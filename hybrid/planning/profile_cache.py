"""Cost profiles kept between runs: a model profiled once on a host is read back by the next
plan, dry run or ``--mesh=auto`` of the same model instead of measured again.

A profile is filed under a fingerprint of everything its figures depend on::

    the host, TensorFlow's version, the device kind, the XLA flags, whether the CPU
    allocator keeps statistics (the byte figures), the timing repeats
    each layer call's class, configuration (its name left out), weight shapes and dtypes,
    the tensors it reads (the model's wiring) and its other arguments
    the inputs' shapes and dtypes, the target's shape, the micro-batch sizes
    the loss's and the optimizer's class and configuration

one JSON file per profile under ``<user cache>/profiles/`` (:mod:`hybrid.core.user_cache`).
A model whose layers do not give their configuration (``get_config`` not implemented) has
no fingerprint and is measured every time. The weights' values are not in it: they do not
change what a step costs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hybrid.core import user_cache
from hybrid.planning.costs import CostProfile

if TYPE_CHECKING:
    from hybrid.planning.model_calls import ModelCalls

__all__ = ["PROFILER", "directory", "fingerprint", "read", "write"]

# What the profiler measures, numbered: a profile filed by another number is measured again
# (2: the update's once-per-program cost apart from each layer's, CostProfile.update_call;
# 3: two devices of a host computing at once, CostProfile.concurrency; 4: only on a program
# of a millisecond or more; 5: stored bytes counted from the kept tensors, not the allocator).
PROFILER = 5


def directory() -> str:
    """Where profiles are kept."""
    return os.path.join(user_cache.root(), "profiles")


def fingerprint(
    calls: ModelCalls,
    batch_sizes: Sequence[int],
    *,
    device: str,
    loss: Any = None,
    target_shape: Sequence[int] | None = None,
    optimizer: Callable[[], Any] | None = None,
    repeats: int = 7,
    concurrency: bool = False,
) -> str | None:
    """The hex digest a profile of these arguments is filed under, or None when a layer,
    the loss or the optimizer does not give its configuration (its ``get_config`` raises):
    such a model is measured every time, never refused."""
    import tensorflow as tf

    try:
        described = {
            "host": platform.node(),
            "tensorflow": tf.__version__,
            "device": device.rsplit("/", 1)[-1].rsplit(":", 1)[0],
            "xla": [os.environ.get(k, "") for k in ("XLA_FLAGS", "TF_XLA_FLAGS")],
            "allocator_statistics": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", ""),
            "repeats": repeats,
            "profiler": PROFILER,
            "concurrency": concurrency,
            "layers": [_layer(call.layer) for call in calls.calls],
            "wiring": calls.wiring(),
            "arguments": [calls.arguments(i) for i in range(len(calls.calls))],
            "input": [[list(s.shape), s.dtype] for s in calls.input_specs],
            "target": None if target_shape is None else list(target_shape),
            "batch_sizes": list(batch_sizes),
            "loss": _configured(loss),
            "optimizer": _configured(optimizer() if optimizer is not None else None),
        }
    except Exception:  # noqa: BLE001 - a get_config that cannot say (not given, or broken)
        return None
    text = json.dumps(described, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _layer(layer: Any) -> dict[str, Any]:
    weights = [(tuple(v.shape), str(v.dtype)) for v in getattr(layer, "weights", [])]
    return {"class": _class(layer), "config": _unnamed(layer.get_config()), "weights": weights}


def _configured(thing: Any) -> Any:
    if thing is None:
        return None
    get_config = getattr(thing, "get_config", None)
    return [_class(thing), _unnamed(get_config()) if get_config else repr(thing)]


def _unnamed(config: Any) -> Any:
    """``config`` without its top-level name (Keras numbers the names of new objects)."""
    return {k: v for k, v in config.items() if k != "name"} if isinstance(config, dict) else config


def _class(thing: Any) -> str:
    kind = type(thing)
    return f"{kind.__module__}.{kind.__qualname__}"


def _path(key: str) -> str:
    return os.path.join(directory(), f"{key}.json")


def read(key: str, names: Sequence[str]) -> CostProfile | None:
    """The profile filed under ``key``, its rows given ``names`` (the layer calls' names),
    or None (none filed, or a file that does not read as one)."""
    stored = user_cache.read_json(_path(key))
    try:
        profile = CostProfile.from_dict(stored)
    except (ValueError, KeyError, TypeError):
        return None
    if profile.num_layers != len(names):
        return None
    named = tuple(
        dataclasses.replace(cost, name=name)
        for cost, name in zip(profile.layers, names, strict=True)
    )
    return dataclasses.replace(profile, layers=named)


def write(key: str, profile: CostProfile) -> str | None:
    """Files ``profile`` under ``key`` (atomically); its path, or None where the cache
    cannot be written (it is then measured again next time)."""
    path = _path(key)
    return path if user_cache.write_json(path, profile.to_dict()) else None
