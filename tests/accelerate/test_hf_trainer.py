"""Hugging Face models through ``transformers.Trainer`` on our Accelerate route, against DDP.

Two real launches, W=2 CPU processes each, under the same launcher (``accelerate launch``):

* veScale-FSDP: an ordinary FSDP2 config file (``TRANSFORMER_BASED_WRAP``, full state dict)
  and ``-m accelerate_plugin.run`` in front of the script;
* DDP: ``--multi_gpu`` with ``ACCELERATE_USE_CPU=true`` (Accelerate's multi-process CPU DDP).

``hf_trainer_run.py`` trains tiny Llama, GPT-2 (tied embedding, Conv1D), Mixtral (mixture of
experts) and BERT (masked LM) with gradient accumulation 2 and clipping; under veScale also with
transformers' gradient checkpointing and with the config's ``fsdp_activation_checkpointing``.
Every run must reproduce DDP's per-micro-batch losses, clipped gradient norms, parameters and
logits to fp32 tolerance; every rank must end with the same parameters; the model
``trainer.save_model()`` wrote must load with ``from_pretrained`` in this (single) process and
give the same logits; GPT-2's embedding must stay tied. Llama is fine-tuned too, under both
engines: PEFT LoRA adapters over fp32 and over frozen bf16 base weights (QLoRA style), which
must leave the base weights bit for bit as they were, and whose adapters ``save_model()``
writes alone, loading onto the base model in this process with the same logits. About 3 minutes on 2 quiet cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# The launches run inside the first test's fixture setup; on a busy 2-core machine they take minutes.
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
transformers = pytest.importorskip("transformers", minversion="5.0")

from tests.support.accelerate_harness import accelerate_env  # noqa: E402  (after the importorskip above)

pytest.importorskip("peft")

from tests.support.hf_models import (  # noqa: E402  (after the importorskips above)
    FINE_TUNING,
    MODELS,
    assert_fine_tuned,
    assert_saved_adapter_matches,
    assert_saved_model_matches,
    assert_trained_alike,
    assert_training_moved,
    make_model,
)
from tests.support.launched import launch  # noqa: E402  (after the importorskip above)

LAUNCH_TIMEOUT_S = 420  # each of two launches, within the module's 900 s
FSDP2_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: 'no'
num_machines: 1
num_processes: 2
machine_rank: 0
rdzv_backend: static
same_network: true
use_cpu: false
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_activation_checkpointing: false
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
"""
# model:variant (see hf_trainer_run.py); DDP trains each model once plainly, and fine-tunes Llama.
FINE_TUNING_RUNS = [f"llama:{v}" for v in FINE_TUNING]
VESCALE_RUNS = [f"{m}:{v}" for m in MODELS for v in ("plain", "hf_ac")] + [
    "llama:plugin_ac",
    "gpt2:plugin_ac",
    *FINE_TUNING_RUNS,
]
SAVED_RUNS = [f"{m}:plain" for m in MODELS] + FINE_TUNING_RUNS
DDP_RUNS = [f"{m}:plain" for m in MODELS] + FINE_TUNING_RUNS
ACCELERATE = ["-m", "accelerate.commands.accelerate_cli", "launch", "--num_processes", "2", "--main_process_port", "0"]


