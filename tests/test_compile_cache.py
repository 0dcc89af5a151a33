"""A persistent XLA cache (``hybrid.engine.compile_cache``) and the first call of each step
(training, evaluation) that fills it replica by replica: exact against plain Keras, run once
per M and kind, never without a cache.

Each case runs ``compile_cache_child.py`` in its own process: TensorFlow reads its XLA flags
at a process's first XLA compile, long past in this one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from hybrid.core import xla_cache
from hybrid.engine import compile_cache

import runner

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_cache_child.py")
ROOT = os.path.dirname(os.path.dirname(CHILD))
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "0"}
ENV.pop("TF_XLA_FLAGS", None)


def child(cache: str, *extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, CHILD, cache, *extra],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_the_first_step_runs_replica_by_replica_and_fills_the_cache(tmp_path):
    cache = str(tmp_path / "xla")
    result = child(cache)
    # step 1: the ordered trace; step 2: the usual one; the same for evaluation
    ran = [
        (r["train"], r["first_train"], r["evaluate"], r["first_evaluate"]) for r in result["ran"]
    ]
    assert ran == [(0, 1, 0, 0), (1, 1, 0, 0), (1, 1, 0, 1), (1, 1, 1, 1)]
    # the first step wrote the programs; the second compiled nothing new; the first
    # evaluation wrote its forward programs, the second nothing new
    files = result["files"]
    assert files[0] > 0 and files[1] == files[0] and files[3] == files[2] > files[1]
    assert result["max_diff"] < 1e-6  # 2 Adam steps on 2 × 2, M = 2, against Keras
    assert result["evaluation_diff"] < 1e-6


def test_without_a_cache_every_step_runs_the_replicas_at_once(tmp_path):
    result = child(str(tmp_path / "unused"), "--no-cache")
    ran = [
        (r["train"], r["first_train"], r["evaluate"], r["first_evaluate"]) for r in result["ran"]
    ]
    assert ran == [(1, 0, 0, 0), (2, 0, 0, 0), (2, 0, 1, 0), (2, 0, 2, 0)]
    assert result["files"] == [0, 0, 0, 0] and result["max_diff"] < 1e-6


def test_enable_keeps_the_other_flags_and_a_directory_already_set(monkeypatch, tmp_path):
    monkeypatch.setenv("TF_XLA_FLAGS", "--tf_xla_auto_jit=2")
    path = str(tmp_path / "a b")
    assert xla_cache.directory() is None
    assert xla_cache.enable(path) == path and os.path.isdir(path)
    assert xla_cache.directory() == path
    assert os.environ["TF_XLA_FLAGS"].startswith("--tf_xla_auto_jit=2 ")
    assert xla_cache.enable(str(tmp_path / "other")) == path  # the first one stays


@pytest.mark.parametrize(
    "replicas, jit, strategy, synced, cache, want",
    [
        (2, True, None, False, True, True),
        (1, True, None, False, True, False),  # one replica compiles each program once anyway
        (2, False, None, False, True, False),  # no XLA programs
        (2, True, "mirrored", False, True, False),  # the strategy runs its replicas
        (2, True, None, True, True, False),  # synchronized BN: replicas all-reduce in actions
        (2, True, None, False, False, False),  # nothing to load from
    ],
)
def test_ordered_only_where_it_helps(
    monkeypatch, tmp_path, replicas, jit, strategy, synced, cache, want
):
    monkeypatch.setenv("TF_XLA_FLAGS", "")  # restored after the test, whatever enable sets
    if cache:
        xla_cache.enable(str(tmp_path))
    assert compile_cache.ordered(replicas, jit, strategy, synced) is want


# What a process writes to fd 2 after quiet.hide_known_noise(): kept lines, a loader line,
# an out-of-memory report over several lines (the engine says it in one), a lost worker's
# (so does the launcher), the failed step's handles not deleted, and last words without a
# newline just before it is killed.
FILTERED_CHILD = f"""
import os, signal, sys
sys.path.insert(0, {ROOT!r})
from hybrid.core import quiet
print("before", file=sys.stderr, flush=True)
quiet.hide_known_noise()
os.write(2, b"kept 1\\n")
os.write(2, b"E0000 00:00:1796571066.872831   20570 text_format.cc:378] Error parsing "
            b"text-format tensorflow.XlaSerializedCacheEntry: 2:1: Expected identifier\\n")
print("kept 2", file=sys.stderr)
os.write(2, b"W0000 00:00:1796577755.268460   30149 local_rendezvous.cc:412] Local rendezvous "
            b"is aborting with status: RESOURCE_EXHAUSTED: OOM when allocating tensor\\n"
            b"\\t [[{{node Empty}}]]\\nHint: If you want to see a list\\n"
            b"Additional GRPC error information from remote target /job:worker\\n"
            b":UNKNOWN:Error received from peer\\n\\t [[F_s1_m2/PartitionedCall/_42]]\\n\\n")
print("kept 3", file=sys.stderr)
os.write(2, b"E0000 00:00:1796577755.3   30149 remote_copy_node.cc:235] Ignoring an error "
            b"encountered when setting remote shape of tensor received by remote Recv op: "
            b"UNAVAILABLE: Socket closed\\n:UNKNOWN:Error received from peer ipv4:127.0.0.1\\n"
            b"This should never happen. Please file an issue with the TensorFlow Team.\\n")
