"""FSDP2's ``shard_placement_fn``: another dim than 0 (torchtitan asks ``Shard(1)`` for
experts with fewer rows than ranks) is accepted, trained exactly as FSDP2 trains it, with one
warning, and checkpoints move between the two; a ``ShardPlacementResult`` naming another mesh
(torchtitan's experts over the expert-data-parallel mesh) gets DBuffers on that mesh, and its
checkpoints resume exactly; bad answers are refused before the module changes."""

import importlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard

from vescale_plugins import RaggedShard, fully_shard
from vescale_plugins.observe.record import record_run

STEPS = 5
# The module, not the function the package exports under the same name.
fully_shard_module = importlib.import_module("vescale_plugins.runtime.setup")


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
    assert len(messages) == 1, messages
    assert "'experts' (Shard(dim=1))" in messages[0], messages
    assert "RaggedShard" in messages[0], messages
    assert ours_warned[0].filename == __file__  # it points at the fully_shard call
    assert isinstance(ours.experts.placements[0], RaggedShard)

    assert _train(ours) == pytest.approx(_train(theirs), rel=1e-6)
    for name, param in _full(theirs).items():
        torch.testing.assert_close(_full(ours)[name], param, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")

    # FSDP2's Shard(1) checkpoint loads into ours (and the other way round), exactly.
    for saved, loader in ((theirs, fully_shard), (ours, torch_fully_shard)):
        checkpoint = f"{path}/{'ours' if saved is ours else 'theirs'}"
        dcp.save(get_model_state_dict(saved), checkpoint_id=checkpoint)
        fresh = loader(Experts(), shard_placement_fn=_experts_on_dim_1)
        state = get_model_state_dict(fresh)
        dcp.load(state, checkpoint_id=checkpoint)
        set_model_state_dict(fresh, state)
        for name, param in _full(saved).items():
            assert torch.equal(_full(fresh)[name], param), name


def test_shard_dim_1_trains_as_fsdp2_and_checkpoints_cross_load(dist_run, tmp_path):
    dist_run(_parity_and_checkpoint, 3, str(tmp_path))


def _bad_answers() -> None:
    model = Experts()
    with pytest.raises(
        ValueError,
        match=r"Shard dim 3 is invalid for 3D tensor: torch.Size\(\[2, 12, 5\]\) \(shard_placement_fn returned Shard\(dim=3\) for 'experts'\)",
    ):
        fully_shard(model, shard_placement_fn=lambda p: Shard(3) if p.ndim == 3 else None)
    with pytest.raises(ValueError, match=r"Invalid shard_placement_fn result: R \(Replicate\(\) for 'out.weight'\)"):
        fully_shard(model, shard_placement_fn=lambda p: Replicate() if p.ndim == 2 else None)
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

    other = init_device_mesh("cpu", (1, dist.get_world_size()))
    result = ShardPlacementResult(Shard(0), FSDPMeshInfo(other, shard_mesh_dim=1))
    with pytest.raises(
        NotImplementedError,
        match=r"shard_placement_fn put 'experts' on FSDPMeshInfo\(mesh=.*shard_mesh_dim=1, replicate_mesh_dim=None\): veScale-FSDP shards over a 1-D mesh",
    ):
        fully_shard(model, shard_placement_fn=lambda p: result if p.ndim == 3 else None)
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())


def test_bad_answers_are_refused_before_the_module_changes(dist_run):
    dist_run(_bad_answers, 2)


