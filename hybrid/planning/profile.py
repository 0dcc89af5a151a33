"""Detailed per-layer measurements for the planner: the time of each action kind, activation
and weight bytes, the optimizer update, the all-reduce and transfers between devices."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from hybrid.engine.layer_costs import block as _block
from hybrid.engine.stage import StageReplica, TensorSpec

__all__ = [
    "LayerMeasurement",
    "LayerTiming",
    "ModelMeasurement",
    "measure_all_reduce",
    "measure_layers",
    "measure_transfer",
]


@dataclasses.dataclass(frozen=True)
class LayerTiming:
    """One layer, run as a one-layer pipeline stage on one device, at one micro-batch size.

    Every time is seconds of compute net of the fixed cost of launching a program (measured
    on an identity layer and subtracted, see :class:`ModelMeasurement`), so the planner can
    add back its own per-action overhead once per scheduled action.

    Attributes:
      batch: the micro-batch size measured.
      forward: an F action (the forward program).
      backward: a B action from stored activations (remat "never"): input and weight
        gradients from the taped forward.
      recompute_backward: the backward part of the fused forward+backward program (a
        rematerialized B costs ``forward + recompute_backward``).
      input_backward: the backward part of a forward + input-gradient-only program (the B
        of a split backward beyond its forward); 0 when the input has no gradient.
      stored_bytes: bytes a taped forward holds until its backward (output and intermediates,
        not the input, which exists already); None without allocator statistics.
      working_bytes: the allocator's peak above what was held before, while one fused
        forward+backward runs; None without allocator statistics.
      output_bytes: bytes of the layer output for this batch (what crosses a stage boundary).
    """

    batch: int
    forward: float
    backward: float
    recompute_backward: float
    input_backward: float
    stored_bytes: int | None
    working_bytes: int | None
    output_bytes: int


@dataclasses.dataclass(frozen=True)
class LayerMeasurement:
    """What :func:`measure_layers` found for one layer.

    Attributes:
      name: the Keras layer name.
      param_bytes: bytes of its trainable weights.
      param_tensors: how many trainable weight arrays it has (each backward accumulates
        one gradient per array).
      update: seconds of one optimizer update of its weights (0 without an optimizer), net of
        the launch cost.
      timings: one :class:`LayerTiming` per measured micro-batch size, in increasing size.
    """

    name: str
    param_bytes: int
    param_tensors: int
    update: float
    timings: tuple[LayerTiming, ...]


@dataclasses.dataclass(frozen=True)
class ModelMeasurement:
    """Per-layer measurements of a model on one device.

    Attributes:
      layers: one :class:`LayerMeasurement` per layer, in model order.
      input_bytes: bytes of one example of the model input.
      launch_overhead: seconds per repetition of the identity layer's forward (a program
        that does next to no work, launched inside a graph); every timing above is net of
        its identity twin.
      device: where it was measured.
    """

    layers: tuple[LayerMeasurement, ...]
    input_bytes: int
    launch_overhead: float
    device: str


def _median_seconds(fn: Callable[[], Sequence[tf.Tensor]], repeats: int) -> float:
    _block(fn())  # traces and compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _block(fn())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _allocator_stats(device: str) -> bool:
    try:
        tf.config.experimental.get_memory_info(_memory_device(device))
    except ValueError:
        return False
    return True


def _memory_device(device: str) -> str:
    # get_memory_info wants "CPU:0" / "GPU:1", not a full device name.
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type or 'CPU'}:{spec.device_index or 0}"


class _StagePrograms:
    """The programs the engine runs for one stage, each issued ``chain`` times in a row
    inside one graph function (every repetition waits for the previous one), so the cost of
    launching the graph function is shared by ``chain`` repetitions.

    ``forward``: F; ``stored``: F with a tape, then its backward (remat "never"); ``fused``:
    the one-program forward+backward; ``input_only``: F, then a recomputing backward for the
    input gradient only.
    """

    def __init__(
        self, stage: StageReplica, labels: tf.Tensor | None, need_dx: bool, chain: int
    ) -> None:
        seed = tf.constant([0, 0], tf.int64)
        self.stage, self.labels, self._seed = stage, labels, seed

        def forward(x: tf.Tensor, dy: tf.Tensor) -> list[tf.Tensor]:
            return [stage.forward(x, labels, seed, True, False).output]

        def stored(x: tf.Tensor, dy: tf.Tensor) -> list[tf.Tensor]:
            saved = stage.forward(x, labels, seed, False, False)
            dx, dw = stage.backward(saved, dy, need_dx=need_dx, need_dw=True)
            return [saved.output] + ([dx] if dx is not None else []) + dw

        def fused(x: tf.Tensor, dy: tf.Tensor) -> list[tf.Tensor]:
            y, dx, dw = stage.forward_backward(x, labels, seed, dy, need_dx)
            return [y] + ([dx] if dx is not None else []) + dw

        def input_only(x: tf.Tensor, dy: tf.Tensor) -> list[tf.Tensor]:
            saved = stage.forward(x, labels, seed, True, False)
            dx, _ = stage.backward(saved, dy, need_dx=True, need_dw=False)
            return [saved.output] + ([dx] if dx is not None else [])

        def chained(body: Callable[[tf.Tensor, tf.Tensor], list[tf.Tensor]]) -> Any:
            def run(x: tf.Tensor, dy: tf.Tensor) -> list[tf.Tensor]:
                outputs = body(x, dy)
                for _ in range(chain - 1):
                    # The next repetition's input is x plus a zero computed from every output
                    # of this one: the repetitions run one after another, none is a
                    # duplicate of another, and every output is consumed.
                    firsts = [tf.cast(tf.reshape(t, [-1])[0], tf.float32) for t in outputs]
                    zero = tf.math.multiply_no_nan(tf.add_n(firsts), 0.0)
                    outputs = body(x + tf.cast(zero, x.dtype), dy)
                return outputs

            return tf.function(run, autograph=False)

        self.forward = chained(forward)
        self.stored = chained(stored)
        self.fused = chained(fused)
        self.input_only = chained(input_only)
        self.fused_once = tf.function(fused, autograph=False)

    def taped_forward(self, x: tf.Tensor) -> Any:
        """Eagerly: the record a stored-activation forward keeps (it holds the tape)."""
        return self.stage.forward(x, self.labels, self._seed, False, False)


def _identity_programs(device: str, chain: int, jit_compile: bool) -> _StagePrograms:
    """The same programs on an identity layer: what launching them costs, with no work."""
    with tf.device(device):
        identity = keras.layers.Dense(1, use_bias=False)  # one weight: next to no work
        identity(tf.zeros((1, 1)))
        stage = StageReplica(
            0, [identity], device, TensorSpec((1,), "float32"), None, None, jit_compile
        )
        return _StagePrograms(stage, None, need_dx=True, chain=chain)


def _measure_memory(
    device: str, programs: _StagePrograms, x: tf.Tensor, dy: tf.Tensor
) -> tuple[int | None, int | None]:
    """(bytes a taped forward holds, peak bytes while the fused forward+backward runs)."""
    if not _allocator_stats(device):
        return None, None
    where = _memory_device(device)
    _block(programs.fused_once(x, dy))  # traced and compiled before anything is counted
    before = tf.config.experimental.get_memory_info(where)["current"]
    saved = programs.taped_forward(x)
    _block([saved.output])
    stored = tf.config.experimental.get_memory_info(where)["current"] - before
    del saved
    tf.config.experimental.reset_memory_stats(where)
    before = tf.config.experimental.get_memory_info(where)["current"]
    _block(programs.fused_once(x, dy))
    working = tf.config.experimental.get_memory_info(where)["peak"] - before
    return max(0, stored), max(0, working)


_PROGRAMS = ("forward", "stored", "fused", "input_only")


def _signature(layer: keras.layers.Layer, spec: TensorSpec, last: bool) -> str:
    """Layers with equal signatures cost the same: same class and configuration (names and
    seeds aside), same input, same position (last or not)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("name", "seed")}
        if isinstance(value, list | tuple):
            return [strip(v) for v in value]
        return value

    config = strip(layer.get_config())
    return repr((type(layer).__qualname__, config, spec, last))


