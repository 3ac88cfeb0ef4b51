"""Property: every state dict we hand out survives what torchft and users do with it.

Over random units (a stack of ``nn.Linear`` of random widths 1-40, so at world sizes 1-5
layouts are uneven and some ranks hold empty shards; fp32 or bf16 parameters), each rank
takes the model's and AdamW's state dicts both ways (the modules' ``state_dict()``, and DCP's
``get_model_state_dict`` / ``get_optimizer_state_dict``), moves them as torchft's HTTP
transport does (``torch.save`` then ``torch.load``) and as users copy them
(``copy.deepcopy``), and loads them into a freshly built model and optimizer
(``load_state_dict``, and DCP's ``set_model_state_dict`` / ``set_optimizer_state_dict``):
every parameter and optimizer state comes back with its global shape, placements and this
rank's shard bit for bit. Hypothesis draws the layouts in the test process; each example
runs on a pooled gloo world of its size.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import vescale_plugins

pytestmark = pytest.mark.timeout(600)

EXAMPLES_PER_WORLD = 5


def _build(widths: list[int], dtype: torch.dtype, world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))).to(dtype)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        vescale_plugins.fully_shard(layer, mesh=mesh)
    vescale_plugins.fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, widths: list[int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    model(torch.randn(3, widths[0], generator=g).to(dtype)).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        out[name] = (tuple(p.shape), tuple(p.placements), p.to_local().detach().clone())
        for key, value in optimizer.state[p].items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"{name}.{key}"] = local.detach().clone()
    return out


def _round_trip_body(widths: list[int], dtype_name: str) -> list[str]:
    """On each rank: the state dicts both ways, moved both ways, loaded both ways; returns
    the entries that did not come back exactly (empty when all did)."""
    world, dtype = torch.distributed.get_world_size(), getattr(torch, dtype_name)
    model, optimizer = _build(widths, dtype, world, seed=0)
    _train(model, optimizer, widths, dtype)
    expected = _local_state(model, optimizer)
    sources = {
        "module": lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        "dcp": lambda: {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
    }
    moves = {"torch.save": _saved_and_loaded, "deepcopy": copy.deepcopy}
    bad = []
    for (source, take), (move, moved) in ((s, m) for s in sources.items() for m in moves.items()):
        state = moved(take())
        fresh, fresh_optimizer = _build(widths, dtype, world, seed=1)
        _train(fresh, fresh_optimizer, widths, dtype)  # its own states, to be overwritten
        if source == "module":
            fresh.load_state_dict(state["model"])
            fresh_optimizer.load_state_dict(state["optim"])
        else:
            set_model_state_dict(fresh, state["model"])
            set_optimizer_state_dict(fresh, fresh_optimizer, state["optim"])
        got = _local_state(fresh, fresh_optimizer)
        for key, value in expected.items():
            if not _same(value, got.get(key)):
                bad.append(f"{source} via {move}: {key}")
    return bad


def _saved_and_loaded(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple):
        return isinstance(b, tuple) and a[:2] == b[:2] and _same(a[2], b[2])
    return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@settings(
    max_examples=EXAMPLES_PER_WORLD,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    widths=st.lists(st.integers(1, 40), min_size=2, max_size=5),
    dtype_name=st.sampled_from(["float32", "bfloat16"]),
)
def test_state_dicts_round_trip_exactly(dist_run, world, widths, dtype_name):
    for bad in dist_run(_round_trip_body, world, widths, dtype_name):
        assert bad == []
