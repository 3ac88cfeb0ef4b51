"""The Newton–Schulz orthogonalisation of ``torch.optim.Muon`` (torch 2.13), op for op.

The same ops in the same order as torch's ``_zeropower_via_newtonschulz``, so a matrix
orthogonalised here on its root rank equals what ``torch.optim.Muon`` computes unsharded,
bit for bit on CPU. On CUDA the iteration is compiled with ``torch.compile`` (fused
elementwise work around the matmuls); elsewhere it runs eagerly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["zeropower_via_newtonschulz", "newton_schulz_for"]


def zeropower_via_newtonschulz(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """Orthogonalise the 2-D ``grad`` (computed in bfloat16; returns a bfloat16 matrix).

    A bfloat16 ``grad`` is normalised in place (it is the caller's scratch buffer).
    """
    if ns_steps >= 100:
        raise ValueError("Number of steps must be less than 100 for computational efficiency")
    if grad.dim() != 2:
        raise ValueError("Input tensor gradient must be a 2D matrix")
    if len(ns_coefficients) != 3:
        raise ValueError("Coefficients must be a tuple of exactly 3 values")
    a, b, c = ns_coefficients
    ortho_grad = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        ortho_grad = ortho_grad.T
    # Spectral norm at most 1 (the Frobenius norm bounds it).
    ortho_grad.div_(ortho_grad.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram_matrix = ortho_grad @ ortho_grad.T
        gram_update = torch.addmm(gram_matrix, gram_matrix, gram_matrix, beta=b, alpha=c)
        ortho_grad = torch.addmm(ortho_grad, gram_update, ortho_grad, beta=a)
    if tall:
        ortho_grad = ortho_grad.T
    return ortho_grad


@functools.cache
def _compiled() -> Callable[..., torch.Tensor]:
    return torch.compile(zeropower_via_newtonschulz, dynamic=True)


def newton_schulz_for(device: torch.device) -> Callable[..., torch.Tensor]:
    """The Newton–Schulz function to run on ``device``: compiled on CUDA, eager elsewhere."""
    return _compiled() if device.type == "cuda" else zeropower_via_newtonschulz
