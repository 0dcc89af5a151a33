"""Runs one test file with pytest: the main of every test file, under Bazel or by hand.

Under ``bazel test`` it writes the JUnit XML Bazel asks for (``XML_OUTPUT_FILE``);
sharding (``TEST_TOTAL_SHARDS``) is applied by ``conftest.py``.
"""

from __future__ import annotations

import os
import sys

import pytest


def main(path: str) -> int:
    args = [path, "-q", "-p", "no:cacheprovider"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    return int(pytest.main(args + sys.argv[1:]))