class _Probe:
    """One distinct layer at one batch size: its programs, inputs and collected times."""

    def __init__(
        self,
        stage: StageReplica,
        spec: TensorSpec,
        out_spec: TensorSpec,
        batch: int,
        labels_shape: tuple[int, ...] | None,
        labels_dtype: str,
        chain: int,
    ) -> None:
        self.batch = batch
        self.need_dx = tf.as_dtype(spec.dtype).is_floating
        out_shape = (batch,) + tuple(int(d or 1) for d in out_spec.shape)
        self.output_bytes = _prod(out_shape) * tf.as_dtype(out_spec.dtype).size
        with tf.device(stage.device):
            self.x = tf.constant(spec.zeros(batch))
            labels = None
            if labels_shape is not None:
                labels = tf.zeros((batch,) + labels_shape, labels_dtype)
                self.dy = tf.constant(1.0 / batch)  # d(mean loss of the step) / d(this loss)
            else:
                self.dy = tf.ones(out_shape, out_spec.dtype)
        self.programs = _StagePrograms(stage, labels, self.need_dx, chain)
        self.names = _PROGRAMS if self.need_dx else _PROGRAMS[:3]
        self.times: dict[str, list[float]] = {name: [] for name in self.names}
        self.memory: tuple[int | None, int | None] = (None, None)


