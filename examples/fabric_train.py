"""Train a small decoder with Lightning Fabric and veScale-FSDP.

    python examples/fabric_train.py                                   # 2 CPU processes, Fabric's launcher
    torchrun --standalone --nproc-per-node 2 examples/fabric_train.py # or any launcher
    python examples/fabric_train.py --accelerator gpu --devices 8 --precision bf16-mixed
    python examples/fabric_train.py --resume                          # 10 more steps from the checkpoint

The loop is Fabric's FSDP recipe: the model is built on the meta device (each rank then
allocates only its shards), set up before its optimizer, trained with gradient accumulation
(no gradient sync on accumulating micro-batches) and clipping, and saved as a sharded
checkpoint that ``--resume`` continues from, at any number of processes.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning_train import counting_sequences
from tiny_decoder import TinyDecoder
from torch.utils.data import DataLoader

import lightning_strategy  # noqa: F401  (registers strategy="vescale_fsdp")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "bf16-true"])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run (after --resume: this many more)")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per process and micro-batch")
    parser.add_argument("--checkpoint", default="fabric_train_output/checkpoint")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    fabric = L.Fabric(
        strategy="vescale_fsdp", accelerator=args.accelerator, devices=args.devices, precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(0)

    with fabric.init_module(empty_init=True):
        model = TinyDecoder()
    model = fabric.setup_module(model)  # shards, then materialises with reset_parameters()
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    loader = fabric.setup_dataloaders(DataLoader(counting_sequences(4096), batch_size=args.batch_size, shuffle=True))

    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.checkpoint, state)
    last_step = state["step"] + args.steps
    batches = iter(loader)
    while state["step"] < last_step:
        for micro in range(args.accumulation):
            tokens, targets = next(batches)
            with fabric.no_backward_sync(model, enabled=micro < args.accumulation - 1):
                loss = F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())
                fabric.backward(loss / args.accumulation)
        grad_norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
        fabric.print(f"step {state['step']}: loss {loss.item():.4f}, grad norm {grad_norm.item():.3f}")
    fabric.save(args.checkpoint, state)


if __name__ == "__main__":
    main()
