"""A module of unevenly shaped parameters and the gradients each step gives them (optimizer tests)."""

from __future__ import annotations

import torch
import torch.nn as nn

# Uneven on purpose: rows and columns that 32 does not divide, a 3-D tensor, 1-D tensors
# shorter and longer than one 1024-element block, a scalar, and a weight with one tile row
# (fewer tile rows than ranks).
SHAPES = {
    "a": (1031, 40),
    "b": (40, 70),
    "c": (70,),
    "d": (2500,),
    "e": (20, 16),
    "f": (),
    "g": (3, 5, 40),
    "h": (97, 33),
}
# AdamW8bit's per-parameter state besides ``step``.
ADAM8BIT_STATE_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")


class UnevenParams(nn.Module):
    """Every parameter gets gradient ``coeff + 0.02 * p`` (depends on p, so steps differ)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=gen)))

    def forward(self, coeffs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((p * coeffs[n]).sum() + 0.01 * p.square().sum() for n, p in self.named_parameters())


def coefficients(step: int) -> dict[str, torch.Tensor]:
    """The ``coeff`` of each parameter at ``step``: one order of magnitude smaller per step."""
    gen = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(shape, generator=gen) * 10.0**-step for name, shape in SHAPES.items()}
