"""Lightning's Trainer and Fabric on the harness's gloo ranks, and a LightningModule around the test decoder."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, Dataset

import lightning_strategy  # noqa: F401  (registers "vescale_fsdp")
from tests.support.comm_counts import comm_counts
from tests.support.models import PER_RANK, SEQ, VOCAB, loss_fn, make_decoder
from tests.support.parity import adamw

LAYERS = 2
MICRO_BATCHES = 6  # per epoch and rank
ACCUMULATE = 2
CLIP = 0.5  # the gradient norm is ~5-40 here, so every step clips


class Tokens(Dataset):
    """``size`` fixed token sequences; item i is (tokens, next-token targets)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def dataset(world: int, micro_batches: int = MICRO_BATCHES, per_rank: int = PER_RANK) -> Tokens:
    return Tokens(world * per_rank * micro_batches)


class LitDecoder(LightningModule):
    """A plain LightningModule around the test decoder: no sharding code at all."""

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = make_decoder(seed=0, layers=layers)
        self.losses: list[float] = []  # this rank's loss per micro-batch
        self.global_losses: list[float] = []  # the mean over ranks, per micro-batch
        self.backward_reduce_scatters: list[int] = []  # per micro-batch

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = loss_fn(self(tokens), targets)
        self.log("train_loss", loss, sync_dist=True)
        self.losses.append(loss.item())
        self.global_losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        self.log("val_loss", loss_fn(self(tokens), targets), sync_dist=True)

    def test_step(self, batch, batch_idx):
        tokens, targets = batch
        self.log("test_loss", loss_fn(self(tokens), targets), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        tokens, _ = batch
        return self(tokens).argmax(-1)

    def configure_optimizers(self):
        return adamw(self)

    def backward(self, loss, *args, **kwargs):
        # Instrumentation only: count the gradient reduce-scatters each backward issues.
        self.backward_reduce_scatters.append(
            reduce_scatters(lambda: super(LitDecoder, self).backward(loss, *args, **kwargs))
        )


def reduce_scatters(fn) -> int:
    """How many reduce-scatters ``fn()`` issued (the gradient sync of a backward)."""
    return comm_counts(fn)[1].get("reduce_scatter", 0)


@contextmanager
def launched_by_harness():
    """Tell Lightning the processes exist already (as under torchrun): LOCAL_RANK is this rank.

    Workers are reused across tests, so the environment is restored afterwards.
    """
    saved = {key: os.environ.get(key) for key in ("LOCAL_RANK", "NODE_RANK")}
    os.environ.update(LOCAL_RANK=str(dist.get_rank()), NODE_RANK="0")
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_trainer(root: str, strategy="vescale_fsdp", **kwargs) -> Trainer:
    """A quiet Trainer on this harness's gloo ranks (call inside ``launched_by_harness``)."""
    defaults = dict(
        accelerator="cpu",
        devices=dist.get_world_size(),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    defaults.update(kwargs)
    return Trainer(strategy=strategy, **defaults)


def make_fabric(strategy="vescale_fsdp", **kwargs) -> Fabric:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), **kwargs)
    fabric.launch()
    return fabric


def loader(data: Dataset, per_rank: int = PER_RANK) -> DataLoader:
    """A DataLoader with no distributed sampler: the Trainer and Fabric must add one."""
    return DataLoader(data, batch_size=per_rank, shuffle=True)
