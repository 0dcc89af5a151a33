"""Per-layer costs of a model (:class:`CostProfile`): time of every action kind and bytes of
activations and weights at a few micro-batch sizes, interpolated in between; given by hand
(:func:`uniform_profile`), read back from JSON, or measured on one device
(:func:`profile_model`).

Conventions: times in seconds, sizes in bytes.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybrid.planning.profile import LayerMeasurement, ModelMeasurement

__all__ = ["CostProfile", "LayerCost", "profile_model", "uniform_profile"]


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear in the batch size through the measured points, extended by the
    nearest segment beyond them (proportional to the batch with a single point), >= 0."""
    if len(xs) == 1:
        return max(0.0, ys[0] * x / xs[0])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's costs, each per-batch figure given at :attr:`CostProfile.batch_sizes`.

    Attributes:
      name: the layer name, for tables.
      forward: seconds of its forward.
      backward: seconds of its backward from stored activations (remat "never").
      recompute_backward: seconds of the backward inside a recomputing forward+backward
        program (a rematerialized B costs forward + recompute_backward).
      input_backward: seconds of the input gradient alone (a split backward's B).
      stored_bytes: bytes its forward keeps for the backward (output and intermediates).
      working_bytes: the transient peak of its forward+backward above that.
      output_bytes: bytes of its output (what a stage boundary after it sends).
      param_bytes: bytes of its trainable weights.
      update: seconds of one optimizer update of its weights.
      param_tensors: its trainable weight arrays (each backward accumulates one gradient
        per array, see :attr:`Hardware.tensor_overhead`).
    """

    name: str
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    recompute_backward: tuple[float, ...]
    input_backward: tuple[float, ...]
    stored_bytes: tuple[float, ...]
    working_bytes: tuple[float, ...]
    output_bytes: tuple[float, ...]
    param_bytes: float
    update: float = 0.0
    param_tensors: int = 0


_PER_BATCH = (
    "forward",
    "backward",
    "recompute_backward",
    "input_backward",
    "stored_bytes",
    "working_bytes",
    "output_bytes",
)


@dataclasses.dataclass(frozen=True)
class CostProfile:
    """Per-layer costs of a model; figures between the measured batch sizes are
    interpolated linearly (and extended by the nearest segment beyond them).

    Attributes:
      layers: one :class:`LayerCost` per layer, in model order.
      batch_sizes: the micro-batch sizes every per-batch figure is given at, increasing.
      input_bytes: bytes of one example of the model input.
      input_is_float: whether the model input has a gradient (token ids do not).
      source: where the figures come from, for reports.
      batch_norm: the model's training-mode BatchNormalization: "" (none), "micro-batch"
        (some normalize each micro-batch alone) or "synchronized" (all are
        ``synchronized=True``: the R replicas' micro-batches together).
      model_bytes: bytes of the whole model's weights, a variable read by several layers
        (a tied embedding) once; 0: not measured, the layers' sum (:attr:`template_bytes`).
      update_call: seconds one stage's optimizer update costs once, whatever its weights
        (the layers' ``update`` is each one's own share beyond it).
      concurrency: how much slower a device computes while another device of the same host
        computes beside it (measured on the model; 1: not measured, or devices that are
        each their own hardware).
    """

    layers: tuple[LayerCost, ...]
    batch_sizes: tuple[int, ...]
    input_bytes: float
    input_is_float: bool = True
    source: str = ""
    batch_norm: str = ""
    model_bytes: float = 0.0
    update_call: float = 0.0
    concurrency: float = 1.0

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a cost profile needs at least one layer")
        sizes = list(self.batch_sizes)
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(
                f"batch_sizes must be distinct positive integers in increasing order, got {sizes}"
            )
        for layer in self.layers:
            for name in _PER_BATCH:
                if len(getattr(layer, name)) != len(sizes):
                    raise ValueError(
                        f"layer {layer.name!r}: {name} has {len(getattr(layer, name))} values "
                        f"but the profile has {len(sizes)} batch sizes {sizes}"
                    )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def batch_norm_examples(self, global_batch: int, replicas: int, micro_batches: int) -> int:
        """The examples a BatchNormalization normalizes over in training: B / (R·M), or
        B / M when all are synchronized (0 without BatchNormalization)."""
        if not self.batch_norm:
            return 0
        together = 1 if self.batch_norm == "synchronized" else replicas
        return global_batch // (together * micro_batches)

    def value(self, layer: int, name: str, batch: float) -> float:
        """Per-batch figure ``name`` of layer ``layer`` at a micro-batch of ``batch``."""
        return _interpolate(self.batch_sizes, getattr(self.layers[layer], name), batch)

    @property
    def param_bytes(self) -> float:
        """Every layer's weights summed (a tied variable once per layer reading it)."""
        return float(sum(layer.param_bytes for layer in self.layers))

    @property
    def template_bytes(self) -> float:
        """The bytes of the user's whole model: :attr:`model_bytes`, else the layers' sum."""
        return self.model_bytes or self.param_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form; :meth:`from_dict` reads it back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostProfile:
        """Reads the form :meth:`to_dict` writes."""
        layers = []
        for layer in data["layers"]:
            per_batch = {k: tuple(float(x) for x in layer[k]) for k in _PER_BATCH}
            layers.append(
                LayerCost(
                    name=str(layer["name"]),
                    param_bytes=float(layer["param_bytes"]),
                    update=float(layer.get("update", 0.0)),
                    param_tensors=int(layer.get("param_tensors", 0)),
                    **per_batch,
                )
            )
        return cls(
            layers=tuple(layers),
            batch_sizes=tuple(int(b) for b in data["batch_sizes"]),
            input_bytes=float(data["input_bytes"]),
            input_is_float=bool(data.get("input_is_float", True)),
            source=str(data.get("source", "")),
            batch_norm=str(data.get("batch_norm", "")),
            model_bytes=float(data.get("model_bytes", 0.0)),
            update_call=float(data.get("update_call", 0.0)),
            concurrency=float(data.get("concurrency", 1.0)),
        )

    @classmethod
    def from_measurement(
        cls, measurement: ModelMeasurement, input_is_float: bool = True
    ) -> CostProfile:
        """From :func:`hybrid.planning.profile.measure_layers`' result.

        Without allocator statistics (bytes measured as None) a layer's stored bytes fall
        back to its output bytes and its working bytes to twice that: lower bounds.
        """
        return cls(
            tuple(_layer_cost(m) for m in measurement.layers),
            tuple(t.batch for t in measurement.layers[0].timings),
            float(measurement.input_bytes),
            input_is_float,
            source=f"profiled on {measurement.device}",
            update_call=measurement.update_call,
            concurrency=measurement.concurrency,
        )


def _layer_cost(m: LayerMeasurement) -> LayerCost:
    """One measured layer's costs; missing byte figures replaced by their lower bounds."""
    t = m.timings
    stored = tuple(
        float(x.stored_bytes if x.stored_bytes is not None else x.output_bytes) for x in t
    )
    working = tuple(
        float(x.working_bytes if x.working_bytes is not None else 2 * s)
        for x, s in zip(t, stored, strict=True)
    )
    return LayerCost(
        name=m.name,
        forward=tuple(x.forward for x in t),
        backward=tuple(x.backward for x in t),
        recompute_backward=tuple(x.recompute_backward for x in t),
        input_backward=tuple(x.input_backward for x in t),
        stored_bytes=stored,
        working_bytes=working,
        output_bytes=tuple(float(x.output_bytes) for x in t),
        param_bytes=float(m.param_bytes),
        update=m.update,
        param_tensors=int(m.param_tensors),
    )


def uniform_profile(
    num_layers: int,
    forward: float = 1.0,
    backward: float = 2.0,
    *,
    batch: int = 1,
    input_backward: float | None = None,
    param_bytes: float = 0.0,
    stored_bytes: float = 0.0,
    working_bytes: float = 0.0,
    output_bytes: float = 0.0,
    input_bytes: float = 0.0,
    update: float = 0.0,
) -> CostProfile:
    """``num_layers`` identical layers, every per-batch figure given at one batch size
    (so proportional to the micro-batch): handy for projections and tests."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be at least 1, got {num_layers}")
    layer = LayerCost(
        name="layer",
        forward=(forward,),
        backward=(backward,),
        recompute_backward=(backward,),
        input_backward=(backward / 2 if input_backward is None else input_backward,),
        stored_bytes=(stored_bytes,),
        working_bytes=(working_bytes,),
        output_bytes=(output_bytes,),
        param_bytes=param_bytes,
        update=update,
    )
    layers = tuple(dataclasses.replace(layer, name=f"layer_{i}") for i in range(num_layers))
    return CostProfile(layers, (batch,), input_bytes, source="uniform")


def profile_model(
    model: Any,
    input_shape: Sequence[int] | None,
    input_dtype: str,
    batch_sizes: Sequence[int],
    *,
    x: Any = None,
    loss: Any = None,
    target_shape: Sequence[int] | None = None,
    optimizer: Callable[[], Any] | None = None,
    device: str | None = None,
    repeats: int = 7,
    verbose: int = 0,
    cache: bool = True,
) -> CostProfile:
    """Measures ``model``'s layer calls on one device
    (:func:`hybrid.planning.profile.measure_layers`) at the given micro-batch sizes and
    returns their :class:`CostProfile`, one row per call the Pipeline cuts (``verbose=1``: a
    progress bar while measuring).

    ``model``: a Keras model (functional or Sequential, with skips, merges, several inputs,
    nested models, tied layers) or a list of layers applied in order; its input from ``x``
    (a sample batch), else ``input_shape`` and ``input_dtype``, else the model's
    ``keras.Input`` (:func:`hybrid.planning.model_calls.model_calls`).
    ``device`` defaults to the first local device (the first GPU, else the first CPU).
    ``cache``: read a profile of the same model and arguments measured earlier on this host,
    and file a new one (:mod:`hybrid.planning.profile_cache`); False measures, files nothing.

    Raises:
      ValueError: a model the planner cannot profile (named, with what to do instead).
    """
    from hybrid.core.mesh import local_devices
    from hybrid.engine.model.layer_costs import weight_bytes
    from hybrid.planning import profile as profile_lib
    from hybrid.planning import profile_cache
    from hybrid.planning.model_calls import ModelCalls, model_calls

    calls = model if isinstance(model, ModelCalls) else model_calls(
        model, input_shape, input_dtype, x
    )  # fmt: skip
    where = device or local_devices()[0]
    beside = _beside(where, local_devices())
    key = None
    if cache:
        key = profile_cache.fingerprint(
            calls, batch_sizes, device=where, loss=loss, target_shape=target_shape,
            optimizer=optimizer, repeats=repeats, concurrency=beside is not None,
        )  # fmt: skip
        stored = profile_cache.read(key, calls.names) if key else None
        if stored is not None:
            if verbose:
                print(
                    f"read the cost profile of {len(calls.names)} layer calls at micro-batch "
                    f"sizes {list(batch_sizes)} measured earlier on this host "
                    f"({profile_cache.directory()})"
                )
            return stored
    measurement = profile_lib.measure_layers(
        calls,
        batch_sizes,
        where,
        loss=loss,
        target_shape=target_shape,
        optimizer=optimizer,
        repeats=repeats,
        verbose=verbose,
        beside=beside,
    )
    profile = CostProfile.from_measurement(measurement, input_is_float=calls.input_is_float)
    model_bytes = weight_bytes(calls.graph.variables())
    profile = dataclasses.replace(
        profile, batch_norm=_batch_norm_kind(calls.layers()), model_bytes=model_bytes
    )
    if key:
        profile_cache.write(key, profile)
    return profile


def _beside(device: str, devices: Sequence[str]) -> str | None:
    """Another device sharing ``device``'s host cores, where the profile times two programs
    at once (simulated CPU devices: :func:`~hybrid.planning.host_calibration.shared_cores`);
    None when there is none or each device is its own hardware."""
    from hybrid.planning.host_calibration import shared_cores

    others = [d for d in devices if d != device]
    if not others or shared_cores([device, others[0]]) is None:
        return None
    return others[0]


def _batch_norm_kind(layers: Sequence[Any]) -> str:
    """``CostProfile.batch_norm`` of ``layers`` (and the layers of models among them)."""
    import keras

    norms, todo = [], list(layers)
    while todo:
        layer = todo.pop()
        todo += list(getattr(layer, "layers", []))
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            norms.append(layer)
    if not norms:
        return ""
    return "synchronized" if all(n.synchronized for n in norms) else "micro-batch"
