"""Data-dependent routing through the Lightning strategy: experts a rank's batch skipped still step.

A mixture-of-experts layer whose experts are separate modules (as transformers 4.x built
Mixtral/Qwen-MoE; transformers 5 fuses them into 3-D parameters, which every batch reaches).
Each sequence goes to one expert chosen by its first token, so in every micro-batch each rank
reaches only a few experts, and different ones. The strategy's default behaviour must train
what Lightning's DDP with ``find_unused_parameters=True`` trains: an expert one rank reached gets
the reduced gradient on every rank and steps everywhere; with gradient accumulation and clipping.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DDPStrategy

from lightning_strategy import VeScaleFSDPStrategy
from tests.support.lightning_harness import (
    ACCUMULATE,
    CLIP,
    MICRO_BATCHES,
    dataset,
    launched_by_harness,
    loader,
    make_trainer,
)
from tests.support.models import VOCAB

pytestmark = pytest.mark.timeout(600)  # several Trainer fits on a busy 2-core machine
HIDDEN, EXPERTS = 24, 8


class MoELayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
            for _ in range(EXPERTS)
        )

    def forward(self, x: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        gates = self.router(x.mean(1)).softmax(-1)
        out = torch.zeros_like(x)
        for e in choice.unique().tolist():
            rows = choice == e
            out[rows] = self.experts[e](x[rows]) * gates[rows, e, None, None]
        return x + out


class LitMoE(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.moe = MoELayer()
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.losses: list[float] = []
        self.reached: set[int] = set()  # experts this rank's batches reached

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        choice = tokens[:, 0] % EXPERTS
        self.reached.update(choice.tolist())
        return self.head(self.moe(self.embed(tokens), choice))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in module.named_parameters()
    }


def _fit(root: str, strategy) -> LitMoE:
    module = LitMoE()
    trainer = make_trainer(root, strategy=strategy, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP)
    trainer.fit(module, loader(dataset(dist.get_world_size())))
    return module


def _routing_matches_ddp(root: str) -> None:
    with launched_by_harness():
        ddp = _fit(root, DDPStrategy(find_unused_parameters=True))
        ours = _fit(root, VeScaleFSDPStrategy(auto_wrap_policy={MoELayer}))  # experts run inside the MoE unit
    assert len(ours.losses) == MICRO_BATCHES
    torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(ddp.losses))
    want, got = _params(ddp), _params(ours)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=lambda m: f"{name}: {m}")
    reached = [None] * dist.get_world_size()
    dist.all_gather_object(reached, ours.reached)
    return reached


def test_experts_reached_by_one_rank_only_train_as_under_ddp(dist_run, tmp_path):
    reached = dist_run(_routing_matches_ddp, 2, str(tmp_path), timeout=420)[0]
    # The case that matters happened: each rank missed experts the other reached.
    assert reached[0] - reached[1], reached
    assert reached[1] - reached[0], reached
