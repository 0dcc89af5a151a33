"""What the launcher does around each training step, as a Keras callback of ``fit``:
time it, stop on a non-finite loss, log, write TensorBoard scalars, checkpoint, profile,
report the timed steps of ``--timeline_every`` (per device compute, transfers, all-reduce,
idle: a log line, TensorBoard scalars under ``timeline/``, a Gantt PNG, and a warning when
communication passes 30 % of the step), and call the caller's ``step_callback`` (the
supervisor and the fault-injection tests use it).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf

from hybrid.core import device_limits
from hybrid.core.memory import format_bytes
from hybrid.engine.api.pipeline import Pipeline
from hybrid.engine.step.clocks import StepView
from hybrid.run import resume, timeline
from hybrid.run.checkpoint import Checkpointer

if TYPE_CHECKING:
    from hybrid.run.train_config import TrainConfig

__all__ = ["NonFiniteLossError", "StepCallback", "Steps"]


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or Inf; the message names the step and the last good checkpoint."""


StepCallback = Callable[[int, float], None]
NAMES = ("compute", "transfer", "all-reduce", "idle")  # a timed step's shares, in order


class _Progress:
    """Step times after the first (compiling) step of this call, timed steps left out (they
    run each action on its own), for rates and the ETA."""

    def __init__(self, batch: int, remaining: int) -> None:
        self.batch, self.remaining = batch, remaining
        self.counted, self.seconds, self.last = 0, 0.0, 0.0

    def add(self, seconds: float, left_out: bool, steps: int = 1) -> None:
        """``steps`` steps (one execution) took ``seconds``."""
        self.remaining -= steps
        self.last = seconds / steps
        if not left_out:
            self.counted += steps
            self.seconds += seconds

    @property
    def examples_per_second(self) -> float:
        return self.batch * self.counted / self.seconds if self.counted else 0.0

    @property
    def eta(self) -> str:
        per_step = self.seconds / self.counted if self.counted else self.last
        seconds = int(round(per_step * self.remaining))
        return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Steps(keras.callbacks.Callback):
    """What the launcher does around each step of ``fit``: times it, stops on a non-finite
    loss, logs and writes TensorBoard scalars, checkpoints, profiles, and calls the
    ``step_callback``; the model's step is ``start`` + the batch's index + 1. With
    ``steps_per_execution`` N > 1, ``fit`` calls it once per N steps (the batch index: the
    execution's last), and all of this happens for the execution's last step. Once ``stop``
    is set, the step just run is checkpointed (with a saver) and ``fit`` stops after it
    (``interrupted_at``).

    The first step of the call traces and compiles every stage program: it is announced
    before it runs and its time said after. With ``config.progress_bar`` a
    ``keras.utils.Progbar`` starts after it, so its ETA counts compiled steps only, and it
    shows the step's own loss (the figure of the log lines and the run's last line) and the
    model's metrics.
    """

    def __init__(
        self,
        config: TrainConfig,
        pipe: Pipeline,
        start: int,
        saver: Checkpointer | None,
        writer: tf.summary.SummaryWriter | None,
        log: Callable[[str], None],
        step_callback: StepCallback | None,
        stop: threading.Event | None = None,
    ) -> None:
        super().__init__()
        self.stop = stop
        self.interrupted_at: int | None = None
        self.config, self.pipe, self.start, self.saver = config, pipe, start, saver
        self.writer, self._write, self.step_callback = writer, log, step_callback
        self.progress = _Progress(config.data.global_batch_size, config.train_steps - start)
        self.losses: list[float] = []
        self.last_checkpoint: str | None = None
        self.began = 0.0
        self.first_step = start + 1  # the running execution's first step
        self.timeline_seen: StepView | None = None
        self.bar: keras.utils.Progbar | None = None
        self.compile_seconds: float | None = None
        self.validation: dict[str, float] = {}
        self.memory_reported = False
        self.timed_seen = False  # whether a timed step (--timeline_every) has run yet
        # The step whose update is complete while its after-step work runs (None once the
        # next step starts): a failure then can still checkpoint it (save_before_failing).
        self.finished: int | None = None
        self.saved: int | None = None

    def log(self, text: str) -> None:
        """A line of its own: while the progress bar is drawn (it leaves the cursor on its
        line), that line is ended first."""
        if self.bar is not None:
            sys.stdout.write("\n")
        self._write(text)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        step = self.first_step = self.start + batch + 1
        if batch == 0:
            self.log(f"compiling {_programs(self.pipe)} stage programs (the first step)...")
        if self.pipe.timed(step) and not self.timed_seen:
            self.log(
                f"compiling the timed step (step {step}: each action a program of its own, "
                "timed; --timeline_every steps are left out of examples/s and the ETA)..."
            )
        _profile(self.config, self.start + batch + 1, "start")
        self.finished = None
        self.began = time.perf_counter()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        # an execution's last step (Keras's index assumes a whole one; the last may be short)
        config, seconds = self.config, time.perf_counter() - self.began
        step = min(self.start + batch + 1, config.train_steps)
        loss = self.pipe.last_loss
        timed = self.pipe.timed(step)
        first = self.first_step == self.start + 1
        # a new number of steps per call, or the step after a first that ran the replicas
        # in turn (the step that runs them together is a trace of its own)
        traced = self.pipe.execution_traced and not first
        steps = step - self.first_step + 1
        self.progress.add(seconds, left_out=first or timed or traced, steps=steps)
        if traced:
            what = (
                f"step {step}" if steps == 1 else f"the execution of steps {self.first_step}-{step}"
            )
            self.log(f"traced {what} ({seconds:.1f} s, left out of examples/s and the ETA)")
        if timed and not self.timed_seen:
            self.timed_seen = True
            self.log(f"compiled and ran the timed step {step} in {self.progress.last:.1f} s")
        _profile(config, step, "stop")
        _check_finite(config, step, loss, self.last_checkpoint)
        self.finished = step
        self.losses.append(loss)
        metrics = _metrics(logs)
        if first:
            self.compile_seconds = seconds
            ran = f"step {step}" if steps == 1 else f"steps {self.first_step}-{step}"
            self.log(f"compiled and ran {ran} in {seconds:.1f} s")
            if config.progress_bar:
                self.bar = keras.utils.Progbar(
                    config.train_steps - self.start, stateful_metrics=["loss", *metrics]
                )
        if self.bar is not None:
            self.bar.update(step - self.start, [("loss", loss), *metrics.items()])
        if step % config.log_every == 0 or step == config.train_steps:
            rate = resume.learning_rate(self.pipe)
            _report(config, step, loss, rate, metrics, self.progress, self.log, self.writer)
            if not self.memory_reported:  # once, at the first log step
                self.memory_reported = True
                _report_memory(self.pipe, step, self.log, self.writer)
        view = self.pipe.last_timeline
        if view is not None and view is not self.timeline_seen:
            self.timeline_seen = view
            _report_timeline(config, self.pipe, step, view, self.log, self.writer)
        saved = False
        if self.saver and (
            (config.outputs.checkpoint_every and step % config.outputs.checkpoint_every == 0)
            or step == config.train_steps
        ):
            self.last_checkpoint, saved = self.saver.save(step), True
            self.saved = step
        if self.step_callback is not None:
            self.step_callback(step, loss)
        if self.stop is not None and self.stop.is_set():
            if self.saver and not saved:
                self.last_checkpoint, self.saved = self.saver.save(step), step
            self.interrupted_at = step
            self.pipe.stop_training = True

    def save_before_failing(self, err: BaseException) -> None:
        """After ``err`` ended the run: checkpoints the step whose update had finished when
        its after-step work failed (a report, a chart, your ``step_callback``), unless it is
        saved already, the loss was not finite, or ``err`` is TensorFlow's runtime error (a
        lost worker, a preempted TPU: the devices' state cannot be read back); a failure to
        save is logged, ``err`` is what the caller raises."""
        step = self.finished
        if self.saver is None or step is None or step == self.saved:
            return
        if isinstance(err, tf.errors.OpError):
            return
        try:
            self.last_checkpoint, self.saved = self.saver.save(step), step
        except Exception as failed:  # noqa: BLE001 - err, not this, is the run's error
            self.log(f"could not save step {step} before stopping: {failed}")
            return
        self.log(f"saved {os.path.basename(self.last_checkpoint)} before stopping")

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        """Keeps the validation figures (``val_*``) of ``fit``'s end: logged and written."""
        self.validation = {k: float(v) for k, v in (logs or {}).items() if k.startswith("val_")}
        if not self.validation:
            return
        step = self.start + len(self.losses)
        self.log(
            f"validation after step {step}: "
            + "  ".join(f"{k} {v:.4f}" for k, v in self.validation.items())
        )
        if self.writer is not None:
            with self.writer.as_default(step=step):
                for name, value in self.validation.items():
                    tf.summary.scalar(name, value)


