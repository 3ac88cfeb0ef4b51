# Two entry points for a newcomer: `make bench` (the main job) and `make test`.
# Both bootstrap .venv from nothing; torch is pinned so pip takes the local CPU wheel
# instead of several GB of CUDA packages.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test bench setup

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_PIN)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

# The side-by-side benchmark against torch's FSDP2 (CPU: 2 gloo ranks; CUDA: every GPU).
bench: $(STAMP)
	$(PY) -m vescale_plugins.bench $(BENCH_ARGS)
