"""The programs the profiler times for one layer: the engine's forward, stored-activation
backward, fused forward+backward and input-gradient-only programs of a one-layer stage,
chained so launch costs are shared; their identity twins; the inputs of one layer at one
micro-batch size (:class:`Probe`); and the allocator bytes a layer holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from hybrid.engine.model.layer_costs import block, weight_bytes
from hybrid.engine.step.stage import StageReplica, TensorSpec
from hybrid.engine.traced import traced
from hybrid.planning.model_calls import ModelCalls

__all__ = [
    "PROGRAMS",
    "Memory",
    "Probe",
    "ProgramArgs",
    "StagePrograms",
    "identity_programs",
    "measure_memory",
    "signature",
    "with_repeats",
]

# The programs of :class:`StagePrograms` the profiler times, by attribute name.
# (input_only before stored: the split backward's cut serves the whole backward too, so
# the two share one forward program.)
PROGRAMS = ("forward", "input_only", "stored", "fused")

Tensors = list[tf.Tensor]
Grads = list[tf.Tensor | None]  # an output gradient per output (None: not a float)


def _allocator_stats(device: str) -> bool:
    """Whether TensorFlow's allocator on ``device`` reports memory statistics."""
    try:
        tf.config.experimental.get_memory_info(_memory_device(device))
    except ValueError:
        return False
    return True


def _memory_device(device: str) -> str:
    """``device`` as ``get_memory_info`` names it: "CPU:0" / "GPU:1", not a full name."""
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type or 'CPU'}:{spec.device_index or 0}"


class StagePrograms:
    """The programs the engine runs for one stage, each repeated ``repeats`` times in a row
    inside one graph function (every repetition waits for the previous one), so the cost of
    launching the graph function is shared by the repetitions.

    ``forward``: F; ``stored``: F keeping activations, then its backward (remat "never");
    ``fused``: the one-program forward+backward; ``input_only``: F keeping activations for
    a split backward, then its B (the input gradient only). Each is called as
    ``program(xs, dys, labels, repeats)``: the stage's inputs, its output gradients (None
    for an output that is not a float), ``[labels]`` for a last stage (else ``[]``) and a
    scalar int32. One set of programs serves every micro-batch size, traced per size
    (:meth:`trace`).
    """

    def __init__(self, stage: StageReplica) -> None:
        seed = tf.constant([0, 0], tf.int64)
        need_dx = any(tf.as_dtype(spec.dtype).is_floating for spec in stage.input_specs)
        self.stage, self._seed, self.need_dx = stage, seed, need_dx
        self.names = tuple(name for name in PROGRAMS if need_dx or name != "input_only")

        with_labels = _labels_record

        def forward(xs: Tensors, dys: Grads, labels: Tensors) -> Tensors:
            return stage.forward(xs, with_labels(labels), seed, True, False).output

        def stored(xs: Tensors, dys: Grads, labels: Tensors) -> Tensors:
            saved = stage.forward(xs, with_labels(labels), seed, False, False, need_dx)
            dx, dw = stage.backward(saved, list(dys), need_dx=need_dx, need_dw=True)
            return saved.output + _present(dx) + dw

        def fused(xs: Tensors, dys: Grads, labels: Tensors) -> Tensors:
            run = stage.forward_backward(xs, with_labels(labels), seed, list(dys), need_dx)
            y, dx, dw, _, _ = run
            return y + _present(dx) + dw

        def input_only(xs: Tensors, dys: Grads, labels: Tensors) -> Tensors:
            saved = stage.forward(xs, with_labels(labels), seed, False, True)
            dx, _ = stage.backward(saved, list(dys), need_dx=True, need_dw=False)
            return saved.output + _present(dx)

        def repeated(body: Callable[[Tensors, Grads, Tensors], Tensors]) -> Any:
            def run(xs: Tensors, dys: Grads, labels: Tensors, repeats: tf.Tensor) -> Tensors:
                outputs = body(xs, dys, labels)

                def again(i: tf.Tensor, outputs: Tensors) -> tuple[tf.Tensor, Tensors]:
                    # The next repetition's inputs are xs plus a zero computed from every
                    # output of this one: the repetitions run one after another, none is a
                    # duplicate of another, and every output is consumed. (A loop: its body
                    # is traced once, not once per repetition.)
                    firsts = [tf.cast(tf.reshape(t, [-1])[0], tf.float32) for t in outputs]
                    zero = tf.math.multiply_no_nan(tf.add_n(firsts), 0.0)
                    return i + 1, body([x + tf.cast(zero, x.dtype) for x in xs], dys, labels)

                _, outputs = tf.while_loop(
                    lambda i, _: i < repeats - 1, again, (tf.constant(0), outputs)
                )
                return outputs

            return traced(run)

        self.forward = repeated(forward)
        self.stored = repeated(stored)
        self.fused = repeated(fused)
        self.input_only = repeated(input_only)
        self.fused_once = traced(fused)  # what the engine runs: the memory is measured on it

    def trace(self, args: ProgramArgs) -> None:
        """Traces every program for ``args``'s shapes (each batch size is a trace of its
        own, as the engine's programs are: a trace with the batch dimension open would keep
        other residuals)."""
        for name in self.names:
            getattr(self, name).get_concrete_function(*args)
        self.fused_once.get_concrete_function(*args[:3])

    def kept_forward(self, xs: Tensors, labels: Tensors) -> Any:
        """Eagerly: the record a stored-activation forward keeps (its residuals)."""
        return self.stage.forward(xs, _labels_record(labels), self._seed, False, False)


