"""Train a small decoder with Hugging Face Accelerate: the script an FSDP2 user already has.

Nothing here is veScale-specific. With FSDP2 it is launched as

    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/accelerate_train.py

and with veScale-FSDP, config and script unchanged, as

    accelerate launch --config_file examples/accelerate_fsdp2.yaml -m accelerate_plugin.run examples/accelerate_train.py

(or in code: ``Accelerator(fsdp_plugin=accelerate_plugin.VeScaleFSDPPlugin(...))``; see
docs/accelerate.md). It trains on random tokens with gradient accumulation and clipping,
then writes to ``--output_dir``: a resumable state (``save_state``), full weights a plain
model loads (``save_model``), and ``summary.json`` (losses, how the parameters were sharded).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from tiny_decoder import TinyDecoder
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ = 97, 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch_size", type=int, default=4, help="sequences per micro-batch per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--output_dir", default="accelerate_train_output")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(gradient_accumulation_steps=args.accumulation)
    set_seed(0)
    model = TinyDecoder(vocab=VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    samples = args.steps * args.accumulation * args.batch_size * accelerator.num_processes
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens), batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    losses, grad_norms = [], []
    for (batch,) in loader:
        with accelerator.accumulate(model):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grad_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        accelerator.print(f"micro-step {len(losses)}: loss {losses[-1]:.4f}")

    accelerator.save_state(os.path.join(args.output_dir, "state"))
    accelerator.save_model(model, os.path.join(args.output_dir, "model"))
    sharding = sorted({type(p.placements[0]).__name__ for p in model.parameters() if hasattr(p, "placements")})
    if accelerator.is_main_process:
        summary = {
            "distributed_type": str(accelerator.distributed_type),
            "num_processes": accelerator.num_processes,
            "parameter_placements": sharding or ["unsharded"],
            "losses": losses,
            "grad_norms": grad_norms,
        }
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    accelerator.end_training()


if __name__ == "__main__":
    main()
