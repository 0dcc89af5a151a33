#!/bin/sh
# The interpreter of the hybrid Python toolchain: python3 from PATH (the project's
# virtualenv when run through `make bazel-test`).
exec python3 "$@"
