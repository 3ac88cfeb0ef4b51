"""torch.optim's closure convention, shared by our optimizers' ``step``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["evaluate_closure"]


def evaluate_closure(closure: Callable[[], Any] | None) -> Any:
    """The loss ``closure`` returns, evaluated with gradients enabled (``step`` runs under
    ``torch.no_grad``); None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