def _programs(pipe: Pipeline) -> int:
    """How many stage programs a step runs: one per model stage per device."""
    return sum(len(row) for row in pipe.stages)


def _metrics(logs: Any) -> dict[str, float]:
    """The model's compiled metrics among ``fit``'s batch logs (Keras's running values over
    the epoch, as its progress bar shows them); the loss is reported on its own."""
    return {
        k: float(v)
        for k, v in (logs or {}).items()
        if k != "loss" and not k.endswith("_loss") and not k.startswith("val_")
    }


def _check_finite(config: TrainConfig, step: int, loss: float, checkpoint: str | None) -> None:
    """Raises NonFiniteLossError (naming the step and the last good checkpoint) on NaN/Inf."""
    if math.isfinite(loss):
        return
    kept = (
        f"the last good checkpoint is {checkpoint}" if checkpoint else "no checkpoint was written"
    )
    raise NonFiniteLossError(
        f"loss is {loss} at step {step}; stopping without saving ({kept}). Lower "
        f"learning_rate (now {config.optimizer.learning_rate}) or check the data"
    )


def _report(
    config: TrainConfig,
    step: int,
    loss: float,
    rate: float,
    metrics: dict[str, float],
    progress: _Progress,
    log: Callable[[str], None],
    writer: tf.summary.SummaryWriter | None,
) -> None:
    """One progress line (unless the progress bar shows), and the TensorBoard scalars when
    a writer is open (``rate``: the learning rate the optimizer used; ``metrics``: the
    model's compiled metrics)."""
    if not config.progress_bar:
        shown = "".join(f"  {name} {value:.4f}" for name, value in metrics.items())
        log(
            f"step {step:6d}/{config.train_steps}  loss {loss:.4f}{shown}  "
            f"examples/s {progress.examples_per_second:9.1f}  "
            f"step_time {progress.last * 1e3:8.1f} ms  eta {progress.eta}"
        )
    if writer is not None:
        _scalars(writer, step, loss, rate, metrics, progress)


