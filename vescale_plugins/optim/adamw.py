"""``AdamW``: torch's AdamW math, one fused kernel per contiguous run of parameters.

State entries are torch.optim.AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints
interchange with it; underneath they are views of one flat buffer per run (see
:mod:`.flat_state`), and the step calls ``torch._fused_adamw_`` once per run on the flat
parameter, gradient and state buffers instead of once per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from vescale_plugins.optim.flat import Run
from vescale_plugins.optim.flat_state import FlatStateOptimizer, StateSpec
from vescale_plugins.optim.kernels.adam8bit_torch import step_tensor
from vescale_plugins.optim.sharding import wrap_like

__all__ = ["AdamW"]


class AdamW(FlatStateOptimizer):
    """AdamW (decoupled weight decay) stepped flat; arguments as ``torch.optim.AdamW``.

    ``amsgrad``, ``maximize``, ``capturable`` and ``differentiable`` are not supported (a
    ``ValueError`` says so). Results equal ``torch.optim.AdamW(fused=True)``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
    ) -> None:
        _check_hyper(type(self).__name__, lr, betas, eps, weight_decay, amsgrad)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def state_specs(self, group: dict[str, Any]) -> dict[str, StateSpec]:
        like = StateSpec(lambda t: t.dtype, None, lambda t: tuple(t.shape), wrap_like)
        return {"exp_avg": like, "exp_avg_sq": like}

    def step_run(
        self, run: Run, group: dict[str, Any], flats: dict[str, torch.Tensor], offsets: dict[str, list[int]], step: int
    ) -> None:
        for start, end in run.gaps:
            # Padding between parameters: its gradient is not the parameters' (maybe garbage).
            run.grad_flat[start:end].zero_()
        beta1, beta2 = group["betas"]
        step_t = step_tensor(step, run.param_flat.device)
        torch._fused_adamw_(
            [run.param_flat],
            [run.grad_flat],
            [flats["exp_avg"]],
            [flats["exp_avg_sq"]],
            [],
            [step_t],
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=False,
            maximize=False,
            grad_scale=None,
            found_inf=None,
        )


def _check_hyper(
    who: str, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, amsgrad: bool
) -> None:
    if amsgrad:
        raise ValueError(f"{who}(amsgrad=True) is not supported: use torch.optim.AdamW(amsgrad=True)")
    if not 0.0 <= float(lr):
        raise ValueError(f"{who}: invalid learning rate {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"{who}: invalid eps {eps}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"{who}: invalid betas {betas}; each must be in [0, 1)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{who}: invalid weight_decay {weight_decay}")
