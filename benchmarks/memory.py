"""Per-stage peak memory, measured in one process per device and predicted by the planner.

A pipeline of ``depth`` × Dense(width) + Dense(10) (default 4 × Dense(1024), batch 2048,
M = 4; for the tied case, an Embedding, the Dense stack and a head reading the embedding's
matrix), or of any model (``--model``: a zoo model such as ``gpt2`` or ``mobilenetv2``, or
``package.module:fn``), trained with Adam, runs over
TensorFlow's multi-host runtime on loopback: each mesh device is the one CPU device of its own
worker process (``benchmarks/memory_worker.py``), and a client process builds the pipeline and
runs two steps. Each worker reads its own allocator (BFC, so it keeps statistics:
``tf.config.experimental.get_memory_info("CPU:0")``) and profiles itself
(``benchmarks/allocations.py``: every allocation with the bytes requested and the chunk
given), and reports, relative to the bytes held once its server had started:

    measured peak      = allocator peak − baseline          (what the device needed at most,
                         counted in the allocator's chunks)
    requested peak     = the high-water mark of the bytes the tensors requested − baseline
                         (what the programs hold: the quantity the planner predicts)
    allocator waste    = chunk bytes beyond the requests at the allocator's peak (BFC serves a
                         request with any free chunk under twice its size, unsplit)
    measured resident  = allocator current at the end − baseline
                         (weights + optimizer slots + what the engine keeps between steps)
    measured transient = peak − resident (gradient accumulators, activations in flight,
                         received micro-batches, XLA temporaries)

Beside each, the planner's prediction for that device (``hybrid.planning.cost_model.evaluate``
on a profile measured on one device at the micro-batch size, for the cut the pipeline made)
and its error against the requested peak (``error``) and the allocator's (``error_allocated``),
and its terms (``hybrid.core.memory.memory_terms``). Each case of :data:`CASES` runs in its own
processes: every schedule × remat mode, deferred weight gradients, a 2 × 2 mesh with and
without sharded optimizer states, a tied embedding held on both stages, and the memory-balanced
cut (``balance="memory"``: its largest over its smallest stage peak, measured and predicted).

    python benchmarks/memory.py                         # every case
    python benchmarks/memory.py --cases=1f1b,tied --trace
    python benchmarks/memory.py --model=gpt2 --batch=32 --micro_batches=2 --cases=1f1b

``--trace`` keeps each worker's profile (``results/memory_profile_<case>_task<i>``, for
TensorBoard's memory profile) and prints what was live at its requested peak, by op.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
from typing import Any

from absl import app, flags

from hybrid.platforms.local_workers import free_ports

# The prediction's profile measures what each layer holds (its stored and working bytes)
# only under TensorFlow's BFC allocator on CPU, set before TensorFlow starts (common imports
# it); without it the profile falls back to each layer's output bytes, a lower bound that
# misses a layer's internals (an attention's scores, a convolution's workspace).
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import common  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    """One run of the grid (a :class:`hybrid.core.config.RunConfig`'s memory-relevant part)."""

    schedule: str = "1f1b"
    remat: str = "never"
    replicas: int = 1
    deferred: bool = False
    sharded: bool = False
    tied: bool = False
    balance: str | None = None

    def options(self) -> dict[str, Any]:
        """The Pipeline's arguments for this case."""
        extra: dict[str, Any] = {"balance": self.balance} if self.balance else {}
        if self.deferred:
            extra["defer_weight_gradients"] = True
        if self.sharded:
            extra["shard_optimizer_states"] = True
        return {"schedule": self.schedule, "remat": self.remat, **extra}


CASES = {
    "gpipe": Case("gpipe"),
    "gpipe-remat": Case("gpipe", "always"),
    "1f1b": Case(),
    "1f1b-remat": Case(remat="always"),
    "1f1b-except-last": Case(remat="except_last"),
    "zb-h1": Case("zb-h1"),
    "deferred": Case(deferred=True),
    "2x2": Case(replicas=2),
    "2x2-sharded": Case(replicas=2, sharded=True),
    "tied": Case(tied=True),
    "memory-cut": Case(balance="memory"),
}

common.define_model_flags(depth=4, batch=2048, width=1024)
flags.DEFINE_integer("micro_batches", 4, "Micro-batches M.")
flags.DEFINE_string(
    "model",
    "dense",
    f"dense (--depth x Dense(--width)), the reference transformer or resnet (--depth blocks "
    f"of --width), a zoo model {common.ZOO_MODELS}, or yours: package.module:fn, fn(batch) "
    "returning (model, x, y, loss).",
)
flags.DEFINE_integer("image_size", 32, "Zoo CNNs: input height and width.")
flags.DEFINE_integer("seq_len", 32, "Zoo KerasHub models, transformer: tokens per example.")
flags.DEFINE_integer("vocabulary", 4096, "Tied case: the embedding's rows (and the classes).")
flags.DEFINE_list("cases", list(CASES), f"Of {list(CASES)}.")
flags.DEFINE_bool("jit_compile", True, "XLA stage programs.")
flags.DEFINE_bool("trace", False, "Keep each worker's profile; print what its peak holds.")
flags.DEFINE_string("client", None, "Internal: 'CASE,CLUSTER_JSON': run the client.")
FLAGS = flags.FLAGS

STAGES = 2
STEPS = 2
MB = 1024 * 1024
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_worker.py")
CHILD_ENV = {"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPP_MIN_LOG_LEVEL": "2"}


REFERENCE_MODELS = ("transformer", "resnet")


def reference_model(name: str) -> tuple[Any, Any, Any, Any]:
    """The launcher's reference Transformer (--depth blocks of width --width, 4 heads,
    --seq_len byte tokens) or ResNet (--depth residual blocks of --width channels on 16×16
    images, 10 classes), its seeded batch and loss."""
    import keras
    import numpy as np

    from hybrid.models.resnet import resnet
    from hybrid.models.transformer import transformer
    from hybrid.run.data_sources import VOCAB_SIZE

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name == "transformer":
        layers = transformer(
            vocab_size=VOCAB_SIZE,
            seq_len=FLAGS.seq_len,
            d_model=FLAGS.width,
            num_heads=4,
            num_blocks=FLAGS.depth,
        )
        tokens = rng.integers(0, VOCAB_SIZE, size=(FLAGS.batch, FLAGS.seq_len + 1))
        x, y = tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
        return keras.Sequential([keras.Input((FLAGS.seq_len,), dtype="int32"), *layers]), x, y, loss
    layers = resnet(10, FLAGS.width, FLAGS.depth)
    x = rng.normal(size=(FLAGS.batch, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 10, size=(FLAGS.batch,)).astype("int32")
    return keras.Sequential([keras.Input((16, 16, 3)), *layers]), x, y, loss


def model_and_batch(case: Case) -> tuple[Any, Any, Any, Any]:
    """The case's model (layers, or a Keras model), its fixed batch and its loss, seeded:
    the same weights in the client and the profile. ``--model``: ``dense`` (the Dense
    stack; with ``tied``, an Embedding, the stack and a head reading its matrix), the
    launcher's reference ``transformer`` or ``resnet`` (:func:`reference_model`), a zoo
    model (``common.ZOO_MODELS`` at ``--image_size`` / ``--seq_len``), or yours
    (``package.module:fn``, ``fn(batch)`` returning ``(model, x, y, loss)``)."""
    import importlib

    import keras
    import numpy as np
    import tensorflow as tf

    from hybrid.models.transformer import TiedHead

    if FLAGS.model in REFERENCE_MODELS:
        return reference_model(FLAGS.model)
    if FLAGS.model in common.ZOO_MODELS:
        model, x, y = common.zoo_model(FLAGS.model, FLAGS.batch, FLAGS.image_size, FLAGS.seq_len)
        logits = common.zoo_logits(FLAGS.model)
        return model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=logits)
    if ":" in FLAGS.model:
        module, _, name = FLAGS.model.partition(":")
        return getattr(importlib.import_module(module), name)(FLAGS.batch)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    stack = common.dense_stack(FLAGS.width, FLAGS.depth)
    if not case.tied:
        return (stack, *common.synthetic_batch(FLAGS.batch, FLAGS.width), loss)
    embedding = keras.layers.Embedding(FLAGS.vocabulary, FLAGS.width)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, FLAGS.vocabulary, size=(2, FLAGS.batch)).astype("int32")
    layers = [embedding, *stack[:-1], TiedHead(embedding)]
    return layers, tf.constant(tokens[0]), tf.constant(tokens[1]), loss