def _run_seconds(program: Any, args: tuple[tf.Tensor, ...]) -> float:
    start = time.perf_counter()
    _block(program(*args))
    return time.perf_counter() - start


def measure_layers(
    layers: Sequence[keras.layers.Layer],
    input_shape: Sequence[int | None],
    input_dtype: str,
    batch_sizes: Sequence[int],
    device: str,
    loss: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] | None = None,
    target_shape: Sequence[int] | None = None,
    target_dtype: str = "int32",
    optimizer: Callable[[], keras.optimizers.Optimizer] | None = None,
    repeats: int = 7,
    chain: int = 8,
    jit_compile: bool = True,
) -> ModelMeasurement:
    """Times and sizes every layer of a model as its own one-layer stage on ``device``.

    Conceptually, for each layer l and each batch size b, with ``x`` a sample input of
    layer l holding b examples (zeros; token ids 0)::

        F      = t(stage_l.forward(x))                          - t(same on identity)
        B      = t(stage_l.forward(x, taped) + its backward)     - t(same on identity) - F
        B_re   = t(stage_l.forward_backward(x))                  - t(same on identity) - F
        B_dx   = t(stage_l.forward(x) + backward, dx only)       - t(same on identity) - 2F
        stored = allocator bytes stage_l's taped forward holds
        work   = the allocator's peak above that while forward_backward runs

    where t is the time of one of ``chain`` back-to-back repetitions inside one graph
    function, with the programs the engine runs (:class:`hybrid.engine.stage.StageReplica`), and
    "identity" is a one-weight layer whose programs do next to no work: the difference is
    compute only. Every program is compiled first; then ``repeats`` rounds time every
    program of every layer once, each beside its identity twin, and each figure is the
    median over the rounds (so a busy spell on a shared machine hits all layers alike).
    Layers with the same class, configuration (names and seeds aside) and input are
    measured once. Memory needs TensorFlow's BFC allocator on CPU
    (``TF_CPU_ALLOCATOR_USE_BFC=true`` before TensorFlow starts); without it the byte
    fields are None.

    Args:
      layers: the model's layers in order (built here if they are not).
      input_shape: the model input shape without the batch dimension.
      input_dtype: its dtype, e.g. "float32", or "int32" for token ids.
      batch_sizes: micro-batch sizes to measure at.
      device: where to measure (one device of the mesh).
      loss: when given, the last layer is measured as the last stage, with this loss on
        zero targets of ``target_shape`` (default: the output shape without its last axis,
        i.e. sparse class ids) and ``target_dtype``.
      optimizer: a zero-argument factory; when given, each layer's update is timed too.
      repeats: timing rounds.
      chain: back-to-back repetitions per timed run.

    Raises:
      ValueError: no batch size, or one below 1.
    """
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
    specs = [TensorSpec(tuple(input_shape), tf.as_dtype(input_dtype).name)]
    with tf.device(device):
        y = tf.convert_to_tensor(specs[0].zeros())
        for layer in layers:
            y = layer(y)
            specs.append(TensorSpec(tuple(y.shape[1:]), y.dtype.name))
    out_shape = tuple(int(d or 1) for d in specs[-1].shape)
    labels_shape = tuple(target_shape) if target_shape is not None else out_shape[:-1]

    identity = _identity_programs(device, chain, jit_compile)
    with tf.device(device):
        base_args = (tf.zeros((1, 1)), tf.ones((1, 1)))
    for name in _PROGRAMS:
        _block(getattr(identity, name)(*base_args))

    stages: dict[str, StageReplica] = {}
    probes: dict[str, list[_Probe]] = {}
    keys = []
    for i, layer in enumerate(layers):
        last = loss is not None and i == len(layers) - 1
        key = _signature(layer, specs[i], last)
        keys.append(key)
        if key in stages:
            continue
        stages[key] = StageReplica(
            i, [layer], device, specs[i], optimizer, loss if last else None, jit_compile
        )
        probes[key] = []
        for b in sizes:
            probe = _Probe(
                stages[key],
                specs[i],
                specs[i + 1],
                b,
                labels_shape if last else None,
                target_dtype,
                chain,
            )
            for name in probe.names:
                _block(getattr(probe.programs, name)(probe.x, probe.dy))  # compile
            probe.memory = _measure_memory(device, probe.programs, probe.x, probe.dy)
            probes[key].append(probe)

    baseline: dict[str, list[float]] = {name: [] for name in _PROGRAMS}
    for _ in range(repeats):
        for group in probes.values():
            for probe in group:
                for name in probe.names:
                    probe.times[name].append(
                        _run_seconds(getattr(probe.programs, name), (probe.x, probe.dy))
                    )
                    baseline[name].append(_run_seconds(getattr(identity, name), base_args))
    base = {name: statistics.median(v) for name, v in baseline.items()}
    launch = max(0.0, base["forward"] / chain)

    def net(probe: _Probe, name: str) -> float:
        return (statistics.median(probe.times[name]) - base[name]) / chain

    measured: dict[str, LayerMeasurement] = {}
    for key, group in probes.items():
        timings = []
        for probe in group:
            f = max(0.0, net(probe, "forward"))
            timings.append(
                LayerTiming(
                    batch=probe.batch,
                    forward=f,
                    backward=max(0.0, net(probe, "stored") - f),
                    recompute_backward=max(0.0, net(probe, "fused") - f),
                    input_backward=(
                        max(0.0, net(probe, "input_only") - 2 * f) if probe.need_dx else 0.0
                    ),
                    stored_bytes=probe.memory[0],
                    working_bytes=probe.memory[1],
                    output_bytes=probe.output_bytes,
                )
            )
        stage = stages[key]
        update = 0.0
        if optimizer is not None and stage.trainable_variables:
            update = _update_seconds(stage, device, repeats)
        param_bytes = sum(
            _prod(v.shape) * tf.as_dtype(v.dtype).size for v in stage.trainable_variables
        )
        tensors = len(stage.trainable_variables)
        measured[key] = LayerMeasurement("", param_bytes, tensors, update, tuple(timings))
    rows = tuple(
        dataclasses.replace(measured[key], name=layer.name)
        for key, layer in zip(keys, layers, strict=True)
    )
    return ModelMeasurement(rows, int(specs[0].zeros(1).nbytes), launch, device)


