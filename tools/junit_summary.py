"""Counts the test cases in the JUnit XML files under a directory (e.g. bazel-testlogs).

Prints one line `N passed, N failed` (plus `, N skipped` when any were skipped) and exits
non-zero when a case failed or no case ran. With ``--since EPOCH_SECONDS`` only files
written since then count (Bazel keeps the logs of targets it did not run this time).

    python tools/junit_summary.py bazel-testlogs [--since 1700000000]
"""

from __future__ import annotations

import pathlib
import sys
import xml.etree.ElementTree as ET


def count(root: pathlib.Path, since: float = 0.0) -> tuple[int, int, int, list[str]]:
    passed = failed = skipped = 0
    failures = []
    for path in sorted(root.rglob("test.xml")):
        if path.stat().st_mtime < since:
            continue
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            if case.find("failure") is not None or case.find("error") is not None:
                failed += 1
                failures.append(name)
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
    return passed, failed, skipped, failures


def main(argv: list[str]) -> int:
    args = argv[1:]
    since = 0.0
    if "--since" in args:
        i = args.index("--since")
        since = float(args[i + 1])
        del args[i : i + 2]
    root = pathlib.Path(args[0] if args else "bazel-testlogs")
    passed, failed, skipped, failures = count(root.resolve(), since)
    for name in failures:
        print(f"FAILED {name}")
    line = f"{passed} passed, {failed} failed"
    print(line + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