# (inputs, output gradients, [labels] or [], repetitions): what a program is called with.
ProgramArgs = tuple[Tensors, Grads, Tensors, tf.Tensor]


def _labels_record(labels: Tensors) -> Any:
    """The labels as a last stage's forward takes them (labels, sample weights, class
    weights); None for a stage that is not last (no labels)."""
    return (labels, None, None) if labels else None


def with_repeats(args: ProgramArgs, repeats: int) -> ProgramArgs:
    """``args`` with ``repeats`` repetitions per call (the count on the same device)."""
    xs, dys, labels, count = args
    with tf.device(count.device):
        return xs, dys, labels, tf.constant(repeats)


def _present(grads: list[tf.Tensor | None] | None) -> list[tf.Tensor]:
    """The input gradients that exist (an integer input has none)."""
    return [g for g in grads or [] if g is not None]


def identity_programs(device: str, jit_compile: bool) -> StagePrograms:
    """The same programs on an identity layer: what launching them costs, with no work."""
    with tf.device(device):
        identity = keras.layers.Dense(1, use_bias=False)  # one weight: next to no work
        identity(tf.zeros((1, 1)))
        stage = StageReplica(
            0, [identity], device, TensorSpec((1,), "float32"), None, None, jit_compile
        )
        return StagePrograms(stage)


class Memory(NamedTuple):
    """What a probe's stage holds (bytes; see :func:`measure_memory`).

    Attributes:
      stored: what its kept forward holds for the backward beyond its outputs (the
        residuals its program returns, its statistics); where the forward keeps a tape
        (a stage not cut into programs), the allocator's bytes, outputs included.
      working: the allocator's peak above what was held before while the fused
        forward+backward runs, the least of :data:`HISTORIES` runs, less its dense
        weight gradients (counted as the running sums they are added to).
      keeps: per output of the forward, whether the backward reads it (it is one of the
        residuals); None where ``stored`` counts the outputs already.
      reads: per stage input, whether the backward reads it (None: not known).
    """

    stored: int
    working: int
    keeps: tuple[bool, ...] | None
    reads: tuple[bool, ...] | None


def measure_memory(device: str, programs: StagePrograms, args: ProgramArgs) -> Memory | None:
    """What the stage holds for its backward, and its working peak (:class:`Memory`); None
    where the device's allocator keeps no statistics.

    What the kept forward holds is counted from its tensors, the bytes they request: the
    allocator's count would add the chunk each request happened to be served from, which
    depends on what was allocated before (BFC serves a request with a free chunk of up to
    twice its size unsplit). Its outputs are counted apart (``keeps``): inside a stage of
    several layers, a layer's output is kept only where a backward reads it."""
    if not _allocator_stats(device):
        return None
    where = _memory_device(device)
    xs, dys, labels, _ = args
    block(programs.fused_once(xs, dys, labels))  # compiled before anything is counted
    before = tf.config.experimental.get_memory_info(where)["current"]
    saved = programs.kept_forward(xs, labels)
    block(saved.output)
    stored = tf.config.experimental.get_memory_info(where)["current"] - before
    keeps = reads = None
    if saved.kept is not None:
        cut = saved.kept.programs
        outputs = set(cut.output_names)
        residual = zip(cut.residual_names, saved.kept.residuals, strict=True)
        own = [t for n, t in residual if n not in outputs]
        stored = int(weight_bytes(own + saved.stats + saved.activity))
        residuals = set(cut.residual_names)
        keeps = tuple(n in residuals for n in cut.output_names[: len(saved.output)])
        reads = tuple(cut.reads[: len(xs)])
    del saved
    peaks: list[int] = []
    held: Tensors = []
    for _ in range(HISTORIES):
        if peaks:  # another history: free chunks the earlier runs did not leave
            held += _fragments(device, peaks[-1])
        tf.config.experimental.reset_memory_stats(where)
        before = tf.config.experimental.get_memory_info(where)["current"]
        block(programs.fused_once(xs, dys, labels))
        peaks.append(tf.config.experimental.get_memory_info(where)["peak"] - before)
    del held
    working = min(peaks) - _dense_gradient_bytes(programs.stage)
    return Memory(max(0, stored), max(0, working), keeps, reads)


