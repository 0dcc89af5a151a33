"""Every Python block of the README runs as written (STYLE 16: code shown to users runs).

The blocks run in order in one fresh process, in one namespace, from an empty working
directory, as a reader pasting them into one session would (a block may use what an earlier
one defined). A block that needs what a test machine lacks (running workers, a Cloud TPU) is
an illustration: the line before its fence says ``<!-- illustration: ... -->``, and it is
parsed, not run.
"""

import ast
import os
import subprocess
import sys

import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
ILLUSTRATION = "<!-- illustration"


def python_blocks(path: str = README) -> list[tuple[int, str, bool]]:
    """(line of the fence, code, is an illustration) of each ```python block."""
    lines = open(path, encoding="utf-8").read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            previous = next((t for t in reversed(lines[:i]) if t.strip()), "")
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            code = "\n".join(lines[i + 1 : j]) + "\n"
            blocks.append((start + 1, code, previous.strip().startswith(ILLUSTRATION)))
            i = j
        i += 1
    return blocks


def test_every_block_parses_and_only_marked_ones_are_left_unrun():
    blocks = python_blocks()
    assert len(blocks) >= 9
    for line, code, _ in blocks:
        ast.parse(code, filename=f"README.md:{line}")  # a SyntaxError names the block
    illustrations = [line for line, _, shown_only in blocks if shown_only]
    assert len(illustrations) == 3, illustrations  # the cluster and the two TPU blocks


RUN_BLOCKS = """
import sys
namespace = {"__name__": "__main__"}
for line, code in BLOCKS:
    print(f"README.md:{line}", flush=True)
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
print("all blocks ran")
"""


def test_every_runnable_block_runs_in_order(tmp_path):
    runnable = [(line, code) for line, code, shown_only in python_blocks() if not shown_only]
    script = f"BLOCKS = {runnable!r}\n" + RUN_BLOCKS
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,  # the blocks write "served", "run", "1f1b.png" where they run
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "all blocks ran" in result.stdout
    assert (tmp_path / "served" / "saved_model.pb").exists() and (tmp_path / "1f1b.png").exists()


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
