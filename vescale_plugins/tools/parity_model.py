"""The decoder parity checks train (the test suite's and ``vescale_plugins.tools.gpu_check``'s).

A small decoder whose dims divide nothing evenly (hidden 36, 3 heads, MLP 97, vocab 101) with
its embedding tied to the output head; the batches of a step (the same on every rank, each
rank training on its own rows) and the unsharded reference step sharded training must match.
"""

from __future__ import annotations

import copy
from typing import cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, MLP, LAYERS, SEQ = 101, 36, 3, 97, 3, 11


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No bias: the key bias has an exactly-zero gradient (softmax is shift invariant),
        # which Adam would turn rounding noise into full-size updates on.
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, HIDDEN // HEADS).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, HIDDEN))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.mlp_norm = nn.RMSNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, MLP)
        self.down = nn.Linear(MLP, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))

    def reset_parameters(self) -> None:
        for m in self.modules():
            reset = getattr(m, "reset_parameters", None)
            if m is not self and callable(reset):
                reset()


class Decoder(nn.Module):
    """Token embedding tied to the output head, ``LAYERS`` blocks, a final norm, a buffer."""

    position_scale: torch.Tensor

    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("position_scale", torch.linspace(0.5, 1.5, SEQ).view(1, SEQ, 1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) * self.position_scale[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def reset_parameters(self) -> None:
        self.embed.reset_parameters()
        for layer in self.layers:
            cast(Block, layer).reset_parameters()
        self.norm.reset_parameters()
        with torch.no_grad():
            self.position_scale.copy_(torch.linspace(0.5, 1.5, SEQ).view(1, SEQ, 1))


def batch(step: int, world: int, per_rank: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (identical on every rank): tokens and next-token targets."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (world * per_rank, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def local_batch(step: int, per_rank: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's batch (CPU tensors)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    tokens, targets = batch(step, world, per_rank)
    return tokens[rank * per_rank : (rank + 1) * per_rank], targets[rank * per_rank : (rank + 1) * per_rank]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def reference_step(model: nn.Module, step: int, world: int, per_rank: int = 2) -> torch.Tensor:
    """DDP's gradient on one process: each rank's backward, summed in rank order, averaged.

    Per-rank backward passes compute bit-for-bit what each sharded rank computes; only the
    order of the W-term sum can differ from the reduce-scatter's.
    """
    device = next(model.parameters()).device
    tokens, targets = batch(step, world, per_rank)
    grads: dict[nn.Parameter, torch.Tensor] = {}
    losses = []
    for r in range(world):
        rows = slice(r * per_rank, (r + 1) * per_rank)
        loss = loss_fn(model(tokens[rows].to(device)), targets[rows].to(device))
        params = [p for p in model.parameters() if p.requires_grad]
        for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
            if g is not None:
                grads[p] = grads[p] + g if p in grads else g
        losses.append(loss.detach())
    for p, g in grads.items():
        p.grad = g / world if p.grad is None else p.grad + g / world
    return torch.stack(losses).sum() / world


def make_decoder(seed: int = 0, layers: int = LAYERS) -> Decoder:
    """A decoder initialised from ``seed`` (the same on every rank)."""
    torch.manual_seed(seed)
    return Decoder(layers)


def clone(model: nn.Module) -> nn.Module:
    """An independent copy (the unsharded reference and each engine start from the same weights)."""
    return copy.deepcopy(model)
