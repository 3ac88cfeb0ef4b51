"""A unit whose backward never runs (a frozen embedding under LoRA: no output needs a gradient)
is prefetched in backward like any unit; FSDP2's final callback reshards it, so nothing of it
stays gathered through ``backward()`` and the optimizer step. Compared with FSDP2 in the same
test: the bytes of its gathered parameters after each.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed import fsdp

import vescale_plugins

T = 120


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, 64)  # 128 KiB, frozen
        self.block = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, tokens):
        return self.head(torch.relu(self.block(self.embed(tokens))))


def _gathered_bytes(impl: str, unit: nn.Module) -> int:
    """Bytes of ``unit``'s parameters currently gathered (its own unit only)."""
    if impl == "vescale":
        return sum(
            d.layout.buffer_size * d.sharded.element_size() for d in unit._vescale_fsdp_unit.dbuffers if d.is_unsharded
        )
    (group,) = unit._get_fsdp_state()._fsdp_param_groups
    return sum(p._unsharded_param.untyped_storage().size() for p in group.fsdp_params if hasattr(p, "_unsharded_param"))


def _frozen_unit_after_backward_and_step() -> dict[str, list[int]]:
    found = {}
    for impl, shard in (("torch", fsdp.fully_shard), ("vescale", vescale_plugins.fully_shard)):
        torch.manual_seed(0)
        model = _Model()
        model.embed.weight.requires_grad_(False)
        shard(model.embed)
        shard(model.block)
        shard(model)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        seen = []
        for _ in range(2):
            model(torch.randint(0, 512, (4, 16))).sum().backward()
            seen.append(_gathered_bytes(impl, model.embed))
            optimizer.step()
            optimizer.zero_grad()
            seen.append(_gathered_bytes(impl, model.embed))
        found[impl] = seen
    return found


def test_frozen_unit_is_resharded_at_the_end_of_backward_as_fsdp2(dist_run):
    found = dist_run(_frozen_unit_after_backward_and_step, 2, timeout=T)[0]
    assert found["torch"] == [0, 0, 0, 0]
    assert found["vescale"] == found["torch"]
