# Two entry points for a newcomer: `make bench` (the main job) and `make test`; `make lint`
# runs the checks CI runs before the tests (ruff, ruff format, mypy on the core, the import
# contracts of pyproject.toml). All bootstrap .venv from nothing; torch is pinned so pip
# takes the local CPU wheel instead of several GB of CUDA packages.
# The same checks at every commit: `.venv/bin/pre-commit install` (.pre-commit-config.yaml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
LINT_STAMP := $(VENV)/.lint-installed

.PHONY: test bench bench-deepspeed setup lint

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

$(LINT_STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[lint]"
	touch $(LINT_STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# mypy and the contracts read their configuration (and paths) from pyproject.toml.
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The side-by-side benchmark against torch's FSDP2 (CPU: 2 gloo ranks; CUDA: every GPU).
bench: $(STAMP)
	$(PY) -m vescale_plugins.bench $(BENCH_ARGS)

# The same with DeepSpeed ZeRO-3 as a third engine (installs the `deepspeed` extra first).
bench-deepspeed: $(STAMP)
	$(PY) -m pip install --quiet -e ".[deepspeed]"
	$(PY) -m vescale_plugins.bench --engines fsdp2,vescale,deepspeed --json bench_deepspeed.json --plot bench_deepspeed.png $(BENCH_ARGS)