def _results(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def vescale(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("hf_trainer_vescale")
    (out / "fsdp2.yaml").write_text(FSDP2_CONFIG)
    launch(
        [
            *ACCELERATE,
            "--config_file",
            str(out / "fsdp2.yaml"),
            "-m",
            "accelerate_plugin.run",
            "tests/support/hf_trainer_run.py",
            "--out",
            str(out),
            "--runs",
            ",".join(VESCALE_RUNS),
            "--save",
            ",".join(SAVED_RUNS),
        ],
        timeout_s=LAUNCH_TIMEOUT_S,
    )
    return out, _results(out)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("hf_trainer_ddp")
    launch(
        [
            *ACCELERATE,
            "--multi_gpu",
            "tests/support/hf_trainer_run.py",
            "--out",
            str(out),
            "--runs",
            ",".join(DDP_RUNS),
        ],
        timeout_s=LAUNCH_TIMEOUT_S,
        env={"ACCELERATE_USE_CPU": "true"},
    )
    return _results(out)


@pytest.mark.parametrize("run", VESCALE_RUNS)
def test_trainer_on_vescale_matches_ddp(vescale, ddp, run):
    name, variant = run.split(":")
    baseline = run if run in DDP_RUNS else f"{name}:plain"
    for rank in range(2):
        got, want = vescale[1][rank][run], ddp[rank][baseline]
        assert got["engine"] == "RaggedShard"
        assert want["engine"] == "DistributedDataParallel"
        # The checkpointing asked for is in place (and only that one).
        assert got["hf_checkpointing"] == (variant == "hf_ac")
        assert (got["checkpoint_wrappers"] > 0) == (variant == "plugin_ac")
        assert len(got["losses"]) == 4
        assert len(got["grad_norms"]) == 2
        assert_trained_alike(got, want, rank)
        torch.testing.assert_close(
            torch.tensor(got["grad_norms"]), torch.tensor(want["grad_norms"]), msg=lambda m: f"grad norms: {m}"
        )
    # Each rank trained on its own batches, and training changed the model.
    assert vescale[1][0][run]["losses"] != vescale[1][1][run]["losses"]
    assert_training_moved(name, variant, vescale[1][0][run])


@pytest.mark.parametrize("engine", ["vescale", "ddp"])
def test_every_rank_ends_with_the_same_parameters(vescale, ddp, engine):
    results = vescale[1] if engine == "vescale" else ddp
    for run in results[0]:
        for key, value in results[0][run]["params"].items():
            assert torch.equal(results[1][run]["params"][key], value), f"{run} {key} differs between ranks"
        assert torch.equal(results[1][run]["logits"], results[0][run]["logits"]), run


def test_mixture_of_experts_routes_differently_per_rank_and_still_matches_ddp(vescale, ddp):
    counts = [vescale[1][r]["mixtral:plain"]["expert_tokens"] for r in range(2)]
    assert not torch.equal(counts[0], counts[1]), "both ranks routed identically: the test shows nothing"
    assert torch.equal(counts[0], ddp[0]["mixtral:plain"]["expert_tokens"])  # the parity test checks the rest


@pytest.mark.parametrize("name", list(MODELS))
def test_save_model_loads_with_from_pretrained_in_one_process(vescale, name):
    out, results = vescale
    assert_saved_model_matches(out / f"{name}-plain" / "saved", name, results[0][f"{name}:plain"])


@pytest.mark.parametrize("run", FINE_TUNING_RUNS)
def test_fine_tuning_trains_only_the_adapters_under_both_engines(vescale, ddp, run):
    name, variant = run.split(":")
    for results in (vescale[1], ddp):
        assert_fine_tuned(name, variant, results[0][run])


@pytest.mark.parametrize("run", FINE_TUNING_RUNS)
def test_save_model_writes_an_adapter_that_loads_in_one_process(vescale, run):
    out, results = vescale
    name, variant = run.split(":")
    assert_saved_adapter_matches(out / f"{name}-{variant}" / "saved", name, variant, results[0][run])


def test_gpt2_embedding_stays_tied_while_training(vescale):
    for run in ("gpt2:plain", "gpt2:hf_ac", "gpt2:plugin_ac"):
        assert all(vescale[1][r][run]["tied"] for r in range(2)), run


def _bert_with_its_default_units_is_refused() -> None:
    from accelerate import Accelerator

    from accelerate_plugin import VeScaleFSDPPlugin

    with accelerate_env():
        accelerator = Accelerator(fsdp_plugin=VeScaleFSDPPlugin(auto_wrap_policy="transformer_based_wrap"))
        model = make_model("bert")  # _no_split_modules = [BertEmbeddings, BertLayer]
        with pytest.raises(
            ValueError, match=r"'cls\.predictions\.decoder\.weight' \(managed as 'word_embeddings\.weight'\)"
        ):
            accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
        dist.barrier()  # no rank is left inside a collective


def test_tied_weight_split_across_units_is_refused_before_any_collective(dist_run):
    # BERT's default units put the tied word embedding in one unit and the decoder using it in
    # the root; torch's FSDP2 silently unties them, veScale-FSDP refuses on every rank.
    dist_run(_bert_with_its_default_units_is_refused, 2, timeout=240)