def _ep_model(seed: int, num_experts: int = 4, shard=fully_shard):
    """torch's toy MoE Transformer with EP=2 on 4 ranks, its experts sharded over the
    efsdp mesh by ``ShardPlacementResult`` and the rest over the 4-rank dp mesh."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    efsdp_info, dp_info = FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0), FSDPMeshInfo(dp_mesh, shard_mesh_dim=0)
    torch.manual_seed(seed)
    model = Transformer(
        ModelArgs(n_layers=2, vocab_size=64, max_seq_len=16, dim=32, n_heads=4, dropout_p=0.0, num_experts=num_experts)
    )
    Transformer.parallelize(model, tp_mesh=None, use_seq_parallel=False, ep_mesh=sparse["ep"])
    for block in model.layers:
        experts = set(block.expert_layer.experts.parameters())
        shard(
            block,
            mesh=dp_mesh,
            shard_placement_fn=lambda p, e=experts: ShardPlacementResult(Shard(0), efsdp_info if p in e else dp_info),
        )
    shard(model, mesh=dp_mesh)
    return model


def _ep_step(model, opt, step: int) -> torch.Tensor:
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
    loss = model(tokens).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _parameter_meshes_checkpoint(path: str) -> None:
    model = _ep_model(0)
    unit = model.layers[0]._vescale_fsdp_unit
    assert sorted(b.mesh.shard_size for b in unit.buffers) == [2, 4]  # experts over efsdp, the rest over dp
    with pytest.raises(NotImplementedError, match=r"reshard_after_forward=2 with parameters on their own mesh"):
        model.layers[0].set_reshard_after_forward(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with record_run(model, opt) as record:
        for step in range(2):
            _ep_step(model, opt, step)
            record.mark_step()
    block = next(u for u in record.to_dict()["sharding"]["units"] if u["modules"] == ["layers.0"])
    assert sorted(block["buffer_group_sizes"]) == [2, 4]
    assert "over groups of" in record.summary()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    restored = _ep_model(1)
    restored_opt = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    state = {"model": get_model_state_dict(restored), "optim": get_optimizer_state_dict(restored, restored_opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(restored, state["model"])
    set_optimizer_state_dict(restored, restored_opt, state["optim"])
    for step in (2, 3):
        assert torch.equal(_ep_step(restored, restored_opt, step), _ep_step(model, opt, step))
    for name, param in _full(model).items():
        assert torch.equal(_full(restored)[name], param), name


def test_parameters_on_their_own_mesh_checkpoint_and_resume_exactly(dist_run, tmp_path):
    # Training parity with FSDP2 and an unsharded reference: tests/fsdp2_compat (test_shard_placement_fn_ep).
    dist_run(_parameter_meshes_checkpoint, 4, str(tmp_path))


def _uneven_experts() -> None:
    # 5 experts over ep=2: the two EP ranks of one efsdp group hold 3 and 2 experts, so their
    # local shapes differ across the unit's dp group, which must not read as a rank-dependent plan.
    losses = []
    for shard in (torch_fully_shard, fully_shard):
        model = _ep_model(0, num_experts=5, shard=shard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses.append([_ep_step(model, opt, step).item() for step in range(3)])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5), losses


def test_experts_split_unevenly_by_expert_parallelism_train_as_fsdp2(dist_run):
    dist_run(_uneven_experts, 4)


def _meta_then_materialise() -> None:
    """Built on the meta device, materialised with ``to_empty`` and given an eager model's
    values: the unit's buffers on both meshes come back and train as the eager-built model."""
    eager = _ep_model(0)
    with torch.device("meta"):
        meta = _ep_model(0)
    meta.to_empty(device="cpu")
    unit = meta.layers[0]._vescale_fsdp_unit
    assert sorted(b.group.size() for b in unit.dbuffers) == [2, 4]
    set_model_state_dict(meta, get_model_state_dict(eager))
    for name, param in _full(eager).items():
        assert torch.equal(_full(meta)[name], param), name
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, meta)]
    for step in range(2):
        assert torch.equal(_ep_step(meta, optimizers[1], step), _ep_step(eager, optimizers[0], step))
    for name, param in _full(eager).items():
        assert torch.equal(_full(meta)[name], param), name


def test_parameters_on_their_own_mesh_after_meta_init(dist_run):
    dist_run(_meta_then_materialise, 4)