def _scalars(
    writer: tf.summary.SummaryWriter,
    step: int,
    loss: float,
    rate: float,
    metrics: dict[str, float],
    progress: _Progress,
) -> None:
    with writer.as_default(step=step):
        tf.summary.scalar("loss", loss)
        for name, value in metrics.items():
            tf.summary.scalar(name, value)
        tf.summary.scalar("learning_rate", rate)
        tf.summary.scalar("examples_per_second", progress.examples_per_second)
        tf.summary.scalar("step_time_ms", progress.last * 1e3)


def stage_peaks(
    devices: list[str], read: Callable[[str], dict[str, int]] | None = None
) -> list[int] | None:
    """Each pipeline device's peak allocated bytes (``devices``: replica 0's, one per stage
    row), as its own allocator reports them: a capped local worker's, asked of its process
    (``hybrid.core.device_limits.memory_info``), else the device's
    (``tf.config.experimental.get_memory_info``); None where the devices share one allocator
    (the simulated CPU devices of one process: each would report the whole process) or
    report nothing."""
    if read is None:
        own = [device_limits.memory_info(device) for device in devices]
        if all(info is not None for info in own):
            return [int(info["peak"]) for info in own if info is not None]
        read = tf.config.experimental.get_memory_info
    if any(tf.DeviceSpec.from_string(d).device_type in (None, "CPU") for d in devices):
        return None
    try:
        return [int(read(device)["peak"]) for device in devices]
    except (ValueError, RuntimeError, KeyError):
        return None