def _update_seconds(stage: StageReplica, device: str, repeats: int) -> float:
    """Seconds of one optimizer update of ``stage``'s weights, beyond launching a program
    (an update of zero gradients, minus the same graph function with no update in it)."""
    with tf.device(device):
        zeros = [tf.zeros_like(v) for v in stage.trainable_variables]

        def apply(grads: list[tf.Tensor]) -> tf.Tensor:
            stage.apply_gradients(grads)
            return tf.constant(0)

        def nothing(grads: list[tf.Tensor]) -> tf.Tensor:
            return tf.constant(0)

        program = tf.function(apply, autograph=False)
        empty = tf.function(nothing, autograph=False)
        return max(
            0.0,
            _median_seconds(lambda: [program(zeros)], repeats)
            - _median_seconds(lambda: [empty(zeros)], repeats),
        )


def _prod(shape: Sequence[int | None]) -> int:
    out = 1
    for d in shape:
        out *= int(d or 1)
    return out


def measure_all_reduce(
    devices: Sequence[str], sizes_bytes: Sequence[int], repeats: int = 7
) -> list[float]:
    """Median seconds of one mean all-reduce of a float32 vector over ``devices``, per size,
    beyond launching the graph function that runs it.

    Runs the engine's own collective (:class:`hybrid.engine.collectives.ReplicaGroup`), one vector
    per device, inside a graph function, timed in alternation with the same function without
    the collective (its launch cost is subtracted).
    """
    from hybrid.engine.collectives import ReplicaGroup

    group = ReplicaGroup(devices)

    def reduce(*tensors: tf.Tensor) -> list[tf.Tensor]:
        return [t for row in group.all_reduce_mean([[t] for t in tensors]) for t in row]

    def nothing(*tensors: tf.Tensor) -> list[tf.Tensor]:
        return [tf.identity(t) for t in tensors]

    out = []
    for size in sizes_bytes:
        values = []
        for device in devices:
            with tf.device(device):
                values.append(tf.ones([max(1, int(size) // 4)]))
        out.append(
            _net_of(
                tf.function(reduce, autograph=False),
                tf.function(nothing, autograph=False),
                tuple(values),
                repeats,
            )
        )
    return out


def measure_transfer(
    source: str, target: str, sizes_bytes: Sequence[int], repeats: int = 7
) -> list[float]:
    """Median seconds to hand a float32 tensor made on ``source`` to an op on ``target``, per
    size, beyond the same graph function with both ops on ``source``."""

    def hand_over(where: str, n: int) -> Any:
        def run() -> list[tf.Tensor]:
            with tf.device(source):
                t = tf.fill([n], 1.0)
            with tf.device(where):
                return [tf.reduce_sum(t)]

        return tf.function(run, autograph=False)

    out = []
    for size in sizes_bytes:
        n = max(1, int(size) // 4)
        out.append(_net_of(hand_over(target, n), hand_over(source, n), (), repeats))
    return out


def _net_of(program: Any, baseline: Any, args: tuple[tf.Tensor, ...], repeats: int) -> float:
    """Median seconds of ``program`` minus median seconds of ``baseline``, timed in turns."""
    _block(program(*args))
    _block(baseline(*args))
    mine, base = [], []
    for _ in range(repeats):
        mine.append(_run_seconds(program, args))
        base.append(_run_seconds(baseline, args))
    return max(0.0, statistics.median(mine) - statistics.median(base))
