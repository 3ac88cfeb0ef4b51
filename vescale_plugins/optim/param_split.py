"""The usual Muon/AdamW split of a model's parameters, in one call.

Muon is for the hidden layers' matrices. The embedding, the output head (a Linear named
like one, or tied to an embedding), norms, biases and every other non-2-D tensor go to AdamW.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

__all__ = ["split_muon_params", "muon_param_groups", "OUTPUT_HEAD_NAMES"]

# Module names (the last part of the qualified name) of output heads in common models.
OUTPUT_HEAD_NAMES = frozenset({"lm_head", "head", "output", "output_layer", "classifier", "score"})


def split_muon_params(
    model: nn.Module, exclude: Callable[[str, nn.Parameter], bool] | None = None
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """``(muon, adamw)``: the ``(name, parameter)`` pairs of each, in module order.

    Muon gets 2-D parameters except embeddings, output heads (see ``OUTPUT_HEAD_NAMES``) and
    those ``exclude(name, param)`` returns True for; AdamW gets the rest. Tied parameters
    appear once, under the first name ``named_parameters()`` gives them.
    """
    not_hidden: set[int] = set()
    for module_name, module in model.named_modules():
        last = module_name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) or (isinstance(module, nn.Linear) and last in OUTPUT_HEAD_NAMES):
            not_hidden.update(id(p) for p in module.parameters(recurse=False))
    muon: list[tuple[str, nn.Parameter]] = []
    adamw: list[tuple[str, nn.Parameter]] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        hidden_matrix = p.ndim == 2 and id(p) not in not_hidden and not (exclude and exclude(name, p))
        (muon if hidden_matrix else adamw).append((name, p))
    return muon, adamw


def muon_param_groups(
    model: nn.Module,
    *,
    adamw_lr: float = 3e-4,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float = 0.01,
    exclude: Callable[[str, nn.Parameter], bool] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for one :class:`~vescale_plugins.optim.Muon`: hidden matrices under Muon
    (the optimizer's own hyperparameters), everything else under AdamW with these ones.

    >>> optimizer = Muon(muon_param_groups(model, adamw_lr=3e-4), lr=0.02, momentum=0.95)
    """
    muon, adamw = split_muon_params(model, exclude)
    groups: list[dict[str, Any]] = []
    if muon:
        groups.append({"params": [p for _, p in muon]})
    if adamw:
        groups.append(
            {
                "params": [p for _, p in adamw],
                "algorithm": "adamw",
                "lr": adamw_lr,
                "betas": adamw_betas,
                "eps": adamw_eps,
                "weight_decay": adamw_weight_decay,
            }
        )
    return groups
