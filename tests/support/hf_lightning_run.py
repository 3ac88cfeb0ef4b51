"""Lightning's Trainer on tiny Hugging Face models, as ``tests/lightning/test_hf_models.py`` launches it.

    torchrun --standalone --nproc-per-node 2 tests/support/hf_lightning_run.py --out DIR \\
        --runs llama:ddp:plain,llama:vescale_fsdp:plain,llama:vescale_fsdp:hf_ac,...

A LightningModule wraps each model (``tests/support/hf_models.py``) as a user would: ``training_step``
returns the model's own loss; gradient accumulation 2, clipping, AdamW. Strategies: ``ddp``
(Lightning's) and ``vescale_fsdp``. Variants: ``plain``; ``hf_ac``: the model's own
checkpointed layers (``gradient_checkpointing_enable()``); ``policy_ac``: the strategy's
``activation_checkpointing_policy={<decoder layer class>}``; ``lora``, ``qlora``: fine-tuning
PEFT adapters (``hf_models.FINE_TUNING``). All runs share one launch (one
process group). Each rank writes ``DIR/rank{r}.pt``: per run the per-micro-batch losses, every
parameter (full), the logits of a fixed batch and whether checkpointing was on; ``vescale_fsdp``
``plain`` runs also save the full state dict with ``save_pretrained`` to ``DIR/<model>/saved``,
fine-tuning runs their adapters to ``DIR/<model>-<variant>/saved``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_models import FINE_TUNING, examples, full_parameters, make_lora_model, make_model, probe_input

import lightning_strategy  # noqa: F401  (registers "vescale_fsdp")
from lightning_strategy import VeScaleFSDPStrategy

LAYER_CLASSES = {
    "llama": "LlamaDecoderLayer",
    "gpt2": "GPT2Block",
    "mixtral": "MixtralDecoderLayer",
    "bert": "BertLayer",
}
OPTIMIZER_STEPS = 2
ACCUMULATION = 2
CLIP = 0.5  # below the models' gradient norms: every step clips


class LitHF(LightningModule):
    def __init__(self, name: str, variant: str) -> None:
        super().__init__()
        self.model = make_lora_model(name, variant) if variant in FINE_TUNING else make_model(name)
        if variant == "hf_ac":
            self.model.gradient_checkpointing_enable()
        self.losses: list[float] = []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def train(name: str, strategy: str, variant: str, out: Path) -> dict[str, Any]:
    module = LitHF(name, variant)
    chosen: Any = strategy
    if strategy == "vescale_fsdp":
        policy = {LAYER_CLASSES[name]} if variant == "policy_ac" else None
        chosen = VeScaleFSDPStrategy(state_dict_type="full", activation_checkpointing_policy=policy)
    trainer = Trainer(
        strategy=chosen,
        accelerator="cpu",
        devices=2,
        max_steps=OPTIMIZER_STEPS,
        accumulate_grad_batches=ACCUMULATION,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    trainer.fit(module, DataLoader(examples(name), batch_size=2, shuffle=True))
    result: dict[str, Any] = {
        "engine": type(trainer.strategy).__name__,
        "losses": module.losses,
        "params": full_parameters(module, prefix="model."),
        "hf_checkpointing": any(getattr(m, "gradient_checkpointing", False) for m in module.modules()),
        "checkpoint_wrappers": sum(isinstance(m, CheckpointWrapper) for m in module.modules()),
    }
    if name == "gpt2":
        result["tied"] = module.model.lm_head.weight is module.model.transformer.wte.weight
    if strategy == "vescale_fsdp" and variant in ("plain", *FINE_TUNING):
        # The full state dict (rank 0 gets full tensors), written as a Hugging Face model
        # directory (a PEFT model's save_pretrained picks its adapters out of it).
        state = trainer.strategy.lightning_module_state_dict()
        if trainer.is_global_zero:
            hf_state = {key.removeprefix("model."): value for key, value in state.items()}
            saved = out / (name if variant == "plain" else f"{name}-{variant}") / "saved"
            module.model.save_pretrained(str(saved), state_dict=hf_state)
    module.eval()
    with torch.no_grad():
        result["logits"] = module(probe_input()).float().cpu()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", required=True, help="comma-separated model:strategy:variant")
    cli = parser.parse_args()
    results = {run: train(*run.split(":"), cli.out) for run in cli.runs.split(",")}
    torch.save(results, cli.out / f"rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
