"""A state dict that cannot be this rank's is refused on load, naming the parameter, before
anything is written or any collective runs (before: it loaded, or failed part-way, and the
job died later in a collective)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

import vescale_plugins

pytestmark = pytest.mark.timeout(300)

WIDTHS = (16, 37, 64, 37, 8)  # at W=2 the first weight's shards are (20, 17) rows, the last bias's (0, 8)


def _mlp(mesh: object) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:])))
    for layer in model:
        vescale_plugins.fully_shard(layer, mesh=mesh)
    vescale_plugins.fully_shard(model, mesh=mesh)
    return model


def _other_ranks_state_dict(state: dict) -> dict:
    """The state dict of the other rank (of 2), moved as torchft's HTTP transport moves it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    gathered: list = [None, None]
    dist.all_gather_object(gathered, buffer.getvalue())
    return torch.load(io.BytesIO(gathered[1 - dist.get_rank()]), weights_only=False)


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.to_local().clone() for name, p in model.named_parameters()}


def _refusals(how: str) -> dict:
    mesh = init_device_mesh("cpu", (2,))
    model = _mlp(mesh)
    if how == "another rank's":
        state = _other_ranks_state_dict(model.state_dict())
    else:  # an HSDP model's (mesh 1 x 2) into a flat one's
        hsdp = _mlp(init_device_mesh("cpu", (1, 2), mesh_dim_names=("replica_r", "shard_r")))
        state = get_model_state_dict(hsdp)
    before = _locals(model)
    errors = []
    for load in (model.load_state_dict, lambda s: set_model_state_dict(model, s)):
        try:
            load(state)
        except RuntimeError as error:
            errors.append(str(error))
    unchanged = all(torch.equal(value, _locals(model)[name]) for name, value in before.items())
    model(torch.randn(2, WIDTHS[0])).sum().backward()  # the group still works: a gather and a reduce
    return {"errors": errors, "unchanged": unchanged}


def test_another_ranks_shards_are_refused_before_anything_is_written(dist_run):
    for result in dist_run(_refusals, 2, "another rank's"):
        assert len(result["errors"]) == 2, result["errors"]  # module load_state_dict and DCP's
        for error in result["errors"]:
            assert "'0.weight' holds a local shard of shape" in error, error
            assert "taken on another rank" in error
            assert "nothing was loaded" in error
        assert result["unchanged"]


def test_a_state_dict_of_another_mesh_is_refused(dist_run):
    for result in dist_run(_refusals, 2, "another mesh's"):
        assert len(result["errors"]) == 2, result["errors"]
        for error in result["errors"]:
            assert "'0.weight' is sharded over a mesh of shape (1, 2), the parameter over (2,)" in error, error
        assert result["unchanged"]
