"""Train a small decoder with Lightning's Trainer and veScale-FSDP.

    python examples/lightning_train.py                                # 2 CPU processes, Lightning's launcher
    python examples/lightning_train.py --accelerator gpu --devices 8 --precision bf16-mixed
    python examples/lightning_train.py --resume lightning_train_output/last.ckpt  # 20 more steps

The LightningModule is plain: no sharding code. The only veScale-specific lines are
``import lightning_strategy`` (it registers the strategy name) and ``strategy="vescale_fsdp"``
where an FSDP user writes ``strategy="fsdp"``. The strategy shards every block of the
model's ``nn.ModuleList`` and then the LightningModule itself; checkpoints are sharded
directories (any world size can resume them). At the end rank 0 prints the losses.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny_decoder import TinyDecoder
from torch.utils.data import DataLoader, TensorDataset

import lightning_strategy  # noqa: F401  (registers strategy="vescale_fsdp")


class LitDecoder(L.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyDecoder()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, targets = batch
        return F.cross_entropy(self(tokens).float().flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def counting_sequences(count: int, length: int = 17, vocab: int = 97, seed: int = 0) -> TensorDataset:
    """Sequences that count up by a per-sequence step (mod ``vocab``): learnable, so the loss falls."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (count, 1), generator=g)
    step = torch.randint(1, 5, (count, 1), generator=g)
    data = (start + step * torch.arange(length)) % vocab
    return TensorDataset(data[:, :-1], data[:, 1:])


DEFAULT_STEPS = 20


def checkpoint_step(path: str) -> int:
    """The global step a checkpoint was saved at (a sharded directory keeps it in meta.pt)."""
    file = Path(path, "meta.pt") if Path(path).is_dir() else Path(path)
    return int(torch.load(file, map_location="cpu", weights_only=False)["global_step"])


def last_step(args: argparse.Namespace) -> int:
    """``--max-steps``, else DEFAULT_STEPS more than the resumed checkpoint's (a resume must train)."""
    if args.max_steps is not None:
        return args.max_steps
    return DEFAULT_STEPS + (checkpoint_step(args.resume) if args.resume else 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"])
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help=f"stop at this global step (default: {DEFAULT_STEPS}, or {DEFAULT_STEPS} more than --resume's checkpoint)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per process and micro-batch")
    parser.add_argument("--output-dir", default="lightning_train_output")
    parser.add_argument("--resume", default=None, help="a checkpoint to continue from")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    args.max_steps = last_step(args)
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy="vescale_fsdp",
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        val_check_interval=10,
        check_val_every_n_epoch=None,
        callbacks=[ModelCheckpoint(dirpath=args.output_dir, save_last=True)],
        default_root_dir=args.output_dir,
        logger=False,
        enable_progress_bar=False,
    )
    train = DataLoader(counting_sequences(4096), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(counting_sequences(64, seed=1), batch_size=args.batch_size)
    trainer.fit(LitDecoder(), train, val, ckpt_path=args.resume)
    if trainer.is_global_zero:
        metrics = {name: round(value.item(), 4) for name, value in trainer.callback_metrics.items()}
        print(f"finished at step {trainer.global_step}: {metrics}")


if __name__ == "__main__":
    main()
