"""Every Python block of the README and of the documentation runs as written (STYLE 16: code
shown to users runs).

Each markdown file's blocks run in order in one fresh process, in one namespace, from an empty
working directory, as a reader pasting one page into one session would (a block may use what
an earlier block of the same page defined; no page relies on another). A block that needs what
a test machine lacks (running workers, a Cloud TPU) is an illustration: the line before its
fence says ``<!-- illustration: ... -->``, and it is parsed, not run.
"""

import ast
import glob
import os
import subprocess
import sys

import pytest

import runner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ILLUSTRATION = "<!-- illustration"


def markdown_files() -> list[str]:
    """The README and every page under docs/, relative to the repository root."""
    pages = glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)
    return ["README.md", *sorted(os.path.relpath(p, ROOT) for p in pages)]


def python_blocks(name: str) -> list[tuple[int, str, str | None]]:
    """(line of the fence, code, the illustration marker or None) of each ```python block."""
    lines = open(os.path.join(ROOT, name), encoding="utf-8").read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            previous = next((t.strip() for t in reversed(lines[:i]) if t.strip()), "")
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            marker = previous if previous.startswith(ILLUSTRATION) else None
            blocks.append((i + 1, "\n".join(lines[i + 1 : j]) + "\n", marker))
            i = j
        i += 1
    return blocks


# The pages that must show code, and how many blocks each has at least (a page that lost its
# examples fails here, not silently).
MIN_BLOCKS = {
    "README.md": 1,
    "docs/index.md": 1,
    "docs/guide/keras.md": 4,
    "docs/guide/schedules.md": 1,
    "docs/guide/meshes.md": 2,
    "docs/guide/serving.md": 1,
    "docs/guide/multihost.md": 1,
    "docs/guide/tpu.md": 2,
}

# Exactly these blocks are only parsed: (file, marker).
ILLUSTRATIONS = [
    ("docs/guide/multihost.md", "<!-- illustration: needs running workers -->"),
    ("docs/guide/multihost.md", "<!-- illustration: needs running workers -->"),
    ("docs/guide/tpu.md", "<!-- illustration: needs a Cloud TPU node -->"),
    (
        "docs/guide/tpu.md",
        "<!-- illustration: needs a TPU (tests/test_tpu_program.py traces it offline) -->",
    ),
]

# What a page's blocks leave in their working directory, as proof that they ran to the end.
LEFT_BEHIND = {
    "README.md": ["served/saved_model.pb"],
    "docs/guide/keras.md": ["run/checkpoint"],
    "docs/guide/schedules.md": ["1f1b.png"],
    "docs/guide/serving.md": ["whole/saved_model.pb", "staged/pipeline.json"],
}


def test_every_block_parses_and_only_the_listed_ones_are_left_unrun():
    found = {name: python_blocks(name) for name in markdown_files()}
    for name, blocks in found.items():
        for line, code, _ in blocks:
            ast.parse(code, filename=f"{name}:{line}")  # a SyntaxError names the block
    counts = {name: len(found.get(name, [])) for name in MIN_BLOCKS}
    assert all(counts[n] >= least for n, least in MIN_BLOCKS.items()), (counts, MIN_BLOCKS)
    shown_only = [(n, marker) for n, blocks in found.items() for _, _, marker in blocks if marker]
    assert shown_only == ILLUSTRATIONS


def test_the_extraction_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("x\n<!-- illustration: no -->\n```python\nf(\n```\n```python\ny = 1\n```\n")
    blocks = python_blocks(str(page))  # an absolute path joins to itself
    assert [(line, marker) for line, _, marker in blocks] == [
        (3, "<!-- illustration: no -->"),
        (6, None),
    ]
    with pytest.raises(SyntaxError):
        ast.parse(blocks[0][1])


RUN_BLOCKS = """
namespace = {"__name__": "__main__"}
for where, code in BLOCKS:
    print(where, flush=True)
    exec(compile(code, where, "exec"), namespace)
print("all blocks ran")
"""

RUNNABLE = [n for n in markdown_files() if any(m is None for _, _, m in python_blocks(n))]
LONG = {"docs/guide/keras.md", "README.md"}  # tens of seconds: run first (conftest.py)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.long] if n in LONG else []) for n in RUNNABLE]
)
def test_every_runnable_block_of_a_page_runs_in_order(name, tmp_path):
    runnable = [(f"{name}:{line}", code) for line, code, m in python_blocks(name) if m is None]
    result = subprocess.run(
        [sys.executable, "-c", f"BLOCKS = {runnable!r}\n" + RUN_BLOCKS],
        cwd=tmp_path,  # the blocks write what they write ("served", "run", ...) here
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "all blocks ran" in result.stdout
    missing = [p for p in LEFT_BEHIND.get(name, []) if not (tmp_path / p).exists()]
    assert not missing, f"{name}'s blocks did not write {missing}"


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
