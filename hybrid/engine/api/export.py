"""SavedModels of a trained pipeline: the whole model, or one per stage for serving the stages
on separate machines.

    export(pipe, path)                  path/          the user's Keras model (Model.export):
                                                       ``serve`` and ``serving_default``
    export(pipe, path, per_stage=True)  path/stage_<i>/ stage i alone, inputs: the tensors
                                                       crossing cut i (the model's inputs
                                                       for stage 0), outputs: those crossing
                                                       cut i + 1 (the model's for the last)
                                        path/pipeline.json  the manifest: stage order, each
                                                       stage's input and output names, shapes
                                                       and dtypes, the device it ran on

Each stage's SavedModel holds only that stage's variables (replica 0's copies, which every
replica equals) and runs the user's layers in inference mode exactly as the pipeline's
forward does, so chaining the stages' ``serving_default`` signatures in manifest order gives
``pipe.predict``. ``hybrid.run.serving`` does that chaining, pipelined over micro-batches.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from hybrid.engine.step.stage import StageReplica

__all__ = ["MANIFEST", "export_model", "export_stages", "stage_names"]

MANIFEST = "pipeline.json"


def export_model(model: Any, path: str) -> None:
    """The Keras model as one SavedModel with ``serve`` and ``serving_default``."""
    model.export(path, format="tf_saved_model", verbose=False)


def stage_names(stages: Sequence[StageReplica], input_names: Sequence[str]) -> list[list[str]]:
    """``names[i]``: the names of the tensors entering stage i (the model's input names for
    stage 0, ``cut<i>_<j>`` after), then ``names[S]``: the model's outputs'."""
    names = [list(input_names)]
    for i, stage in enumerate(stages[1:], start=1):
        names.append([f"cut{i}_{j}" for j in range(len(stage.segment.inputs))])
    names.append([f"output_{j}" for j in range(len(stages[-1].segment.outputs))])
    return names


def _module(stage: StageReplica, inputs: list[str], outputs: list[str]) -> tf.Module:
    """A module holding the stage's variables and its inference forward as ``serve``."""
    module = tf.Module()
    module.weights = [getattr(v, "value", v) for v in stage.variables]
    seed = tf.zeros([2], tf.int64)  # inference draws nothing; the mapping needs a seed
    signature = [
        tf.TensorSpec((None, *spec.shape), spec.dtype, name=name)
        for spec, name in zip(stage.input_specs, inputs, strict=True)
    ]

    def serve(*xs: tf.Tensor) -> dict[str, tf.Tensor]:
        ys, _ = stage.infer(list(xs), None, seed)
        return dict(zip(outputs, ys, strict=True))

    module.serve = tf.function(serve, input_signature=signature, autograph=False)
    return module


def export_stages(
    stages: Sequence[StageReplica], input_names: Sequence[str], output_names: Any, path: str
) -> dict[str, Any]:
    """One SavedModel per stage (replica 0's copies) under ``path/stage_<i>`` and the
    manifest ``path/pipeline.json``; returns the manifest."""
    for stage in stages:
        if len(stage.input_specs) != len(stage.segment.inputs):
            raise NotImplementedError(
                f"a mask crosses the cut before stage {stage.index}; per-stage export of "
                "masked tensors is not supported yet: export the whole model"
            )
    names = stage_names(stages, input_names)
    manifest: dict[str, Any] = {"stages": [], "model_outputs": output_names}
    for i, stage in enumerate(stages):
        module = _module(stage, names[i], names[i + 1])
        directory = f"stage_{i}"
        signatures = {"serving_default": module.serve.get_concrete_function()}
        tf.saved_model.save(module, os.path.join(path, directory), signatures=signatures)
        manifest["stages"].append(
            {
                "path": directory,
                "device": stage.device,
                "inputs": [
                    {"name": name, "shape": [None, *spec.shape], "dtype": spec.dtype}
                    for name, spec in zip(names[i], stage.input_specs, strict=True)
                ],
                "outputs": names[i + 1],
            }
        )
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest
