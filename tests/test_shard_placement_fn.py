"""FSDP2's ``shard_placement_fn`` answered with another dim than 0 (torchtitan asks
``Shard(1)`` for experts with fewer rows than ranks): accepted, trained exactly as FSDP2
trains it, with one warning; checkpoints move between the two; bad answers refused."""

import importlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard

from vescale_plugins import RaggedShard, fully_shard

STEPS = 5
# The module, not the function the package exports under the same name.
fully_shard_module = importlib.import_module("vescale_plugins.fully_shard")


class Experts(nn.Module):
    """Two experts of (12, 5) and an output layer: dim 0 (2) has fewer rows than 3 ranks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = nn.Parameter(torch.randn(2, 12, 5) / 4)
        self.out = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.einsum("bd,edh->bh", x, self.experts).relu())


def _experts_on_dim_1(param: nn.Parameter):
    return Shard(1) if param.ndim == 3 else None  # torchtitan's answer for such experts


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 12, generator=gen)


def _train(model: nn.Module) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    losses = []
    for step in range(STEPS):
        loss = model(_batch(step)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach() for name, p in model.named_parameters()}


def _parity_and_checkpoint(path: str) -> None:
    fully_shard_module._SHARD_DIM_WARNED.clear()  # pooled workers: an earlier test may have warned
    theirs = torch_fully_shard(Experts(), shard_placement_fn=_experts_on_dim_1)
    assert theirs.experts.placements == (Shard(1),)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = fully_shard(Experts(), shard_placement_fn=_experts_on_dim_1)
        fully_shard(Experts(), shard_placement_fn=_experts_on_dim_1)  # warned once per process
    ours_warned = [w for w in caught if "shard_placement_fn" in str(w.message)]
    messages = [str(w.message) for w in ours_warned]
    assert len(messages) == 1 and "'experts' (Shard(dim=1))" in messages[0] and "RaggedShard" in messages[0], messages
    assert ours_warned[0].filename == __file__  # it points at the fully_shard call
    assert isinstance(ours.experts.placements[0], RaggedShard)

    assert _train(ours) == pytest.approx(_train(theirs), rel=1e-6)
    for name, param in _full(theirs).items():
        torch.testing.assert_close(_full(ours)[name], param, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

    # FSDP2's Shard(1) checkpoint loads into ours (and the other way round), exactly.
    dcp.save(get_model_state_dict(theirs), checkpoint_id=path + "/theirs")
    fresh = fully_shard(Experts(), shard_placement_fn=_experts_on_dim_1)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=path + "/theirs")
    set_model_state_dict(fresh, state)
    for name, param in _full(theirs).items():
        assert torch.equal(_full(fresh)[name], param), name
    dcp.save(get_model_state_dict(ours), checkpoint_id=path + "/ours")
    back = torch_fully_shard(Experts(), shard_placement_fn=_experts_on_dim_1)
    state = get_model_state_dict(back)
    dcp.load(state, checkpoint_id=path + "/ours")
    set_model_state_dict(back, state)
    for name, param in _full(ours).items():
        assert torch.equal(_full(back)[name], param), name


def test_shard_dim_1_trains_as_fsdp2_and_checkpoints_cross_load(dist_run, tmp_path):
    dist_run(_parity_and_checkpoint, 3, str(tmp_path))


def _bad_answers() -> None:
    model = Experts()
    with pytest.raises(ValueError, match=r"shard_placement_fn returned Shard\(dim=3\) for 'experts': Shard dim 3 is invalid for 3D tensor: \(2, 12, 5\)"):
        fully_shard(model, shard_placement_fn=lambda p: Shard(3) if p.ndim == 3 else None)
    with pytest.raises(ValueError, match=r"Invalid shard_placement_fn result for 'out.weight': Replicate\(\)"):
        fully_shard(model, shard_placement_fn=lambda p: Replicate() if p.ndim == 2 else None)
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    other = init_device_mesh("cpu", (1, dist.get_world_size()))
    result = ShardPlacementResult(Shard(0), FSDPMeshInfo(other, shard_mesh_dim=1))
    with pytest.raises(NotImplementedError, match=r"ShardPlacementResult on mesh .* for 'experts'"):
        fully_shard(model, shard_placement_fn=lambda p: result if p.ndim == 3 else None)
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_bad_answers_are_refused_before_the_module_changes(dist_run):
    dist_run(_bad_answers, 2)
