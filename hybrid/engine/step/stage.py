"""One pipeline stage on one device: its share of the model's variables, programs, optimizer.

A :class:`StageReplica` holds, on its device, a copy of every variable that model stage
``k``'s layer calls read (a segment of the user's model, ``hybrid.engine.model.graph``), and the
XLA programs that run the segment there:

    forward(xs, seed)                 -> ys           (the last stage: [[numerator, denominator]
                                                       of each output's loss])
    backward(saved, dys, dx?, dW?)    -> dxs, [dW]    (B, W, or both: the schedule decides;
                                                       ``deferral``: W once for all)
    forward_backward(xs, dys, seed)   -> ys, dxs, [dW] (one program, nothing stored in between)
    apply_gradients([dW])             -> updates the copy with its own optimizer

``xs`` and ``ys`` are the tensors crossing the stage's cuts, in the segment's key order;
``dxs`` has None for an input that is not a float (token ids) and so has no gradient.

Everything of a copy a program reads (weights, BN moving statistics, the activity penalty's
seed) is an argument, so the copies of one stage on the R replicas share one trace of their
forward and backward programs (``share_programs``); each device still compiles it. So do
their updates, the optimizer's and the BN moving statistics' (``share_update``): the
variables an update reads and writes are its arguments (``update.py``).

The programs call the user's own layer objects (``Layer.__call__``, Keras's call semantics)
inside a ``keras.StatelessScope`` that binds each of their variables to this device's value,
as ``Layer.stateless_call`` does: no layer is rebuilt from its config, and a variable two
stages read (a tied embedding) has a copy on each. Weight values come in as tensors, so a
taped forward program hands only activations to its backward program.

``forward`` returns a :class:`Saved` record: without remat the residuals of a forward
program cut from its backward (``split_programs``; the backward cut again when it comes
in two calls, B then W; a tape around the forward when the programs are inline), with
remat only the stage inputs (the backward recomputes the forward). Random layers
(Dropout) get their seed-generator state from ``seed``, a (step, micro-batch) pair, so a
recomputation draws the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hybrid.engine import keras_private, programs
from hybrid.engine.model import batch_norm, sparse
from hybrid.engine.model.graph import Segment, TensorSpec
from hybrid.engine.model.layer_checks import adds_loss, seed_generators
from hybrid.engine.model.objective import Objective
from hybrid.engine.model.variables import TracedReads, device_copy
from hybrid.engine.model.zeros import fresh_zeros
from hybrid.engine.programs import (
    Grads,
    Kept,
    Labels,
    Saved,
    differentiable,
    gradients,
    weight_penalty,
)
from hybrid.engine.step.synced_norm import Member, bound, with_backward
from hybrid.engine.step.update import Update
from hybrid.engine.traced import Traced

__all__ = ["Labels", "Saved", "StageReplica", "TensorSpec"]

Tensors = list[tf.Tensor]


class StageReplica:
    """Model stage ``index``'s variables copied onto ``device``, with programs and optimizer.

    Args:
      index: the model stage number k.
      segment: the stage's layer calls (or a list of layers applied in order), built; the
        layers are the user's, run with this copy's variable values.
      device: the device that owns the copy, its optimizer state and its programs.
      input_specs: shape and dtype (without batch) of each stage input (or one spec).
      make_optimizer: ``make_optimizer(template variables, this copy's variables)`` returns
        this copy's optimizer (the engine's copy of the one logical optimizer); called once,
        on ``device``.
      loss: the model's objective, only on the last stage: its forward returns the
        micro-batch's ``[[numerator_i, denominator_i]]``, one row per model output
        (``hybrid.engine.model.objective``).
      jit_compile: compile forward, backward and update into XLA programs on ``device``.
      variables: the template variables the segment reads, in the model's order (default:
        its layers' weights in call order).
      masked: keys of the tensors that carry a Keras mask: the masks of the stage's inputs
        come after them (in key order), and the outputs' masks after the outputs.
      synced: this copy's ``synced_norm.Member`` (BN moments all-reduced), or None.
      inline: the programs are not functions of their own: their ops go into the caller's
        program (a TPU step, which XLA compiles whole), under the caller's device scope.
      sparse: ids of the template variables whose gradient Keras hands its optimizer as
        ``IndexedSlices`` (``sparse.gradient_kinds``): their gradients stay slices.
      unused: ids of the template variables Keras's step gets no gradient for: the update
        is given None for them, as Keras's is (its optimizer leaves them alone).
    """

    def __init__(
        self,
        index: int,
        segment: Segment | Sequence[keras.layers.Layer],
        device: str,
        input_specs: TensorSpec | Sequence[TensorSpec],
        make_optimizer: Callable[[Sequence[Any], Sequence[Any]], keras.optimizers.Optimizer] | None,
        loss: Objective | None,
        jit_compile: bool = True,
        variables: Sequence[Any] | None = None,
        masked: frozenset[int] = frozenset(),
        synced: Member | None = None,
        inline: bool = False,
        sparse: frozenset[int] = frozenset(),
        unused: frozenset[int] = frozenset(),
        updates: frozenset[int] | None = None,
    ) -> None:
        self.index = index
        self.inline = inline
        self.device, self.synced = device, synced
        self.loss = loss
        self.segment = segment if isinstance(segment, Segment) else Segment.chain(segment)
        if variables is None:
            found = {id(v): v for layer in self.segment.layers for v in layer.weights}
            variables = list(found.values())
        self.templates = list(variables)
        self._trainable = [v for v in self.templates if v.trainable]
        self._state = [v for v in self.templates if not v.trainable]
        # For each trainable variable: whether its gradients are IndexedSlices.
        self.sparse = [id(v) in sparse for v in self._trainable]
        # Variables Keras's step gives no gradient: their update gets None, unless every
        # variable of the stage is one (its optimizer must still count the step).
        self.unused = [id(v) in unused for v in self._trainable]
        if all(self.unused):
            self.unused = [False] * len(self.unused)
        # The trainable variables this copy's optimizer updates (all, unless optimizer
        # states are sharded over the replicas: ``sharding.py``).
        self.updates = [updates is None or id(v) in updates for v in self._trainable]
        specs = [input_specs] if isinstance(input_specs, TensorSpec) else list(input_specs)
        self.input_specs = specs
        with tf.device(device):
            self.variables = [device_copy(v) for v in self.templates]
            copies = dict(zip(map(id, self.templates), self.variables, strict=True))
            self.trainable_variables = [copies[id(v)] for v in self._trainable]
            self._reads = TracedReads(self.trainable_variables)
            self._state_copies = [copies[id(v)] for v in self._state]
            mine = [t for t, u in zip(self._trainable, self.updates, strict=True) if u]
            self.optimizer = (
                make_optimizer(mine, self.updated_variables) if make_optimizer else None
            )
            if self.optimizer is not None:
                self.optimizer.build(self.updated_variables)
        # Whether this stage counts each trainable variable's regularization and norm (the
        # pipeline clears it for a variable an earlier stage also reads).
        self.owned = [True] * len(self._trainable)
        # Seed-generator state variable -> its initial seed: each program sets the state
        # from (this base, step, micro-batch), so a recomputation draws the same numbers.
        self._seeds = [(g.state, int(g.state.numpy()[0])) for g in seed_generators(self.layers)]
        # BatchNormalization calls: each training forward also returns their statistics.
        self.norms = batch_norm.norms_of(self.segment)
        self._in_masks = [i for i, k in enumerate(self.segment.inputs) if k in masked]
        self._out_masks = [k for k in self.segment.outputs if k in masked and loss is None]
        self._outputs = len(self.segment.outputs) + len(self._out_masks)
        # The last stage's programs with labels return the model's outputs after the loss
        # terms (for metrics; no gradient flows into them).
        self.predicts = False
        # Layers that add to the loss in their call (activity regularizers, add_loss): each
        # micro-batch's losses are added to the step's loss weighted 1 / (R·M).
        self.regularized = [
            layer
            for layer in self.segment.layers
            if layer.activity_regularizer is not None or adds_loss(layer)
        ]
        self.activity_scale = 1.0
        self.accumulates = True  # a step has several micro-batches whose gradients are summed
        # Whether its weight gradients are deferred; how the last deferral ran (a
        # deferral.Plan), or why it did not.
        self.defers: bool = False
        self.deferral: Any = None

        def program(fn: Callable[..., Any], jit: bool = jit_compile) -> Any:
            return fn if inline else Traced(fn, jit)

        # The traced programs take everything of this copy as arguments (weights, state,
        # activity seed): the copies of one stage can share them (share_programs).
        self._forward = program(self._run)
        self._forward_backward = program(self._forward_and_backward)
        # A sparse update (Keras's optimizers scatter the slices into dense moments) ran
        # 2.2x slower as an XLA:CPU program than as TensorFlow's kernels (32 vs 14.6 ms,
        # Adam, 32000 x 128 rows, benchmarks/sparse_embedding.py): on a CPU it is not compiled.
        on_cpu = tf.DeviceSpec.from_string(device).device_type == "CPU"
        self.xla_on_cpu = jit_compile and on_cpu and not inline  # gradients' form on XLA:CPU
        scatters = on_cpu and any(self.sparse)
        jit_update = jit_compile and not scatters
        # This copy's updates (its optimizer's, its BN moving statistics') as programs that
        # take the variables they write: the copies of a stage share one trace of each
        # (share_update, update.py).
        self._update: Update | None = None
        if self.optimizer is not None:
            optimizer, mine = self.optimizer, self.updated_variables
            self._update = Update(
                type(optimizer),
                lambda grads: optimizer.apply(grads, mine),
                lambda: [*mine, *optimizer.variables],
                lambda fn: program(fn, jit_update),
            )
        self._norms_update = Update(
            "norms",
            lambda summed, count: batch_norm.update_copy(self, summed, count),
            lambda: self._state_copies,
            lambda fn: program(fn, False),
        )
        # Another copy's programs this one runs instead of its own (share_update).
        self._shared_updates: tuple[Update | None, Update | None] = (None, None)
        self.jit_compile, self._cut = jit_compile, dict[str, programs.SplitPrograms]()

    def share_programs(self, first: StageReplica) -> None:
        """Runs ``first``'s traced programs (forward, forward + backward, the programs cut
        from them) instead of tracing its own: they read nothing of a copy but their
        arguments, so one trace serves every copy of model stage :attr:`index` (each device
        still compiles it). Not for copies whose programs all-reduce (synchronized BN: their
        collectives are keyed per replica) or run inline."""
        if first is self:
            return
        if first.index != self.index or self.synced or first.synced or self.inline:
            raise ValueError(
                f"stage {self.index} on {self.device} cannot share the programs of stage "
                f"{first.index} on {first.device} (synchronized BN or inline programs)"
            )
        self._forward, self._forward_backward = first._forward, first._forward_backward
        self._cut = first._cut

    def share_update(self, first: StageReplica) -> None:
        """Runs ``first``'s traced updates on this copy's variables (``update.py``): its
        optimizer's when both update the same variables of model stage :attr:`index` (not
        with sharded optimizer states, where each updates its share), its BN moving
        statistics' unless synchronized."""
        if first is self or self.inline or first.index != self.index:
            return
        same = self.updates == first.updates and self.unused == first.unused
        synced = self.synced is not None or first.synced is not None
        self._shared_updates = (
            first._update if same else None,
            None if synced else first._norms_update,
        )

    def traced_programs(self) -> list[Any]:
        """The traced programs this copy runs: its forward and forward + backward functions
        (``tf.function``), then each pair cut from them (``SplitPrograms``). The copies of a
        stage that share them (:meth:`share_programs`) return the same objects."""
        return [self._forward, self._forward_backward, *self._cut.values()]

    @property
    def is_last(self) -> bool:
        return self.loss is not None

    @property
    def layers(self) -> list[keras.layers.Layer]:
        """The user's layers this stage calls."""
        return self.segment.layers

    def get_weights(self) -> list[np.ndarray]:
        """This copy's variable values, in the order of :attr:`templates`."""
        return [np.asarray(v.numpy()) for v in self.variables]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        for variable, value in zip(self.variables, weights, strict=True):
            variable.assign(value)

    def num_weights(self) -> int:
        return len(self.variables)

    def split_batch(self, replicas: int, micro_batches: int, defer: bool = False) -> None:
        """How the global batch is split: each micro-batch's activity penalty is 1/(R·M) of
        the batch's, its weight gradients are summed when M > 1 (deferred when ``defer``)."""
        self.activity_scale = 1.0 / (replicas * micro_batches)
        self.accumulates = micro_batches > 1
        self.defers = defer and micro_batches > 1

    def returns_predictions(self) -> None:
        """The last stage's programs with labels also return the model's outputs (for
        metrics)."""
        self.predicts = True

    def note_deferral(self, found: Any) -> None:
        """How the last deferral of this stage's weight gradients ran (a ``Plan``), or why
        it did not (a string)."""
        self.deferral = found

    # -- the programs --------------------------------------------------------------------

    def _read_weights(self) -> list[tf.Tensor]:
        return self._reads()

    def _run(
        self,
        xs: Tensors,
        labels: Labels | None,
        seed: tf.Tensor,
        weights: list[tf.Tensor],
        local: list[tf.Tensor],
        training: bool = True,
    ) -> Tensors:
        """The segment on ``xs`` with the given weight values; on the last stage, the
        ``[[numerator, denominator]]`` of the loss against ``labels`` (labels, weights).

        The user's layers run inside a ``keras.StatelessScope`` that maps each variable they
        read to this copy's value (weights as given, state from ``local``, :meth:`_local`;
        random seed-generator states set from ``seed``), as ``Layer.stateless_call`` does.
        """
        mapping = (
            list(zip(self._trainable, weights, strict=True))
            + list(zip(self._state, local[: len(self._state)], strict=True))
            + [
                (state, tf.cast(tf.stack([base + seed[0], seed[1]]), state.dtype))
                for state, base in self._seeds
            ]
        )
        inputs = list(xs[: len(self.segment.inputs)])
        for i, mask in zip(self._in_masks, xs[len(self.segment.inputs) :], strict=True):
            inputs[i] = tf.identity(inputs[i])  # a tensor of this program, to carry the mask
            keras_private.set_mask(inputs[i], mask)
        with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
            with bound(self.synced, training, seed) as sync:  # synchronized BN moments
                values = self.segment.trace(inputs, training)
        ys = [values[key] for key in self.segment.outputs]
        ys += [keras_private.output_mask(values[key]) for key in self._out_masks]
        activity = []
        if self.regularized:
            penalties = [tf.cast(p, tf.float32) for p in scope.losses]
            activity = [tf.add_n([tf.constant(0.0)] + penalties)]
        stats = [batch_norm.statistics(self.norms, values, sync)] if training and self.norms else []
        if labels is not None:
            assert self.loss is not None
            y_true, sample_weight, valid = labels
            ys = [self.loss.terms(y_true, ys, sample_weight, valid)] + (ys if self.predicts else [])
        return ys + activity + stats

    def _split(self, out: Tensors, labels: bool = True) -> tuple[Tensors, Tensors, Tensors]:
        """A program's outputs as (stage outputs, activity penalty, BN statistics); the
        last stage without ``labels`` outputs the model's outputs, not the loss terms."""
        n = self._outputs
        if self.is_last and labels:
            n = 1 + (n if self.predicts else 0)
        a = len(self.regularized[:1])
        return out[:n], out[n : n + a], out[n + a :]

    def _local(self) -> Tensors:
        """What a program reads of this copy besides its weights, passed as arguments (one
        trace serves every copy): its non-trainable state (BN moving statistics), then, when
        the stage has an activity penalty, ``d loss / d penalty``: the penalty's weight in
        the loss times the dynamic loss scale the data gradients carry under a
        LossScaleOptimizer."""
        local = [tf.convert_to_tensor(c) for c in self._state_copies]
        if not self.regularized:
            return local
        scale = tf.constant(self.activity_scale)
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            scale = scale * tf.convert_to_tensor(self.optimizer.dynamic_scale)
        return local + [scale]

    def _activity_seed(self, activity: Tensors, local: Tensors) -> list[tf.Tensor | None]:
        """``d loss / d penalty`` (the last of ``local``, :meth:`_local`) for each penalty."""
        return [local[-1] for _ in activity]

    def _forward_and_backward(
        self,
        xs: Tensors,
        dys: list[tf.Tensor | None],
        labels: Labels | None,
        seed: tf.Tensor,
        need_dx: bool,
        need_dw: bool,
        acc: list[tf.Tensor] | None,
        weights: Tensors,
        local: Tensors,
    ) -> tuple[Tensors, list[tf.Tensor | None] | None, list[tf.Tensor]]:
        """One program: the forward, then its gradients against ``dys`` (and the activity
        penalty's weight); nothing kept between. Returns the forward's outputs (activity
        penalty and BatchNormalization statistics last), dx and dW (plus ``acc``, the
        gradients of the micro-batches before, when given: accumulated in the program);
        ``weights`` and ``local`` are this copy's (:meth:`_local`)."""
        with tf.GradientTape() as tape:
            tape.watch([x for x in xs if differentiable(x)])
            tape.watch(weights)
            out = self._run(xs, labels, with_backward(self.synced, seed), weights, local)
        ys, activity, _ = self._split(out)
        dys = list(dys) + self._activity_seed(activity, local)
        dx, dw = gradients(
            tape, xs, ys + activity, dys, weights, need_dx, need_dw, self.sparse, self.xla_on_cpu
        )
        return out, dx, self._program_gradients(acc, dw)

    def _program_gradients(self, acc: Tensors | None, dw: list[Any]) -> Tensors:
        """Weight gradients as a program returns them: the dense ones plus ``acc`` (the
        running sums of the dense ones), then each sparse one's (values, indices)."""
        if not dw:
            return []
        dense = sparse.joined(acc, [g for g, s in zip(dw, self.sparse, strict=True) if not s])
        found = iter(dense)
        grads = [g if s else next(found) for g, s in zip(dw, self.sparse, strict=True)]
        return sparse.program_outputs(grads, self.sparse, self.trainable_variables)

    def gradients_of(self, flat: Tensors, acc: list[Any] | None, summed: bool = True) -> list[Any]:
        """One weight gradient per trainable variable from a program's outputs
        (:meth:`_program_gradients`), joined with ``acc``, the micro-batches' before: the
        sparse ones' slices after ``acc``'s, the dense ones plus ``acc``'s unless the
        program already added them (``summed``)."""
        if not flat:
            return []
        grads = sparse.structured(flat, self.sparse, self.trainable_variables)
        if not acc:
            return grads
        if summed:
            return [
                sparse.concat([a, g]) if s else g
                for a, g, s in zip(acc, grads, self.sparse, strict=True)
            ]
        return sparse.joined(acc, grads)

    def kept_programs(
        self, structure: Any, need_dx: bool, split: bool, accumulate: bool = True
    ) -> tuple[programs.SplitPrograms, Tensors]:
        """The forward and backward programs that keep activations, cut from one traced
        forward + backward (``split_programs``) of ``structure`` (inputs, labels, seed,
        weights, local: :meth:`_local`), and the forward's arguments. The backward computes
        the input gradients only when ``need_dx`` and adds the weight gradients to the
        running sums inside the program (unless not ``accumulate``); with ``split`` it also
        comes in two parts, the input gradients (B) and the weight gradients (W)."""
        args, rebuild = programs.flatten(structure)
        accumulate = accumulate and self.accumulates
        signature = f"{accumulate} {self.defers} {programs.signature(structure)}"
        key = f"{need_dx} {split} {signature}"
        if key in self._cut:
            return self._cut[key], args
        cut = self._cut.get(f"{need_dx} True {signature}")
        if cut is not None:  # a split cut has the whole backward too, and the same forward
            return cut, args
        out = self._forward.get_concrete_function(*structure).structured_outputs
        ys = self._split(out)[0]
        wanted = [(not self.is_last or i == 0) and differentiable(y) for i, y in enumerate(ys)]
        dys = [tf.TensorSpec(y.shape, y.dtype) for y, w in zip(ys, wanted, strict=True) if w]
        sums = [tf.TensorSpec(t.shape, t.dtype) for t in self._sums(None)] if accumulate else []

        def joint(f_args: Tensors, b_args: Tensors) -> tuple[Tensors, Tensors]:
            xs, labels, seed, weights, local = rebuild(f_args)
            found = iter(b_args)
            dys = [next(found) if w else None for w in wanted]
            acc = list(found)
            out, dx, dw = self._forward_and_backward(
                xs, dys, labels, seed, need_dx, True, acc, weights, local
            )
            return out, [d for d in dx or [] if d is not None] + dw

        # (deferring: the seed is data too, so what it draws, a Dropout mask, is kept per
        # micro-batch for the whole-batch W, not drawn again there)
        data = range(len(programs.flatten(structure[:2])[0]) + self.defers)
        first = sum(map(differentiable, structure[0])) if need_dx and split else None
        jit = self.jit_compile
        self._cut[key] = programs.split(joint, args, dys + sums, data, jit, first)
        return self._cut[key], args

    @property
    def updated_variables(self) -> list[Any]:
        """The trainable variables this copy's optimizer updates (and holds state for)."""
        return [v for v, u in zip(self.trainable_variables, self.updates, strict=True) if u]

    def fixed_arguments(self, args: Tensors) -> tuple[Tensors, Tensors]:
        """The weights and the other values of this copy (:meth:`_local`) among the flat
        arguments of a kept forward (:meth:`kept_programs`): its last ones."""
        n, w = len(self._state) + len(self.regularized[:1]), len(self.trainable_variables)
        end = len(args) - n
        return list(args[end - w : end]), list(args[end:])

    # -- what the engine calls, inside its step function, under tf.device(self.device) --

    def forward(
        self,
        xs: Tensors,
        labels: Labels | None,
        seed: tf.Tensor,
        remat: bool,
        split: bool,
        need_dx: bool = True,
    ) -> Saved:
        """Runs the forward program; keeps activations for the backward unless ``remat``.

        Args:
          split: the backward will come as two calls (B then W): cut into two programs.
          need_dx: the backward will be asked for the input gradients.
        """
        weights, local = self._read_weights(), self._local()
        if remat:
            ys, activity, stats = self._split(self._forward(xs, labels, seed, weights, local))
            return Saved(xs, ys, labels, seed, stats=stats, activity=activity)
        if not self.inline:
            structure = (list(xs), labels, seed, list(weights), local)
            cut, args = self.kept_programs(structure, need_dx, split)
            out, residuals = cut.forward(args)
            ys, activity, stats = self._split(out)
            kept = Kept(cut, args, residuals, need_dx, split)
            return Saved(xs, ys, labels, seed, stats=stats, activity=activity, kept=kept)
        with tf.GradientTape(persistent=split) as tape:
            tape.watch([x for x in xs if differentiable(x)])
            tape.watch(weights)
            ys, activity, stats = self._split(self._forward(xs, labels, seed, weights, local))
        return Saved(xs, ys, labels, seed, tape, weights, stats, activity)

    def infer(self, xs: Tensors, labels: Labels | None, seed: tf.Tensor) -> tuple[Tensors, Tensors]:
        """Forward in inference mode (``training=False``), nothing kept for a backward: the
        outputs and the activity penalty (weighted as in the loss; empty without)."""
        out = self._forward(xs, labels, seed, self._read_weights(), self._local(), training=False)
        ys, activity, _ = self._split(out, labels is not None)
        return ys, [p * self.activity_scale for p in activity]

    def backward(
        self,
        saved: Saved,
        dys: list[tf.Tensor | None],
        need_dx: bool,
        need_dw: bool,
        acc: list[tf.Tensor] | None = None,
    ) -> Grads:
        """Input gradients (when ``need_dx``) and weight gradients (when ``need_dw``) of
        ``dys · ∂outputs``, the latter plus ``acc`` when given (the earlier micro-batches'
        sum; added inside the program when it recomputes); recomputes the forward first if
        the forward kept no tape."""
        if not (need_dx or need_dw):
            return None, []
        kept = saved.kept
        if kept is not None:  # the backward half of a cut program (kept_programs)
            if need_dx and not kept.need_dx:
                raise ValueError(f"stage {self.index}: its forward was run with need_dx=False")
            more = [d for d in dys if d is not None] + self._sums(acc)
            wanted = [differentiable(x) for x in saved.inputs]
            dx, flat = kept.backward(more, wanted, need_dx, need_dw)
            return dx, self.gradients_of(flat, acc)
        if saved.tape is None:
            sums = self._sums(acc) if need_dw else None
            args = (saved.inputs, dys, saved.labels, saved.seed, need_dx, need_dw, sums)
            _, dx, flat = self._forward_backward(*args, self._read_weights(), self._local())
            return dx, self.gradients_of(flat, acc)
        seeds = self._activity_seed(saved.activity, self._local())
        ys, dys = saved.output + saved.activity, list(dys) + seeds
        dx, dw = gradients(
            saved.tape, saved.inputs, ys, dys, saved.weights, need_dx, need_dw, self.sparse
        )
        return dx, sparse.joined(acc, dw)

    def forward_backward(
        self,
        xs: Tensors,
        labels: Labels | None,
        seed: tf.Tensor,
        dys: list[tf.Tensor | None],
        need_dx: bool,
        acc: list[tf.Tensor] | None = None,
    ) -> tuple[Tensors, list[tf.Tensor | None] | None, list[tf.Tensor], Tensors, Tensors]:
        """F immediately followed by its whole backward, as one program (the last stage,
        whose output gradient is known, when its B follows its F): its outputs, dx, dW (plus
        ``acc`` when given, added in the program), its activity penalty and BN statistics."""
        out, dx, flat = self._forward_backward(
            xs,
            dys,
            labels,
            seed,
            need_dx,
            True,
            self._sums(acc),
            self._read_weights(),
            self._local(),
        )
        ys, activity, stats = self._split(out)
        return ys, dx, self.gradients_of(flat, acc), activity, stats

    def _sums(self, acc: list[Any] | None) -> list[tf.Tensor]:
        """The running sums of the dense gradients a backward adds to (zeros first: one
        compile; none with one micro-batch per step). Sparse gradients are not summed: each
        micro-batch's slices come out of the program (:meth:`gradients_of`)."""
        if not (self.accumulates or acc):
            return []
        dense = [v for v, s in zip(self.trainable_variables, self.sparse, strict=True) if not s]
        if acc:
            return [a for a, s in zip(acc, self.sparse, strict=True) if not s]
        return [fresh_zeros(v.shape, v.dtype) for v in dense]

    def apply_gradients(self, grads: list[tf.Tensor]) -> None:
        """Updates this copy's variables with its own optimizer (given None for the variables
        Keras's step gets no gradient for: it leaves them alone, weight decay included)."""
        assert self._update is not None
        given = [None if u else g for g, u in zip(grads, self.unused, strict=True)]
        mine = [g for g, u in zip(given, self.updates, strict=True) if u]
        (self._shared_updates[0] or self._update)(mine, on=self._update)

    def update_norms(self, summed: Any, count: int) -> None:
        """Updates this copy's BatchNormalization moving statistics (``batch_norm.update_copy``)."""
        (self._shared_updates[1] or self._norms_update)(summed, count, on=self._norms_update)

    def weight_penalty(self) -> tuple[tf.Tensor, list[tf.Tensor]] | None:
        """This stage's weight regularization and its gradients (``gradients``), or None."""
        return weight_penalty(self.trainable_variables, self.owned, self._read_weights)
