# Set-up and entry points. `make demo` and `make test` work on a fresh machine: each creates
# the virtualenv in .venv/ and installs everything in one resolver pass first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# TF chooses TensorFlow's build: cpu (the default: the `tensorflow` dependency of
# pyproject.toml), cuda (its `cuda` extra: the NVIDIA libraries for GPU nodes) or tpu-vm
# (tensorflow-tpu with libtpu, on a Cloud TPU VM: hybrid itself --no-deps, the rest from
# tools/requirements.py, so pip never installs the standard build beside it):
#   make demo TF=cuda
#   make install TF=tpu-vm TF_PACKAGE='tensorflow-tpu==2.20.*'
# TF_PACKAGE: extra pip requirements in the same resolver pass (e.g. a TensorFlow version).
TF ?= cpu
OTHER_EXTRAS ?= test,plot,tpu,docs
EXTRAS ?= $(TF),$(OTHER_EXTRAS)
TF_PACKAGE ?=
TPU_BUILD := 'tensorflow-tpu>=2.20,<2.22'
# KerasHub for the model-zoo tests and benchmark, without its tensorflow-text dependency (which
# requires the full `tensorflow` package beside tensorflow-cpu); what it imports is in `test`.
KERAS_HUB ?= keras-hub==0.32.*
# Three workers on this project's 2-core reference machine: the suite is CPU-bound (99 % busy
# at 3), and a third worker fills the time the others wait on a test's subprocesses
# (measured 2026-12-07: 782 s at 3 against 858-881 s at 2).
PYTEST_WORKERS ?= 3
export TF_CPP_MIN_LOG_LEVEL ?= 2
export TF_ENABLE_ONEDNN_OPTS ?= 0

.PHONY: install docs demo test lint typecheck unit bench bazel bazel-test bazel-ci tpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
ifeq ($(TF),tpu-vm)
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -m pip install --quiet $(or $(TF_PACKAGE),$(TPU_BUILD)) \
		$$($(PY) tools/requirements.py $(OTHER_EXTRAS))
else
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]" $(TF_PACKAGE)
endif
	$(PY) -m pip install --quiet --no-deps $(KERAS_HUB)
	touch $@

install: $(VENV)/.installed

# A byte-level Transformer LM on the Python manual (ships with CPython), 2×2 simulated mesh.
# One directory, reused: an interrupted demo resumes, a finished one says so; `make demo
# FRESH=1` starts again (the old checkpoints are moved aside, never deleted).
DEMO_DIR ?= /tmp/hybrid-demo
DEMO_STEPS ?= 60
FRESH ?=
demo: export HYBRID_RERUN_HINT = make demo DEMO_STEPS=<more> to go on, or make demo FRESH=1 to train again
demo: install
	$(PY) -m hybrid.launch.train --mesh=stage:2,replica:2 --micro_batches=4 \
		--train_steps=$(DEMO_STEPS) --progress_bar --model_dir=$(DEMO_DIR) $(if $(FRESH),--fresh_start)

# The documentation site (mkdocs.yml, docs/) into site/, strict: a broken link, page or API
# reference fails (not --quiet: it hides the warnings that strict turns into errors). A few
# seconds: the API reference is read from the source, not imported.
docs: install
	$(VENV)/bin/mkdocs build --strict

lint: install
	$(PY) -m ruff check hybrid tests benchmarks tools

typecheck: install
	$(PY) -m mypy hybrid

unit: install
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal -p no:cacheprovider tests

test: lint typecheck unit

# Bazel from the distribution's packages (Debian/Ubuntu: bazel-bootstrap) when missing.
bazel:
	command -v bazel >/dev/null 2>&1 || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap; }

# Every test file as a Bazel py_test, offline, with the virtualenv's python3 (.bazelrc has
# the flags); never served from Bazel's cache. Ends with one `N passed, N failed` line.
BAZEL_TARGETS ?= //tests/...
bazel-test: install bazel
	start=$$(date +%s); \
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bazel test --nocache_test_results $(BAZEL_TARGETS); \
	status=$$?; $(PY) tools/junit_summary.py bazel-testlogs --since $$start && exit $$status

# CI: the whole suite already ran once under pytest (`make test`); Bazel builds every target
# and runs one quick test target per floor, to keep the BUILD files and the toolchain true.
BAZEL_CI_TARGETS = //tests:test_layout //tests:test_schedule //tests:test_mesh \
	//tests:test_data //tests:test_tpu_mesh //tests:test_partial_batches
bazel-ci: install bazel
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bazel build //...
	$(MAKE) bazel-test BAZEL_TARGETS="$(BAZEL_CI_TARGETS)"

# By hand, not in CI: a second virtualenv with the TPU build of TensorFlow 2.20 (what a TPU
# VM runs; no TPU needed) traces the TPU step there (tests/test_tpu_program.py) and runs the
# TPU placement tests. TPU_LOAD_LIBRARY=0: TensorFlow does not load libtpu (there is no TPU
# here, and PyPI's newest libtpu lacks the ops TensorFlow 2.20 asks it for: import aborts).
TPU_VENV ?= .venv-tpu
tpu-check: export TPU_LOAD_LIBRARY = 0
tpu-check:
	test -x $(TPU_VENV)/bin/python || $(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TPU_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(TPU_VENV)/bin/python -m pip install --quiet "tensorflow-tpu==2.20.*" \
		$$($(TPU_VENV)/bin/python tools/requirements.py test,tpu)
	$(TPU_VENV)/bin/python -c "import tensorflow as tf; print('TensorFlow', tf.__version__)"
	$(TPU_VENV)/bin/python -m pytest -q -n $(PYTEST_WORKERS) -p no:cacheprovider \
		tests/test_tpu_program.py tests/test_tpu_mesh.py

bench: install
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/pipeline_speedup.py
	$(PY) benchmarks/serving.py
	$(PY) benchmarks/input_feed.py
	$(PY) benchmarks/engine_overhead.py
	$(PY) benchmarks/allreduce_overlap.py
	$(PY) benchmarks/build_time.py
	$(PY) benchmarks/sparse_embedding.py
	$(PY) benchmarks/zoo.py
	$(PY) benchmarks/tpu_smoke.py

clean:
	rm -rf $(VENV) $(TPU_VENV) site benchmarks/results .mypy_cache .ruff_cache
	-bazel clean --expunge 2>/dev/null
