"""One case of the torchft healing matrix (:mod:`.test_heal_matrix`): what a replica group
trains and how it is wired, passed to each rank process as JSON in ``FT_CASE``."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.fault_tolerance.heal import train_step
from tests.support.models import make_decoder

MLP_WIDTHS = (16, 37, 64, 37, 8)  # uneven at W=2: the last weight's rows (4, 4), its bias's (0, 8)
CRASH_EXIT = 17


@dataclass(frozen=True)
class Case:
    """``model``: ``decoder`` (4 blocks) or ``mlp``; ``state``: ``module`` (``model.state_dict()``
    and ``optimizer.state_dict()``) or ``dcp`` (``get_model_state_dict`` /
    ``get_optimizer_state_dict``, loaded by ``set_*``); ``hook``: the manager's all-reduce in
    ``set_all_reduce_hook``; ``hsdp``: each group's mesh 1 x 2; ``fail``: replica 1 dies between
    two steps (``boundary``) or inside the backward (``midstep``)."""

    model: str = "decoder"
    state: str = "module"
    hook: bool = True
    hsdp: bool = False
    fail: str = "boundary"

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_env() -> Case:
        return Case(**json.loads(os.environ.get("FT_CASE", "{}")))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(MLP_WIDTHS, MLP_WIDTHS[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.tanh(x) if i < len(self.layers) - 1 else x
        return x


def build_model(name: str, seed: int) -> nn.Module:
    if name == "mlp":
        torch.manual_seed(seed)
        return MLP()
    return make_decoder(seed=seed, layers=4)


def die_together() -> None:
    """Both ranks of the group exit here (neither is left waiting on a peer gone first: that
    one would fail its next call with another exit code)."""
    dist.barrier()
    os._exit(CRASH_EXIT)


def _die_at_its_gradient(output: torch.Tensor) -> None:
    output.register_hook(lambda _grad: die_together())


def case_step(
    name: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, shard_rank: int, die_in_backward: bool
) -> float:
    """One training step of this rank (both replicas see the same data); with
    ``die_in_backward`` the process exits inside the backward (the gradient of the first
    layer's output: the later units' reduce-scatters were issued, the first unit's not)."""
    if die_in_backward:
        model.layers[0].register_forward_hook(lambda _m, _i, out: _die_at_its_gradient(out))
    if name != "mlp":
        return train_step(model, optimizer, step, shard_rank)
    g = torch.Generator().manual_seed(2000 + step)
    inputs, targets = torch.randn(4, MLP_WIDTHS[0], generator=g), torch.randn(4, MLP_WIDTHS[-1], generator=g)
    rows = slice(2 * shard_rank, 2 * shard_rank + 2)
    loss = nn.functional.mse_loss(model(inputs[rows]), targets[rows])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()
