"""Which unit each backward gathers ahead, compared with FSDP2 in the same test.

FSDP2 orders its backward prefetch by the post-forward order, so the root (whose forward
ends last) gathers the last block during the head's backward; a block gathered only at its
own pre-backward is an exposed all-gather. Logged for both implementations: each real
gather (not a no-op) and each unit's pre-backward, by module name.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn as nn
from torch.distributed import fsdp
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup as TorchParamGroup

import vescale_plugins
from vescale_plugins.runtime.param_group import FSDPParamGroup

T = 120


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 32)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h)


def _backward_log(unshard_embedding_in_backward: bool = True) -> dict[str, list]:
    found = {}
    for impl, shard, group_class, pre_backward in (
        ("torch", fsdp.fully_shard, TorchParamGroup, "pre_backward"),
        ("vescale", vescale_plugins.fully_shard, FSDPParamGroup, "_pre_backward_hook"),
    ):
        torch.manual_seed(0)
        model = _Model()
        shard(model.embed)
        for block in model.blocks:
            shard(block)
        shard(model)
        model.embed.set_unshard_in_backward(unshard_embedding_in_backward)
        names = {id(m): n or "<root>" for n, m in model.named_modules()}
        log: list[tuple[str, str]] = []
        in_backward = [False]
        original_unshard, original_pre_backward = group_class.unshard, getattr(group_class, pre_backward)

        def gathered(group) -> bool:
            pending = getattr(group, "_all_gather_result", None) or getattr(group, "has_pending_unshard", None)
            return bool(group.is_unsharded or pending)

        def unshard(group, *args, log=log, original=original_unshard, **kwargs):
            before = gathered(group)
            result = original(group, *args, **kwargs)
            if in_backward[0] and not before and gathered(group):
                log.append(("gather", names[id(group.modules[0])]))
            return result

        def logged_pre_backward(group, *args, log=log, original=original_pre_backward, **kwargs):
            log.append(("pre_backward", names[id(group.modules[0])]))
            return original(group, *args, **kwargs)

        with (
            mock.patch.object(group_class, "unshard", unshard),
            mock.patch.object(group_class, pre_backward, logged_pre_backward),
        ):
            loss = model(torch.randint(0, 32, (2, 8))).sum()
            in_backward[0] = True
            loss.backward()
        found[impl] = [entry for entry in log if entry[1] != "<root>"]
        found[f"{impl} embedding gradient"] = model.embed.weight.grad.full_tensor()
    return found


def test_backward_gathers_the_last_block_during_the_roots_backward_as_fsdp2(dist_run):
    found = dist_run(_backward_log, 2, timeout=T)[0]
    last_block = ("gather", "blocks.2")
    assert found["torch"].index(last_block) < found["torch"].index(("pre_backward", "blocks.2"))
    assert found["vescale"] == found["torch"]
    torch.testing.assert_close(found["vescale embedding gradient"], found["torch embedding gradient"])


def test_set_unshard_in_backward_false_skips_the_gather_as_fsdp2(dist_run):
    """An embedding's backward reads no weight: FSDP2 then neither prefetches nor gathers it."""
    found = dist_run(_backward_log, 2, False, timeout=T)[0]
    assert ("gather", "embed") not in found["torch"]
    assert ("pre_backward", "embed") in found["torch"]
    assert found["vescale"] == found["torch"]
    torch.testing.assert_close(found["vescale embedding gradient"], found["torch embedding gradient"])


def _head_unit_log() -> list[tuple[str, str]]:
    """A root without parameters over a head unit (torchtitan's layout): each real gather in
    backward and each unit's first gradient, by module name."""
    torch.manual_seed(0)
    model = _Model()
    vescale_plugins.fully_shard(model.embed)
    for block in model.blocks:
        vescale_plugins.fully_shard(block)
    vescale_plugins.fully_shard(model.head)
    vescale_plugins.fully_shard(model)
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    log: list[tuple[str, str]] = []
    in_backward = [False]
    original_unshard, original_after_gradient = FSDPParamGroup.unshard, FSDPParamGroup._after_gradient

    def unshard(group, *args, **kwargs):
        before = group.is_unsharded or group.has_pending_unshard
        result = original_unshard(group, *args, **kwargs)
        if in_backward[0] and not before and (group.is_unsharded or group.has_pending_unshard):
            log.append(("gather", names[id(group.modules[0])]))
        return result

    def after_gradient(group, *args, **kwargs):
        if ("gradient", names[id(group.modules[0])]) not in log:
            log.append(("gradient", names[id(group.modules[0])]))
        return original_after_gradient(group, *args, **kwargs)

    with (
        mock.patch.object(FSDPParamGroup, "unshard", unshard),
        mock.patch.object(FSDPParamGroup, "_after_gradient", after_gradient),
    ):
        loss = model(torch.randint(0, 32, (2, 8))).sum()
        in_backward[0] = True
        loss.backward()
    return log


def test_root_without_parameters_leaves_the_last_block_to_the_heads_first_gradient(dist_run):
    """The root's pre-backward runs with the head's, on the logits' gradient; the last block
    is gathered at the head's first gradient (after the backward ops that free the logits'
    gradient), not there, so it does not add to the head's backward peak."""
    log = dist_run(_head_unit_log, 2, timeout=T)[0]
    assert log.index(("gradient", "head")) < log.index(("gather", "blocks.2"))
    assert [entry for entry in log if entry[0] == "gather"] == [
        ("gather", name) for name in ("head", "blocks.2", "blocks.1", "blocks.0", "embed")
    ]
