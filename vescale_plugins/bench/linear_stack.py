"""A stack of square Linear layers: the smallest model on which the FSDP engines differ.

``num_layers`` x (Linear(dim, dim), ReLU), each Linear one unit, trained to regress random
targets (mean squared error). Without attention, norms or an embedding, a step is little
more than the matmuls and the collectives around them, so it shows the engines' own cost
(copies, gradient buffers) at its plainest: ``python -m vescale_plugins.bench step``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LinearStack", "LinearStackConfig"]


@dataclass(frozen=True)
class LinearStackConfig:
    """Model shape: ``num_layers`` Linear layers of ``dim`` x ``dim`` (elements)."""

    num_layers: int = 8
    dim: int = 1024

    def to_dict(self) -> dict:
        return asdict(self)

    def build(self) -> LinearStack:
        return LinearStack(self)

    def batches(
        self, generator: torch.Generator, count: int, batch_size: int, seq_len: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``count`` (input, target) pairs of ``batch_size`` x ``seq_len`` x ``dim`` normal samples."""
        data = torch.randn(count, 2, batch_size, seq_len, self.dim, generator=generator)
        return [(d[0], d[1]) for d in data]

    @staticmethod
    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.float(), targets)


class LinearStack(nn.Sequential):
    """``forward(x) -> x`` through ``num_layers`` x (Linear, ReLU)."""

    def __init__(self, config: LinearStackConfig) -> None:
        blocks: list[nn.Module] = []
        for _ in range(config.num_layers):
            blocks += [nn.Linear(config.dim, config.dim), nn.ReLU()]
        super().__init__(*blocks)
        self.config = config

    def fsdp_units(self) -> list[tuple[str, list[nn.Module]]]:
        """Each Linear one unit, named by its index, in forward order (the root comes after)."""
        return [(name, [module]) for name, module in self.named_children() if isinstance(module, nn.Linear)]