print("kept 4", file=sys.stderr)
os.write(2, b"W0000 00:00:1796640588.939562    9684 destroy_tensor_handle_node.h:59] Ignoring "
            b"an error encountered when deleting remote tensors handles: INVALID_ARGUMENT: "
            b"Unable to find the relevant tensor remote_handle: Op ID: 306, Output num: 0\\n"
            b"Additional GRPC error information from remote target /job:worker/replica:0\\n"
            b":UNKNOWN:Error received from peer  {{grpc_status:3}}\\n\\n")
print("kept 5", file=sys.stderr)
os.write(2, b"E0000 00:00:1796641686.042301   27027 cpu_aot_loader.cc:220] Loading XLA:CPU AOT "
            b"result. Target machine feature +prefer-no-scatter is not  supported on the host "
            b"machine. Machine type used for XLA:CPU compilation doesn't match\\n")
os.write(2, b"E0000 00:00:1796641686.042302   27027 cpu_aot_loader.cc:220] Loading XLA:CPU AOT "
            b"result. Target machine feature +avx512fp16 is not  supported on the host\\n")
os.write(2, b"last words")
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("level, loader_line", [("2", False), ("0", True)])
def test_the_cache_loader_lines_are_filtered_and_nothing_else_is_lost(level, loader_line):
    done = subprocess.run(
        [sys.executable, "-c", FILTERED_CHILD],
        env={**ENV, "TF_CPP_MIN_LOG_LEVEL": level},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -9, done.stderr
    lines = done.stderr.splitlines()
    noise = ("XlaSerializedCacheEntry", "rendezvous", "node Empty", "Hint:", "GRPC", "UNKNOWN")
    noise += ("F_s1_m2", "remote shape", "never happen", "remote tensors handles")
    noise += ("+prefer-no-scatter",)
    kept = [line for line in lines if line and not any(n in line for n in noise)]
    lacking = kept.pop(6)  # a feature the host lacks: said at every level
    assert "Target machine feature +avx512fp16 is not  supported" in lacking, kept
    assert kept == ["before", "kept 1", "kept 2", "kept 3", "kept 4", "kept 5", "last words"]
    assert any("XlaSerializedCacheEntry" in line for line in lines) == loader_line
    assert (len(lines) > len(kept) + 1) == loader_line  # every noisy line, or none, is dropped


LAUNCH = [
    "--model=mlp",
    "--data=synthetic",
    "--width=8",
    "--depth=1",
    "--mesh=stage:2;replica:2",
    "--micro_batches=2",
    "--global_batch_size=8",
    "--train_steps=2",
]


# A line of TensorFlow's C++ logging: severity, date, time, thread, file:line].
TF_LOG_LINE = re.compile(r"(?m)^[IWEF]\d{4} [\d:. ]+ +\d+ [\w.]+:\d+\] ")


def test_the_launcher_caches_by_default_and_a_second_run_loads_quietly(tmp_path):
    """No flag: the launcher's cache is ``xla/tf-<version>`` under HYBRID_CACHE_DIR; the
    first run fills it, the second loads every program (it writes none) and its stderr
    holds none of TensorFlow's loader lines."""
    env = {**ENV, "HYBRID_CACHE_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    counts = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-m", "hybrid.launch.train", *LAUNCH],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        # none of TensorFlow's C++ log lines (the cache's loader lines included)
        assert not TF_LOG_LINE.search(done.stderr), done.stderr[-3000:]
        (cache,) = os.listdir(tmp_path / "xla")
        assert cache.startswith("tf-2.")
        counts.append(len(os.listdir(tmp_path / "xla" / cache)))
    assert counts[0] > 0 and counts[1] == counts[0], counts
    assert "XlaSerializedCacheEntry" not in done.stderr, done.stderr[-3000:]
    # Step 1 ran the replicas in turn; step 2 traced the step that runs them together: said,
    # and left out of the throughput, as the first step is.
    lines = done.stdout.splitlines()
    assert "traced step 2 (" in done.stdout and "left out of examples/s" in done.stdout, lines
    (finished,) = [line for line in lines if line.startswith("done: ")]
    assert finished.endswith("examples/s not measured (every step compiled, traced or was timed)")


def test_tensorflow_loaded_by_hybrid_says_nothing_when_absl_starts():
    """``import_tensorflow`` (how the engine, the launchers and the benchmarks load
    TensorFlow) leaves no start-up line for ``absl.app.run``'s init callbacks to print (the
    CUDA probe's, on a host without a GPU driver)."""
    code = (
        f"import sys; sys.path.insert(0, {ROOT!r})\n"
        "from hybrid.core.quiet import import_tensorflow\n"
        "import_tensorflow()\n"
        "from absl import app\n"
        "app.run(lambda argv: print('ran'))\n"
    )
    env = {k: v for k, v in ENV.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr[-3000:]
    assert not TF_LOG_LINE.search(done.stderr), done.stderr[-3000:]


def test_the_launchers_cache_flag(monkeypatch, tmp_path):
    from hybrid.launch import use_xla_cache

    monkeypatch.setenv("TF_XLA_FLAGS", "")
    use_xla_cache("off")
    assert xla_cache.directory() is None
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"^--xla_cache_dir=.*/file/x: cannot create it \("):
        use_xla_cache(str(tmp_path / "file" / "x"))
    assert xla_cache.directory() is None


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