def _dense_gradient_bytes(stage: StageReplica) -> int:
    """The bytes of the stage's dense weight gradients: the fused program returns them, the
    engine's programs add them to the running sums in place (the memory model's
    "gradients" term), so a working set does not count them."""
    pairs = zip(stage.trainable_variables, stage.sparse, strict=True)
    return int(weight_bytes([v for v, sparse in pairs if not sparse]))


# The working peak is the smallest of this many runs, each after another allocation history.
HISTORIES = 3


def _fragments(device: str, size: int) -> Tensors:
    """Tensors to hold while the next run is measured: every other one of a series of
    halving sizes from ``size`` / 2 is dropped, leaving free chunks of those sizes.

    BFC's bytes in use count whole chunks, and it serves a request with a free chunk of
    up to twice its size unsplit: the same program's peak reads up to twice its requests,
    depending on the free chunks earlier allocations left (measured: a MobileNetV2
    depthwise convolution's backward read 19.3 to 35.1 MiB). Its requests are the least
    of the readings; a few histories come close to it."""
    with tf.device(device):
        series = [tf.zeros([max(1, size >> (j + 3))], tf.float32) for j in range(8)]
    return series[::2]


def signature(calls: ModelCalls, i: int, last: bool) -> str:
    """Calls with equal signatures cost the same: the same layer class and configuration
    (names and seeds aside), the same inputs and non-tensor arguments, the same position
    (last or not). A layer without a configuration (a user's layer with no
    ``get_config``) is its own signature: measured alone."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("name", "seed")}
        if isinstance(value, list | tuple):
            return [strip(v) for v in value]
        return value

    call = calls.calls[i]
    try:
        config = strip(call.layer.get_config())
    except Exception:  # noqa: BLE001 - the layer's own code (not given, or broken: KerasHub
        config = f"id {id(call.layer)}"  # 0.32's Llama decoder): measured alone
    inputs = [calls.specs[k] for k in call.inputs]
    arguments = calls.arguments(i)
    return repr((type(call.layer).__qualname__, config, inputs, arguments, last))


class Probe:
    """One distinct layer call at one batch size: its inputs and collected times, run by
    the programs of its stage (shared by every batch size).

    ``boundary_bytes``: bytes per example crossing the cut after the call (what a stage
    boundary there sends)."""

    def __init__(
        self,
        programs: StagePrograms,
        out_specs: list[TensorSpec],
        boundary_bytes: float,
        batch: int,
        labels_shape: tuple[int, ...] | None,
        labels_dtype: str,
        chain: int,
    ) -> None:
        self.batch, self.programs = batch, programs
        stage = programs.stage
        self.output_bytes = int(boundary_bytes * batch)
        with tf.device(stage.device):
            xs = [tf.constant(spec.zeros(batch)) for spec in stage.input_specs]
            labels = []
            dys: Grads
            if labels_shape is not None:
                labels = [tf.zeros((batch,) + labels_shape, labels_dtype)]
                # The last stage outputs its loss's [[numerator, denominator]]; the
                # engine's backward starts from d(numerator) = 1 / divisor.
                dys = [tf.constant([[1.0 / batch, 0.0]])]
            else:
                dys = [
                    tf.ones((batch,) + tuple(int(d or 1) for d in spec.shape), spec.dtype)
                    if tf.as_dtype(spec.dtype).is_floating
                    else None
                    for spec in out_specs
                ]
            self.args: ProgramArgs = (xs, dys, labels, tf.constant(chain))
        self.times: dict[str, list[float]] = {name: [] for name in self.names}
        self.memory: Memory | None = None

    @property
    def need_dx(self) -> bool:
        """Whether its stage's input has a gradient (its programs')."""
        return bool(self.programs.need_dx)

    @property
    def names(self) -> tuple[str, ...]:
        """The programs it times (its stage's)."""
        return tuple(self.programs.names)
