"""Hugging Face models through Lightning's Trainer with ``strategy="vescale_fsdp"``, against DDP.

One real launch (``torchrun``, W=2 CPU processes) runs ``hf_lightning_run.py``: a plain
LightningModule around tiny Llama, GPT-2 (tied embedding, Conv1D), Mixtral (mixture of
experts) and BERT (masked LM), trained with gradient accumulation 2 and clipping by Lightning's
``ddp`` strategy and by ``vescale_fsdp``: plainly, with the model's own gradient checkpointing
(``gradient_checkpointing_enable()``), and (Llama, GPT-2) with the strategy's
``activation_checkpointing_policy``. Every veScale run must reproduce DDP's per-micro-batch
losses, parameters and logits to fp32 tolerance; every rank must end with the same parameters;
the full state dict saved with ``save_pretrained`` must load with ``from_pretrained`` in this
process and give the same logits; GPT-2's embedding must stay tied. Llama is fine-tuned too, by
both strategies: PEFT LoRA adapters over fp32 and over frozen bf16 base weights (QLoRA style),
which must leave the base weights bit for bit as they were, and whose adapters, picked out of
the full state dict by ``save_pretrained``, load onto the base model in this process with the
same logits. About 2 minutes on 2 quiet cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# The launches run inside the first test's fixture setup; on a busy 2-core machine they take minutes.
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]
transformers = pytest.importorskip("transformers", minversion="5.0")

pytest.importorskip("peft")

from tests.support.hf_models import (  # noqa: E402  (after the importorskips above)
    FINE_TUNING,
    MODELS,
    assert_fine_tuned,
    assert_saved_adapter_matches,
    assert_saved_model_matches,
    assert_trained_alike,
    assert_training_moved,
)
from tests.support.launched import launch  # noqa: E402  (after the importorskips above)

LAUNCH_TIMEOUT_S = 540
VESCALE_RUNS = [f"{m}:vescale_fsdp:{v}" for m in MODELS for v in ("plain", "hf_ac")] + [
    "llama:vescale_fsdp:policy_ac",
    "gpt2:vescale_fsdp:policy_ac",
    *(f"llama:vescale_fsdp:{v}" for v in FINE_TUNING),
]
DDP_RUNS = [f"{m}:ddp:plain" for m in MODELS] + [f"llama:ddp:{v}" for v in FINE_TUNING]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("hf_lightning")
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    launch(
        [
            *torchrun,
            "tests/support/hf_lightning_run.py",
            "--out",
            str(out),
            "--runs",
            ",".join(DDP_RUNS + VESCALE_RUNS),
        ],
        timeout_s=LAUNCH_TIMEOUT_S,
    )
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("run", VESCALE_RUNS)
def test_lightning_vescale_matches_ddp(launched, run):
    name, _, variant = run.split(":")
    results = launched[1]
    baseline = f"{name}:ddp:{variant if variant in FINE_TUNING else 'plain'}"
    for rank in range(2):
        got, want = results[rank][run], results[rank][baseline]
        assert got["engine"] == "VeScaleFSDPStrategy"
        assert want["engine"] == "DDPStrategy"
        assert got["hf_checkpointing"] == (variant == "hf_ac")
        assert (got["checkpoint_wrappers"] > 0) == (variant == "policy_ac")
        assert len(got["losses"]) == 4
        assert_trained_alike(got, want, rank)
    assert results[0][run]["losses"] != results[1][run]["losses"]  # each rank saw its own batches
    assert_training_moved(name, variant, results[0][run])


def test_every_rank_ends_with_the_same_parameters(launched):
    results = launched[1]
    for run in results[0]:
        for key, value in results[0][run]["params"].items():
            assert torch.equal(results[1][run]["params"][key], value), f"{run} {key} differs between ranks"


@pytest.mark.parametrize("name", list(MODELS))
def test_saved_full_state_dict_loads_with_from_pretrained(launched, name):
    out, results = launched
    assert_saved_model_matches(out / name / "saved", name, results[0][f"{name}:vescale_fsdp:plain"])


@pytest.mark.parametrize("variant", FINE_TUNING)
def test_fine_tuning_trains_only_the_adapters_under_both_strategies(launched, variant):
    for strategy in ("ddp", "vescale_fsdp"):
        assert_fine_tuned("llama", variant, launched[1][0][f"llama:{strategy}:{variant}"])


@pytest.mark.parametrize("variant", FINE_TUNING)
def test_saved_adapter_loads_in_one_process(launched, variant):
    out, results = launched
    assert_saved_adapter_matches(
        out / f"llama-{variant}" / "saved", "llama", variant, results[0][f"llama:vescale_fsdp:{variant}"]
    )


def test_gpt2_embedding_stays_tied_while_training(launched):
    results = launched[1]
    for run in ("gpt2:vescale_fsdp:plain", "gpt2:vescale_fsdp:hf_ac", "gpt2:vescale_fsdp:policy_ac"):
        assert all(results[r][run]["tied"] for r in range(2)), run