def run_client(case: Case, spec: str) -> None:
    """In this process: connect to the workers, build (then print ``BUILT`` and wait for a
    line on stdin), train ``STEPS`` steps (then print ``STEPPED`` and wait again)."""
    import keras
    import tensorflow as tf

    import hybrid
    from hybrid.platforms import cluster

    job = cluster.connect(spec, timeout_s=60.0)
    mesh = cluster.mesh(job, stages=STAGES, replicas=case.replicas)
    # Connecting makes the first worker the default device: keep the batch in this process
    # (the engine builds the Keras model here too), so a worker holds only what its stage's
    # programs put there.
    with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
        model, x, y, loss = model_and_batch(case)
        pipe = hybrid.Pipeline(
            model, mesh=mesh, micro_batches=FLAGS.micro_batches, **case.options()
        )
        pipe.compile(
            optimizer=keras.optimizers.Adam(1e-4), loss=loss, jit_compile=FLAGS.jit_compile
        )
        flat = keras.tree.flatten(x)
        shapes = [(FLAGS.batch, *a.shape[1:]) for a in flat]
        dtypes = [tf.as_dtype(a.dtype).name for a in flat]
        if len(flat) == 1:
            pipe.build(shapes[0], dtypes[0])
        else:
            pipe.build(shapes, dtypes)
    gc.collect()  # remote tensors the build no longer references are freed on their worker
    print("DEVICES " + json.dumps([list(row) for row in mesh.devices]), flush=True)
    print("BALANCE " + json.dumps(list(pipe.balance)), flush=True)
    print("BUILT", flush=True)
    sys.stdin.readline()
    with tf.device("/job:localhost/replica:0/task:0/device:CPU:0"):
        for _ in range(STEPS):
            pipe.train_step(x, y)
    print("STEPPED", flush=True)
    sys.stdin.readline()


