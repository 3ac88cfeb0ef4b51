"""``transformers.Trainer`` builds its own Accelerator; the environment route still gives veScale-FSDP.

Skipped unless ``transformers`` is installed (it is not a test dependency of this project).
The environment is what ``accelerate launch --config_file <FSDP2 yaml> -m accelerate_plugin.run``
gives each process on a machine without GPUs.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset

from accelerate_plugin import VeScaleFSDPPlugin
from tests.support.accelerate_harness import accelerate_env, fsdp2_launch_env
from vescale_plugins import RaggedShard

transformers = pytest.importorskip("transformers")

LAUNCH_ENV = fsdp2_launch_env("LlamaDecoderLayer", ACCELERATE_USE_VESCALE_FSDP="1", ACCELERATE_USE_CPU="true")


class RandomTokens(Dataset):
    def __init__(self) -> None:
        self.tokens = torch.randint(0, 101, (16, 17), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def _trainer_trains_with_vescale(output_dir: str) -> list[float]:
    with accelerate_env(**LAUNCH_ENV):
        config = transformers.LlamaConfig(
            vocab_size=101,
            hidden_size=48,
            intermediate_size=97,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        torch.manual_seed(0)
        args = transformers.TrainingArguments(
            output_dir=output_dir,
            max_steps=2,
            per_device_train_batch_size=2,
            learning_rate=1e-3,
            max_grad_norm=1.0,
            optim="adamw_torch",
            save_strategy="no",
            logging_steps=1,
            report_to=[],
        )
        trainer = transformers.Trainer(
            model=transformers.LlamaForCausalLM(config), args=args, train_dataset=RandomTokens()
        )
        trainer.train()
        assert isinstance(trainer.accelerator.state.fsdp_plugin, VeScaleFSDPPlugin)
        params = list(trainer.model_wrapped.parameters())
        assert all(isinstance(p, DTensor) and isinstance(p.placements[0], RaggedShard) for p in params)
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_built_accelerator_uses_vescale(dist_run, tmp_path):
    losses = dist_run(_trainer_trains_with_vescale, 2, str(tmp_path), timeout=180)
    assert losses[0] == losses[1]
    assert len(losses[0]) == 2
