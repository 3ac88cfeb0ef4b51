"""PEFT LoRA fine-tuning in a plain ``fully_shard`` loop, against DDP and FSDP2 in the same body.

Tiny Hugging Face Llama (``tests/support/hf_models.py``) with LoRA adapters, over fp32 and over
frozen bf16 base weights (QLoRA style), trained a few AdamW steps on 2 gloo ranks three ways:
DDP, FSDP2's ``fully_shard`` and ours, each decoder layer a unit. Ours must match DDP's losses,
parameters and logits, leave every base weight bit for bit as it was, and its adapters, picked
out of the full state dict by ``save_pretrained``, must load onto the base model in this
process with the same logits. The peak tensor memory of a steady step, measured for DDP, FSDP2
and ours alike, must be no more than FSDP2's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel

pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("peft")

from tests.support.hf_models import (
    FINE_TUNING,
    assert_fine_tuned,
    assert_saved_adapter_matches,
    assert_trained_alike,
    examples,
    full_parameters,
    make_lora_model,
    probe_input,
)
from tests.support.parity import TOL
from vescale_plugins import fully_shard
from vescale_plugins.observe.allocations import AllocationTracker

STEPS = 3
BATCH = 2  # sequences per rank and step


def _batch(step: int) -> dict[str, torch.Tensor]:
    rows = examples("llama")[(step * dist.get_world_size() + dist.get_rank()) * BATCH :][:BATCH]
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def _shard(model, shard):
    for layer in model.base_model.model.model.layers:
        shard(layer)
    shard(model)
    return model


def _train(variant: str, engine: str) -> dict:
    """Train ``STEPS`` steps; the losses, the full parameters, the probe's logits and the peak
    tensor bytes of the last step."""
    model = make_lora_model("llama", variant)
    if engine == "ddp":
        trained = DistributedDataParallel(model)
    else:
        trained = _shard(model, fully_shard if engine == "vescale" else torch_fully_shard)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    with AllocationTracker() as tracker:
        for step in range(STEPS):
            with tracker.region(f"step{step}"):
                loss = trained(**_batch(step)).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = trained(input_ids=probe_input()).logits.float()
    return {
        "model": model,
        "losses": losses,
        "params": full_parameters(model),
        "logits": logits,
        "peak_bytes": tracker.region_memory(f"step{STEPS - 1}").peak_bytes,
    }


def _fine_tune(variant: str, saved_dir: str) -> dict:
    ddp, fsdp2, ours = (_train(variant, engine) for engine in ("ddp", "fsdp2", "vescale"))
    assert_trained_alike(ours, ddp, dist.get_rank())
    torch.testing.assert_close(fsdp2["logits"], ddp["logits"], **TOL)
    state = get_model_state_dict(ours["model"], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        ours["model"].save_pretrained(saved_dir, state_dict=state)
    dist.barrier()
    return {
        "ours": {k: ours[k] for k in ("losses", "params", "logits")},
        "peak_bytes": {"ddp": ddp["peak_bytes"], "fsdp2": fsdp2["peak_bytes"], "vescale": ours["peak_bytes"]},
    }


@pytest.mark.parametrize("variant", FINE_TUNING)
def test_lora_in_a_plain_loop_matches_ddp_and_saves_its_adapter(dist_run, tmp_path, variant):
    results = dist_run(_fine_tune, 2, variant, str(tmp_path / "saved"), timeout=240)
    assert results[0]["ours"]["losses"] != results[1]["ours"]["losses"]  # each rank saw its own batches
    for result in results:
        assert_fine_tuned("llama", variant, result["ours"])
        peaks = result["peak_bytes"]
        assert peaks["vescale"] <= peaks["fsdp2"], {k: f"{v / 2**10:.0f} KiB" for k, v in peaks.items()}
    assert_saved_adapter_matches(tmp_path / "saved", "llama", variant, results[0]["ours"])
