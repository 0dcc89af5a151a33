"""Pipelined inference from a per-stage export (``Pipeline.export(path, per_stage=True)``).

Each stage's SavedModel is loaded onto its own device (its variables live there), and a batch
is split into micro-batches that flow through the stages as the pipeline's forward does::

    for m in micro-batches:            (issued in this order; devices run concurrently)
        for s in stages:  on device s, after its previous action:
            out[s][m] = stage_s.serving_default(out[s-1][m])

so stage s works on micro-batch m while stage s + 1 works on m - 1. The result equals the
whole model's serving output (``Pipeline.export(path)``), example for example.

    server = hybrid.run.serving.load("/tmp/export", devices=["/CPU:0", "/CPU:1"])
    outputs = server.predict(x, micro_batches=4)   # as Pipeline.predict returns them
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from hybrid.engine.api.export import MANIFEST

__all__ = ["PipelinedModel", "load", "manifest_directory"]


class PipelinedModel:
    """The stages of a per-stage export, each on its device.

    Attributes:
      manifest: the export's ``pipeline.json``.
      devices: the device of each stage.
    """

    def __init__(self, path: str, devices: Sequence[str] | None = None) -> None:
        path = manifest_directory(path)
        with open(os.path.join(path, MANIFEST)) as f:
            self.manifest: dict[str, Any] = json.load(f)
        stages = self.manifest["stages"]
        if devices is None:
            cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
            devices = [cpus[i % len(cpus)] for i in range(len(stages))]
        if len(devices) != len(stages):
            raise ValueError(
                f"the export has {len(stages)} stages, got {len(devices)} devices; give one "
                "device per stage"
            )
        self.devices = list(devices)
        self._stages = []
        for stage, device in zip(stages, self.devices, strict=True):
            with tf.device(device):
                loaded = tf.saved_model.load(os.path.join(path, stage["path"]))
            self._stages.append((loaded, loaded.signatures["serving_default"], stage))
        self._run = tf.function(self._pipelined, autograph=False)

    def _pipelined(self, inputs: list[tf.Tensor], micro_batches: int) -> list[tf.Tensor]:
        parts = [tf.split(x, micro_batches) for x in inputs]
        tails: list[list[tf.Tensor]] = [[] for _ in self._stages]
        results = []
        for m in range(micro_batches):
            values = [p[m] for p in parts]
            for s, (_, signature, stage) in enumerate(self._stages):
                with tf.device(self.devices[s]), tf.control_dependencies(tails[s]):
                    named = {i["name"]: v for i, v in zip(stage["inputs"], values, strict=True)}
                    out = signature(**named)
                    values = [tf.identity(out[name]) for name in stage["outputs"]]
                tails[s] = values
            results.append(values)
        return [tf.concat(list(pieces), axis=0) for pieces in zip(*results, strict=True)]

    def predict(self, x: Any, micro_batches: int = 1) -> Any:
        """The model's outputs for the batch ``x`` (its examples divisible by
        ``micro_batches``), structured as the model returns them."""
        first = self.manifest["stages"][0]["inputs"]
        if isinstance(x, dict):
            inputs = [x[i["name"]] for i in first]
        else:
            inputs = list(x) if isinstance(x, (list, tuple)) else [x]
        tensors = [tf.convert_to_tensor(t, i["dtype"]) for t, i in zip(inputs, first, strict=True)]
        batch = int(tensors[0].shape[0])
        if batch % micro_batches:
            raise ValueError(
                f"a batch of {batch} examples does not split into {micro_batches} micro-batches"
            )
        outputs = [np.asarray(t) for t in self._run(tensors, micro_batches)]
        names = self.manifest.get("model_outputs")
        if names:
            return dict(zip(names, outputs, strict=True))
        return outputs[0] if len(outputs) == 1 else outputs


def manifest_directory(path: str) -> str:
    """The directory of the per-stage export ``path`` names: ``path`` itself when it holds
    the manifest, else ``path/stages`` (the launcher's ``--export_dir`` writes the whole model
    at ``path`` and the per-stage export under ``stages/``).

    Raises:
      FileNotFoundError: neither holds a manifest; the message names both and the fix.
    """
    for candidate in (path, os.path.join(path, "stages")):
        if os.path.exists(os.path.join(candidate, MANIFEST)):
            return candidate
    raise FileNotFoundError(
        f"{path} is not a per-stage export: neither {os.path.join(path, MANIFEST)} nor "
        f"{os.path.join(path, 'stages', MANIFEST)} exists; write one with "
        "pipe.export(path, per_stage=True) or hybrid-train --export_dir (a whole-model "
        "SavedModel loads with tf.saved_model.load)"
    )


def load(path: str, devices: Sequence[str] | None = None) -> PipelinedModel:
    """The per-stage export at ``path`` (or at ``path/stages``, where the launcher's
    ``--export_dir`` puts it), stage i on ``devices[i]`` (default: this process's logical CPU
    devices in turn)."""
    return PipelinedModel(path, devices)
