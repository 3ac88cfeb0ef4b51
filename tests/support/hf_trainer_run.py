"""``transformers.Trainer`` on tiny Hugging Face models, as ``tests/accelerate/test_hf_trainer.py`` launches it.

    accelerate launch --config_file <FSDP2 yaml> --num_processes 2 -m accelerate_plugin.run \\
        tests/support/hf_trainer_run.py --out DIR --runs llama:plain,llama:hf_ac,...
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 \\
        tests/support/hf_trainer_run.py --out DIR --runs llama:plain,...            (the DDP baseline)

Each run trains one model (``tests/support/hf_models.py``) with the user's ordinary Trainer setup:
gradient accumulation 2, clipping, AdamW. Variants: ``plain``; ``hf_ac``: the
``gradient_checkpointing=True`` training argument (transformers' own checkpointed layers);
``plugin_ac``: the FSDP config's ``fsdp_activation_checkpointing: true`` (Accelerate wraps the
units), set here through ``FSDP_ACTIVATION_CHECKPOINTING``, the variable ``accelerate launch``
turns that key into; ``lora``, ``qlora``: fine-tuning PEFT adapters (``hf_models.FINE_TUNING``),
which ``save_model()`` writes alone. Several runs share one launch to keep the test fast, so Accelerate's
process-wide state is reset between runs. Each rank writes ``DIR/rank{r}.pt``: per run the
per-micro-batch losses, the logged gradient norms, every parameter (full), the logits of a fixed
batch, and the engine that trained it; ``--save`` runs also ``trainer.save_model()``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate.state import AcceleratorState, GradientState
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_models import (
    FINE_TUNING,
    count_expert_tokens,
    examples,
    full_parameters,
    make_lora_model,
    make_model,
    probe_input,
)

OPTIMIZER_STEPS = 2
ACCUMULATION = 2
MAX_GRAD_NORM = 0.5  # below the models' gradient norms: every step clips


class RecordingTrainer(transformers.Trainer):
    """The stock Trainer, recording each micro-batch's loss on this rank."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_losses: list[float] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss = result[0] if return_outputs else result
        self.micro_losses.append(float(loss.detach()))
        return result


def engine(model: torch.nn.Module, trainer: transformers.Trainer) -> str:
    placements = {type(p.placements[0]).__name__ for p in model.parameters() if hasattr(p, "placements")}
    if placements:
        return "+".join(sorted(placements))
    return type(trainer.model_wrapped).__name__


# What each model's FSDP config file would add to the shared one. BERT's ``_no_split_modules``
# (the default units) makes ``BertEmbeddings`` a unit, but its word embedding is tied to the
# masked-LM decoder in the root: one tied weight in two units, which veScale-FSDP refuses
# (torch's FSDP2 silently unties it). Naming the layer class keeps the tie in the root unit.
MODEL_CONFIG = {"bert": {"FSDP_TRANSFORMER_CLS_TO_WRAP": "BertLayer"}}


def train(name: str, variant: str, out: Path, save: bool) -> dict[str, Any]:
    # The config keys ``accelerate launch`` turns into these variables, per run.
    for key in ("FSDP_ACTIVATION_CHECKPOINTING", "FSDP_TRANSFORMER_CLS_TO_WRAP"):
        os.environ.pop(key, None)
    os.environ.update(MODEL_CONFIG.get(name, {}))
    if variant == "plugin_ac":
        os.environ["FSDP_ACTIVATION_CHECKPOINTING"] = "true"
    # One training per process is the usual case; this process runs several.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    model = make_lora_model(name, variant) if variant in FINE_TUNING else make_model(name)
    args = transformers.TrainingArguments(
        output_dir=str(out / f"{name}-{variant}"),
        max_steps=OPTIMIZER_STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=ACCUMULATION,
        max_grad_norm=MAX_GRAD_NORM,
        learning_rate=1e-2,
        optim="adamw_torch",  # the default fused AdamW does not run on DTensor shards
        gradient_checkpointing=variant == "hf_ac",  # transformers 5 also calls it activation_checkpointing
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
    )
    expert_tokens = count_expert_tokens(model) if name == "mixtral" else None
    trainer = RecordingTrainer(model=model, args=args, train_dataset=examples(name))
    trainer.train()
    trained = trainer.model
    result: dict[str, Any] = {
        "engine": engine(trained, trainer),
        "losses": trainer.micro_losses,
        "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
        "params": full_parameters(trained),
        "hf_checkpointing": any(getattr(m, "gradient_checkpointing", False) for m in trained.modules()),
        "checkpoint_wrappers": sum(isinstance(m, CheckpointWrapper) for m in trained.modules()),
    }
    if expert_tokens is not None:
        result["expert_tokens"] = expert_tokens()
    if name == "gpt2":
        result["tied"] = trained.lm_head.weight is trained.transformer.wte.weight
    if save:
        trainer.save_model(str(out / f"{name}-{variant}" / "saved"))
    trained.eval()
    with torch.no_grad():
        result["logits"] = trained(input_ids=probe_input()).logits.float().cpu()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", required=True, help="comma-separated model:variant")
    parser.add_argument("--save", default="", help="comma-separated model:variant runs that also save_model()")
    cli = parser.parse_args()
    save = set(filter(None, cli.save.split(",")))
    results = {}
    for run in cli.runs.split(","):
        name, variant = run.split(":")
        results[run] = train(name, variant, cli.out, run in save)
    torch.save(results, cli.out / f"rank{dist.get_rank()}.pt")
    dist.barrier()


if __name__ == "__main__":
    main()
