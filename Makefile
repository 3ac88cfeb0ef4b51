# Two entry points for a newcomer: `make bench` (the main job) and `make test`; `make lint`
# runs the checks CI runs before the tests (ruff, ruff format, mypy on every shipped package, the import
# contracts of pyproject.toml). All bootstrap a virtual environment from nothing.
# TORCH picks the torch release (2.11.0, 2.12.1, 2.13.0, 2.14.1 or 2.15.0): 2.13.0 is the default,
# in .venv, the CPU wheel this machine keeps on disk; another goes into .venv-torch-TORCH, the
# registry's CUDA build (it runs on the CPU): about 3 GB of wheels with its CUDA libraries,
# downloaded once into WHEEL_CACHE (`make download-torch TORCH=...`) and installed from there
# every later time. `make test-other-torch TORCH=2.11.0` runs what CI runs on the other releases:
# the fast subset and the version-sensitive tests, with COMPAT=1 the FSDP2 compatibility suite too.
# The same checks at every commit: `.venv/bin/pre-commit install` (.pre-commit-config.yaml).
PYTHON ?= python3
TORCH ?= 2.13.0
VENV := $(if $(filter 2.13.0,$(TORCH)),.venv,.venv-torch-$(TORCH))
PY := $(VENV)/bin/python
TORCH_PIN := torch==$(TORCH)
WHEEL_CACHE ?= $(HOME)/.cache/vescale-plugins/wheels
# torchtitan 0.3.0 needs torch 2.15 (tests/runtime/test_torchtitan_030.py, test_torchtitan_trainer.py):
# installed without its dependencies, then what its model path (tyro) and its trainer (tensorboard,
# torchdata, datasets) import. Not wandb, einops, torch_checkpointing: the llama3 trainer never
# imports them. datasets at 5.x, past torchtitan's pin (<4.8): 4.x needs huggingface_hub<2, which the
# test extra's transformers cannot install beside; its text data set loads the same.
INSTALL_TORCHTITAN = $(if $(filter 2.15.%,$(TORCH)),$(PY) -m pip install --quiet --no-deps torchtitan==0.3.0 spmd_types==0.2.3 && \
	$(PY) -m pip install --quiet tyro tensorboard torchdata "datasets~=5.0")
# LitGPT 0.5.13 (tests/lightning/test_litgpt_recipes.py), on the default release: it pins
# huggingface_hub<1.4, which the test extra's transformers cannot install beside, so without its
# dependencies (what its model, LoRA and recipe modules import is in the test extra already),
# then the jsonargparse its recipes' save_hyperparameters parses the command line with (the
# newest its pin, >=4.37,<=4.41, allows; written without a comma, which $(if ...) would split at).
INSTALL_LITGPT = $(if $(filter 2.13.0,$(TORCH)),$(PY) -m pip install --quiet --no-deps litgpt==0.5.13 && \
	$(PY) -m pip install --quiet "jsonargparse[signatures]==4.41.0")
# The local 2.13.0 wheel as pip finds it; another release through the wheel cache.
INSTALL_TORCH = $(if $(filter 2.13.0,$(TORCH)),$(PY) -m pip install --quiet "$(TORCH_PIN)",\
	$(PY) -m pip download --quiet --dest "$(WHEEL_CACHE)" "$(TORCH_PIN)" && \
	$(PY) -m pip install --quiet --no-index --find-links "$(WHEEL_CACHE)" "$(TORCH_PIN)")
STAMP := $(VENV)/.installed
LINT_STAMP := $(VENV)/.lint-installed

.PHONY: test test-other-torch download-torch bench bench-host bench-peers setup lint

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(INSTALL_TORCH)
	$(PY) -m pip install --quiet -e ".[test]" "$(TORCH_PIN)"
	$(INSTALL_TORCHTITAN)
	$(INSTALL_LITGPT)
	touch $(STAMP)

# On top of the test environment: mypy follows the imports of the adapters, the bench and the
# tools into Lightning, Accelerate, transformers and matplotlib, so it needs them installed.
$(LINT_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[lint]"
	touch $(LINT_STAMP)

setup: $(STAMP)

# The whole suite with its 15 slowest tests in the log, then FSDP2's side of the compatibility
# suite: torch's fully_shard with our package imported and one unit of ours built in every worker
# (tests/conftest.py), which proves that what we change in torch leaves FSDP2 as it was.
test: $(STAMP)
	@$(PY) -c "import torch; print('make test: torch', torch.__version__, 'in $(VENV)')"
	$(PY) -m pytest -q --durations=15
	$(PY) -m pytest -q --durations=5 tests/fsdp2_compat --fsdp-impl=torch

# The fast subset, then the tests of what differs between torch releases: FSDP2's surface and
# API, gradient dtypes, the DTensor integration (ragged DTensor APIs, the sharding cache torch
# asks for before 2.13), pipelining (whose private reach into FSDP2 follows each release's
# stage.py), torchtitan 0.3.0 where it installs, the Triton kernels under each release's Triton
# interpreter (2.11 ships Triton 3.6, 2.13 ships 3.9); with COMPAT=1 (CI: one release each side
# of 2.13) the FSDP2 compatibility suite too.
VERSION_TESTS := tests/runtime/test_fsdp2_215_surface.py tests/runtime/test_fsdp2_surface.py tests/runtime/test_fsdp2_api.py \
	tests/runtime/test_gradient_dtypes.py tests/ragged/test_dtensor_apis.py tests/runtime/test_host_work.py tests/runtime/test_clipping_parity.py \
	tests/runtime/test_pipelining.py tests/runtime/test_torchtitan_030.py tests/runtime/test_torchtitan_trainer.py \
	tests/dbuffer/test_quant_triton.py
COMPAT ?=
test-other-torch: $(STAMP)
	@$(PY) -c "import torch; print('make test-other-torch: torch', torch.__version__, 'in $(VENV)')"
	$(PY) -m pytest -q -m "not distributed"
	$(PY) -m pytest -q --durations=10 $(VERSION_TESTS) $(if $(COMPAT),tests/fsdp2_compat)

# Only the wheels of torch TORCH and what it needs, into WHEEL_CACHE (CI fetches them while the
# default release's suite runs).
download-torch:
	$(if $(filter 2.13.0,$(TORCH)),@true,$(PYTHON) -m pip download --quiet --dest "$(WHEEL_CACHE)" "$(TORCH_PIN)")

# mypy and the contracts read their configuration (and paths) from pyproject.toml.
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The side-by-side benchmark against torch's FSDP2 (CPU: 2 gloo ranks; CUDA: every GPU).
bench: $(STAMP)
	$(PY) -m vescale_plugins.bench $(BENCH_ARGS)

# Host work per step and phase (forward, backward, clipping, optimizer step, zero_grad): ours,
# FSDP2's and the unsharded model's, W=1 and 2 on gloo, W=8 and 1,024 on the fake process group.
bench-host: $(STAMP)
	$(PY) -m vescale_plugins.bench host $(BENCH_ARGS)

# The same with every peer a user would pick beside FSDP2: Megatron-FSDP 1 and 2 (the test extra
# has megatron-fsdp) and DeepSpeed ZeRO-3 (installs the `deepspeed` extra first).
PEERS := megatron-fsdp,megatron-fsdp-v2,deepspeed
bench-peers: $(STAMP)
	$(PY) -m pip install --quiet -e ".[deepspeed]"
	$(PY) -m vescale_plugins.bench --engines fsdp2,vescale,$(PEERS) --json bench_peers.json --plot bench_peers.png $(BENCH_ARGS)