def _line(process: subprocess.Popen, prefix: str) -> str:
    """The rest of the next line of ``process``'s stdout that starts with ``prefix``."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise RuntimeError(f"{process.args[1]} ended (exit {process.wait()}) before {prefix!r}")


def _snapshot(workers: list[subprocess.Popen], command: str = "") -> list[dict[str, Any]]:
    """Every worker's allocator figures, now (``stop``: with its profile's)."""
    for w in workers:
        assert w.stdin is not None
        w.stdin.write(command + "\n")
        w.stdin.flush()
    return [json.loads(_line(w, "MEMORY ")) for w in workers]


def _go(client: subprocess.Popen) -> None:
    assert client.stdin is not None
    client.stdin.write("\n")
    client.stdin.flush()


def _profile_path(name: str, task: int) -> str:
    return os.path.join(common.RESULTS, f"memory_profile_{name}_task{task}")


def measure(name: str, case: Case) -> tuple[list[list[dict[str, float]]], tuple[int, ...]]:
    """Per stage, per replica: MiB of its device's allocator beyond the bytes held when its
    server started: ``built`` (after building), ``resident`` (after ``STEPS`` steps),
    ``peak`` (the high-water mark), ``transient`` (peak − resident), ``requested`` (the
    high-water mark of the bytes requested), ``waste`` (chunk bytes beyond the requests at
    the peak), ``by_op`` (requested MiB per op at the requested peak); and the cut."""
    tasks = STAGES * case.replicas
    spec = json.dumps({"worker": [f"127.0.0.1:{p}" for p in free_ports(tasks)]})
    env = {**os.environ, **CHILD_ENV}
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True, "env": env}
    os.makedirs(common.RESULTS, exist_ok=True)
    workers = [
        subprocess.Popen(
            [sys.executable, WORKER, f"--cluster={spec}", f"--task_index={i}"]
            + ([f"--profile_dir={_profile_path(name, i)}"] if FLAGS.trace else []),
            **pipes,
        )
        for i in range(tasks)
    ]
    client = None
    try:
        for w in workers:
            _line(w, "READY")
        client = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), f"--client={name},{spec}"]
            + common.flag_args(
                *common.MODEL_FLAGS,
                "micro_batches",
                "vocabulary",
                "jit_compile",
                "model",
                "image_size",
                "seq_len",
            ),  # fmt: skip
            **{**pipes, "env": {**os.environ, **CHILD_ENV}},
        )
        devices = json.loads(_line(client, "DEVICES "))
        balance = tuple(json.loads(_line(client, "BALANCE ")))
        _line(client, "BUILT")
        built = _snapshot(workers)
        _go(client)
        _line(client, "STEPPED")
        after = _snapshot(workers, "stop")
        _go(client)
        if client.wait(60):
            raise RuntimeError(f"the client failed (exit {client.returncode})")
    finally:
        for p in workers + ([client] if client else []):
            if p.poll() is None:
                p.kill()
                p.wait()
    task = [[int(d.split("task:")[1].split("/")[0]) for d in row] for row in devices]
    return [
        [
            {
                "task": t,
                "built": (built[t]["current"] - built[t]["baseline"]) / MB,
                "peak": (after[t]["peak"] - after[t]["baseline"]) / MB,
                "resident": (after[t]["current"] - after[t]["baseline"]) / MB,
                "transient": (after[t]["peak"] - after[t]["current"]) / MB,
                "requested": (after[t]["requested_peak"] - after[t]["baseline"]) / MB,
                "waste": after[t]["waste"] / MB,
                "by_op": [(op, n / MB) for op, n in after[t]["by_op"]],
            }
            for t in row
        ]
        for row in task
    ], balance


def _measure_retrying(
    name: str, case: Case
) -> tuple[list[list[dict[str, float]]], tuple[int, ...]]:
    """:func:`measure`, once more if a process died: stopping TensorFlow's profiler in a
    worker whose gRPC server is up aborted it once in about ten runs here (a profiler
    crash, not the measurement's)."""
    try:
        return measure(name, case)
    except RuntimeError as error:
        print(f"  {name}: {error}; measuring again", flush=True)
        return measure(name, case)


def predict(case: Case, balance: tuple[int, ...]) -> list[dict[str, float]]:
    """The cost model's per-device terms, in MiB, for the case and the pipeline's cut."""

    from hybrid.core.config import RunConfig
    from hybrid.planning import cost_model, costs

    b = FLAGS.batch // (FLAGS.micro_batches * case.replicas)
    model, x, y, loss = model_and_batch(case)
    profile = costs.profile_model(
        model, None, "float32", [b], x=x, loss=loss, target_shape=tuple(y.shape[1:]), repeats=1
    )
    config = RunConfig(
        STAGES,
        case.replicas,
        FLAGS.micro_batches,
        case.schedule,
        case.remat,
        balance=balance,
        defer_weight_gradients=case.deferred,
        shard_optimizer_states=case.sharded,
    )
    p = cost_model.evaluate(profile, config, FLAGS.batch, optimizer_slots=2)
    return [{k: v / MB for k, v in terms.items()} for terms in p.memory_terms]


def write_results(
    env: dict[str, Any], rows: list[dict[str, Any]], worst: float, worst_allocated: float
) -> None:
    config = common.flag_values(
        *common.MODEL_FLAGS, "micro_batches", "vocabulary", "cases", "jit_compile"
    )
    path = common.write_json(
        "memory",
        {
            "environment": env,
            "config": config,
            "rows": rows,
            "worst_error": worst,
            "worst_error_allocated": worst_allocated,
        },
    )
    csv_path = common.write_csv("memory", rows)
    _chart(rows)
    print(f"  wrote {path}, {csv_path} and memory.png")


def _chart(rows: list[dict[str, Any]]) -> None:
    """One bar group per (case, stage): the allocator's and the requested peak, and the
    prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["replica"] == 0]
    labels = [f"{r['case']}\nstage {r['stage']}" for r in shown]
    xs = range(len(shown))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(shown)), 4.5))
    bars = [
        ("measured_peak_mib", "allocator peak"),
        ("measured_requested_mib", "requested peak"),
        ("predicted_peak_mib", "predicted"),
    ]
    for i, (key, label) in enumerate(bars):
        ax.bar([x + 0.27 * (i - 1) for x in xs], [r[key] for r in shown], 0.27, label=label)
    ax.set_xticks(list(xs), labels, fontsize=6, rotation=90)
    ax.set_ylabel("peak MiB per device")
    ax.set_title(f"{STAGES} stages, M={FLAGS.micro_batches}, batch {FLAGS.batch}, Adam")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(common.RESULTS, "memory.png"))


def _print_trace(row: dict[str, Any]) -> None:
    top = ", ".join(f"{op or '(XLA/transfer)'} {mib:.2f}" for op, mib in row["by_op"])
    print(f"      at the requested peak, MiB by op: {top}")


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.client:
        name, spec = FLAGS.client.split(",", 1)
        run_client(CASES[name], spec)
        return
    env = common.start("memory", devices=1)
    rows = []
    for name in FLAGS.cases:
        case = CASES[name]
        measured, balance = _measure_retrying(name, case)
        predicted = predict(case, balance)
        for stage, (replicas, p) in enumerate(zip(measured, predicted, strict=True)):
            for replica, m in enumerate(replicas):
                row = {
                    "case": name,
                    **dataclasses.asdict(case),
                    "balance": list(balance),
                    "stage": stage,
                    "replica": replica,
                    "measured_peak_mib": m["peak"],
                    "measured_requested_mib": m["requested"],
                    "allocator_waste_mib": m["waste"],
                    "predicted_peak_mib": p["total"],
                    "error": p["total"] / m["requested"] - 1,
                    "error_allocated": p["total"] / m["peak"] - 1,
                    "measured_built_mib": m["built"],
                    "measured_resident_mib": m["resident"],
                    "measured_transient_mib": m["transient"],
                    **{f"predicted_{k}_mib": v for k, v in p.items() if k != "total"},
                }
                rows.append(row)
                print(
                    f"  {name:16s} {str(balance):7s} stage {stage} replica {replica}: "
                    f"requested {m['requested']:6.2f} MiB, allocator {m['peak']:6.2f} "
                    f"(waste {m['waste']:5.2f}; built {m['built']:5.2f}, resident "
                    f"{m['resident']:5.2f})  predicted {p['total']:6.2f} "
                    f"{ {k: round(v, 2) for k, v in p.items() if k != 'total' and v} } "
                    f"error {row['error']:+.1%} (allocator {row['error_allocated']:+.1%})",
                    flush=True,
                )
                if FLAGS.trace:
                    _print_trace(m)
        peaks = [r for r in rows if r["case"] == name and r["replica"] == 0]
        m_peaks = [r["measured_requested_mib"] for r in peaks]
        p_peaks = [r["predicted_peak_mib"] for r in peaks]
        print(
            f"  {name}: largest/smallest stage peak measured {max(m_peaks) / min(m_peaks):.2f}, "
            f"predicted {max(p_peaks) / min(p_peaks):.2f}",
            flush=True,
        )
    worst = max(abs(row["error"]) for row in rows)
    worst_allocated = max(abs(row["error_allocated"]) for row in rows)
    write_results(env, rows, worst, worst_allocated)
    print(
        f"SUMMARY memory cases={len(FLAGS.cases)} rows={len(rows)} worst_error={worst:.3f} "
        f"worst_error_allocated={worst_allocated:.3f}"
    )


if __name__ == "__main__":
    app.run(main)
