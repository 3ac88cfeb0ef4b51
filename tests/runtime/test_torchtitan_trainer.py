"""torchtitan 0.3.0's own trainer (``torchtitan.trainer.Trainer``, what ``torchtitan.train``
runs) on the llama3 debug model, 2 gloo ranks, with its ``fully_shard`` swapped for ours,
against FSDP2 in the same test: its config (``llama3_debugmodel()``), model build,
parallelization, ``init_weights``, dataloader (its ``c4_test`` text data set read from a
local copy), tokenizer, chunked loss, optimizers, schedulers, metrics, ``train()`` loop and
DCP checkpointer, unchanged.

What the test sets: a tokenizer (a word-level ``tokenizers`` vocabulary, saved as
``tokenizer.json``) and a small text data set written to ``tmp_path``, which the wheel does
not ship; a short run (batch 2, sequence 64); ``training.disable_cuda_graphs`` (CUDA graphs
need CUDA); and ``max_norm`` 1e9 as in ``test_torchtitan_030.py`` (torchtitan's
``clip_grad_norm_`` sums the squares of each rank's local gradient, FSDP2's even rows and our
ragged cuts, so the norms agree to rounding only and a clipping by them would too). The CPU
adaptations are ``tests/support/torchtitan_cpu.py``'s, named there.

Left out: ``--compile.enable``, for the time inductor takes to compile both engines' blocks
on CPU, and ``parallelism.spmd_backend="full_dtensor"``, under which only a process's first
``Trainer`` builds, with either engine (docs/fully_shard.md).

Needs torchtitan 0.3.0 and, for its trainer, tensorboard, torchdata and datasets (the
Makefile's ``INSTALL_TORCHTITAN``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import time
import types

import pytest
import torch
import torch.distributed as dist

from tests.support.parity import TOL
from tests.support.torchtitan_cpu import (
    NEEDS_TORCH_215,
    patched,
    same_initial_values,
    torchtitan_on_cpu_with,
    trainer_on_cpu,
)
from vescale_plugins import RaggedShard

_MISSING = [m for m in ("torchtitan", "tensorboard", "torchdata", "datasets") if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.timeout(400),
    NEEDS_TORCH_215,
    pytest.mark.skipif(
        bool(_MISSING),
        reason=f"{', '.join(_MISSING)} not installed (the Makefile's INSTALL_TORCHTITAN, TORCH=2.15.0)",
    ),
]

STEPS = 3  # per configuration; the default run goes one further, with a checkpoint at step 2
WORDS = 200  # the tokenizer's vocabulary, under the debug model's 2048


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> str:
    """A tokenizer and a text data set in the layouts torchtitan reads (``hf_assets_path``
    with ``tokenizer.json`` and ``tokenizer_config.json``; ``c4_test``: json lines of ``text``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("torchtitan_assets")
    words = [f"w{i}" for i in range(WORDS)]
    vocab = {"[UNK]": 0, "<bos>": 1, "<eos>": 2} | {w: i + 3 for i, w in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (root / "tokenizer").mkdir()
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    g = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(100):  # documents of 5 to 60 words: several per 64-token row
        ids = torch.randint(0, WORDS, (int(torch.randint(5, 60, (), generator=g)),), generator=g)
        lines.append(json.dumps({"text": " ".join(words[int(i)] for i in ids)}))
    (root / "c4_test").mkdir()
    (root / "c4_test" / "train.json").write_text("\n".join(lines) + "\n")
    return str(root)


def _train(engine: str, assets: str, out: str, variant: str, steps: int, resume_from: str | None = None) -> dict:
    """``Trainer`` built from ``llama3_debugmodel()`` and trained on this rank; its logged
    loss and gradient norm per step. ``resume_from``: a ``step-2`` checkpoint it resumes from."""
    import torchtitan.trainer
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    if engine == "vescale":
        from vescale_plugins import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    config = llama3_debugmodel()
    config.hf_assets_path = os.path.join(assets, "tokenizer")
    config.dataloader.dataset_path = os.path.join(assets, "c4_test")
    config.dump_folder = out
    config.training.local_batch_size, config.training.seq_len, config.training.steps = 2, 64, steps
    config.training.disable_cuda_graphs = True
    config.training.max_norm = 1e9  # see the module's docstring
    config.metrics.log_freq = 1
    if variant == "full_ac":
        from torchtitan.distributed.activation_checkpoint import FullAC

        config.activation_checkpoint = FullAC.Config()
    elif variant == "no_ac":
        config.activation_checkpoint = None
    elif variant == "fp32":
        config.training.mixed_precision_param = "float32"
    else:
        assert variant == "default"
    config.checkpoint.enable = variant == "default"
    config.checkpoint.interval = 2
    if resume_from is not None:
        if dist.get_rank() == 0:
            shutil.copytree(resume_from, os.path.join(out, config.checkpoint.folder, "step-2"))
        dist.barrier()
        config.checkpoint.load_step = 2
    config.model_spec = dataclasses.replace(
        config.model_spec, parallelize_fn=_starting_from_same_values(config.model_spec)
    )

    logged: list[tuple[int, float, float]] = []
    # train() ends with rank 0 sleeping 2 s "for other ranks to complete" (their logs): skipped.
    no_sleep = types.SimpleNamespace(perf_counter=time.perf_counter, time=time.time, sleep=lambda _: None)
    with torchtitan_on_cpu_with(fully_shard), trainer_on_cpu(), patched([(torchtitan.trainer, "time", no_sleep)]):
        trainer = config.build()
        log = trainer.metrics_processor.log

        def record(step, global_avg_loss, global_max_loss, grad_norm, **kwargs):
            logged.append((step, global_avg_loss, grad_norm))
            return log(step, global_avg_loss, global_max_loss, grad_norm, **kwargs)

        trainer.metrics_processor.log = record
        try:
            trainer.train()
        finally:
            trainer.close()
    params = list(trainer.model_parts[0].parameters())
    return {
        "steps": [s for s, _, _ in logged],
        "losses": [loss for _, loss, _ in logged],
        "grad_norms": [norm for _, _, norm in logged],
        "ragged": any(isinstance(pl, RaggedShard) for p in params for pl in p.placements),
    }


def _starting_from_same_values(spec):
    """``spec.parallelize_fn``, with the model's ``init_weights`` followed by
    ``same_initial_values`` (a CPU adaptation, see tests/support/torchtitan_cpu.py)."""
    parallelize = spec.parallelize_fn

    def parallelize_fn(model, **kwargs):
        model = parallelize(model, **kwargs)
        init_weights = model.init_weights

        def init_then_same_values(*, buffer_device=None):
            init_weights(buffer_device=buffer_device)
            same_initial_values(model, spec.model)

        model.init_weights = init_then_same_values
        return model

    return parallelize_fn


def _both(assets: str, tmp: str, variant: str, steps: int) -> dict[str, dict]:
    return {e: _train(e, assets, os.path.join(tmp, e), variant, steps) for e in ("torch", "vescale")}


def _resumed(assets: str, tmp: str) -> dict[str, dict]:
    """Both engines' uninterrupted runs (checkpointed at step 2), then ours resumed from its
    own step-2 checkpoint and from FSDP2's."""
    runs = _both(assets, tmp, "default", STEPS + 1)
    for name, source in (("vescale_from_vescale", "vescale"), ("vescale_from_torch", "torch")):
        step2 = os.path.join(tmp, source, "checkpoint", "step-2")
        runs[name] = _train("vescale", assets, os.path.join(tmp, name), "default", STEPS + 1, resume_from=step2)
    return runs


def _check_same_training(fsdp2: dict, ours: dict, steps: int) -> None:
    assert not fsdp2["ragged"], "FSDP2's run sharded raggedly"
    assert ours["ragged"], "the swap did not take: our units shard raggedly"
    assert fsdp2["steps"] == ours["steps"] == list(range(1, steps + 1))
    assert ours["losses"] == fsdp2["losses"]
    torch.testing.assert_close(ours["grad_norms"], fsdp2["grad_norms"], **TOL)  # see the module's docstring


@pytest.mark.parametrize("variant", ["full_ac", "no_ac", "fp32"])
def test_trainer_matches_fsdp2(dist_run, assets, tmp_path, variant):
    """Full and no activation checkpointing, and fp32 compute (the default is bf16): every
    logged loss is FSDP2's, bit for bit."""
    for result in dist_run(_both, 2, assets, str(tmp_path), variant, STEPS, timeout=300):
        _check_same_training(result["torch"], result["vescale"], STEPS)


def test_trainer_default_and_resume_match_fsdp2(dist_run, assets, tmp_path):
    """torchtitan's default (selective activation checkpointing, bf16 compute), checkpointed
    at step 2 by its DCP checkpointer: ours logs FSDP2's losses bit for bit, and resuming
    from step 2, its own checkpoint or FSDP2's, gives the uninterrupted run's steps 3 and 4."""
    for result in dist_run(_resumed, 2, assets, str(tmp_path), timeout=300):
        fsdp2, ours = result["torch"], result["vescale"]
        _check_same_training(fsdp2, ours, STEPS + 1)
        for name in ("vescale_from_vescale", "vescale_from_torch"):
            resumed = result[name]
            assert resumed["ragged"]
            assert resumed["steps"] == [3, 4], name
            assert resumed["losses"] == ours["losses"][2:] == fsdp2["losses"][2:], name