def _report_memory(pipe: Pipeline, step: int, log: Callable[[str], None], writer: Any) -> None:
    """Each pipeline device row's peak memory (replica 0's devices) to the log: measured
    where the platform reports it per device (also to TensorBoard,
    ``memory/stage_<s>/peak_bytes``), beside the prediction from shapes
    (``pipe.predicted_memory()``); the prediction alone on simulated CPU devices."""
    peaks = stage_peaks(list(pipe.mesh.pipeline(0)))
    predicted = pipe.predicted_memory()
    if peaks is None and predicted is None:
        return
    rows = []
    for s in range(pipe.mesh.num_stages):
        measured = format_bytes(peaks[s]) if peaks is not None else ""
        guess = f"predicted {format_bytes(predicted[s])}" if predicted is not None else ""
        both = f"{measured} ({guess})" if measured and guess else measured or guess
        rows.append(f"stage {s} {both}")
    kind = "peak memory" if peaks is not None else "predicted peak memory (from shapes)"
    log(f"{kind} per stage (replica 0): " + ", ".join(rows))
    if writer is not None and peaks is not None:
        with writer.as_default(step=step):
            for s, peak in enumerate(peaks):
                tf.summary.scalar(f"memory/stage_{s}/peak_bytes", peak)


def _report_timeline(
    config: TrainConfig,
    pipe: Pipeline,
    step: int,
    view: StepView,
    log: Callable[[str], None],
    writer: tf.summary.SummaryWriter | None,
) -> None:
    """A timed step's breakdown: a log line (and the warning), TensorBoard scalars per
    pipeline device of replica 0, and its Gantt chart ``model_dir/timeline/step_<n>.png``."""
    shares = []
    for d in view.devices:
        parts = (d.compute, d.transfer, d.all_reduce, d.idle)
        shares.append(
            f"device {d.device} "
            + " ".join(
                f"{name} {value / d.step:.0%}" for name, value in zip(NAMES, parts, strict=True)
            )
        )
    log(f"timeline step {step}: " + "; ".join(shares) + f" (idle {view.idle_fraction:.0%} mean)")
    warning = view.warning()
    if warning:
        log(f"WARNING {warning}")
    if writer is not None:
        with writer.as_default(step=step):
            for d in view.devices:
                prefix = f"timeline/device_{d.device}"
                tf.summary.scalar(f"{prefix}/compute_ms", d.compute * 1e3)
                tf.summary.scalar(f"{prefix}/transfer_ms", d.transfer * 1e3)
                tf.summary.scalar(f"{prefix}/all_reduce_ms", d.all_reduce * 1e3)
                tf.summary.scalar(f"{prefix}/idle_fraction", d.idle / d.step)
                tf.summary.scalar(f"{prefix}/communication_share", d.communication_share)
            tf.summary.scalar("timeline/communication_share", view.communication_share)
            tf.summary.scalar("timeline/idle_fraction", view.idle_fraction)
    if config.outputs.model_dir:
        folder = os.path.join(config.outputs.model_dir, "timeline")
        os.makedirs(folder, exist_ok=True)
        base = os.path.join(folder, f"step_{step}")
        timeline.plot_step(view, pipe.schedule, f"step {step}, replica 0", base + ".png")
        timeline.chrome_trace(view, pipe.schedule, base + ".trace.json", pipe.mesh.pipeline(0))


def _profile(config: TrainConfig, step: int, when: str) -> None:
    """Starts the TF profiler before the first profiled step, stops it after the last."""
    if config.profile_steps is None or not config.outputs.model_dir:
        return
    first, last = config.profile_steps
    if when == "start" and step == first:
        tf.profiler.experimental.start(os.path.join(config.outputs.model_dir, "profile"))
    elif when == "stop" and step == last:
        tf.profiler.experimental.stop()
