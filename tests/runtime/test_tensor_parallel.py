"""veScale-FSDP composed with tensor and expert parallelism trains what FSDP2 and an unsharded
model train: TP=2 x FSDP=2 on a small transformer (Colwise/Rowwise plans), EP=2 x FSDP=2 on an
MoE layer with uneven expert shapes; TP x FSDP checkpoints load at another FSDP size; bad
combinations are refused, naming the parameter, before any collective."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_tensor_autograd, reduce_scatter_tensor_autograd
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from tests.support.parity import PARAM_TOL, TOL, step_and_zero
from tests.support.tp_transformer import (
    HIDDEN,
    Transformer,
    assert_same,
    data_parallel,
    default_adamw,
    lm_loss,
    tensor_parallel,
    token_batch,
)
from vescale_plugins import fully_shard
from vescale_plugins.ragged.placement import RaggedShard, StridedRaggedShard

# FSDP2's dp_mesh_dims and its DataParallelMeshDims came with torch 2.13.
DataParallelMeshDims = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)
needs_dp_mesh_dims = pytest.mark.skipif(
    DataParallelMeshDims is None, reason="torch < 2.13: FSDP2 has no dp_mesh_dims (DataParallelMeshDims came in 2.13)"
)

pytestmark = pytest.mark.timeout(180)

STEPS = 5


def _assert_like_both(ours, theirs, reference, what, tol):
    """Our ``what`` ("param" or "grad") is FSDP2's and the unsharded model's, to ``tol``."""
    assert_same(ours, theirs, what, tol)
    assert_same(ours, reference, what, tol)


def _backward_both_equal(losses):
    """Backward of our loss and FSDP2's, which are equal; returns them."""
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], **TOL)
    return losses


def _assert_global_loss(loss, reference_loss, group=None):
    """The mean of every rank's ``loss`` over ``group`` is the unsharded model's loss."""
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    torch.testing.assert_close(total / dist.get_world_size(group), reference_loss.detach(), **TOL)


def _train_like_both(ours, theirs, reference, steps, backward, clip=None, grads_at_step_0=False):
    """``steps`` AdamW steps of the three models, ``backward(step)`` running each one's
    backward, clipping at ``clip``: our gradients (after the first backward, if
    ``grads_at_step_0``) and final parameters are FSDP2's and the unsharded model's."""
    opts = [default_adamw(m) for m in (reference, ours, theirs)]
    for step in range(steps):
        backward(step)
        if grads_at_step_0 and step == 0:
            _assert_like_both(ours, theirs, reference, "grad", TOL)
        if clip is not None:
            for model in (ours, theirs, reference):
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        step_and_zero(*opts)
    _assert_like_both(ours, theirs, reference, "param", PARAM_TOL)


def _mesh_2x2():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _tp_fsdp_parity():
    mesh = _mesh_2x2()
    dp_rank, dp_size = mesh.get_local_rank(0), mesh.size(0)
    reference = Transformer()
    ours = data_parallel(tensor_parallel(copy.deepcopy(reference), mesh["tp"]), fully_shard, mesh["dp"])
    theirs = data_parallel(tensor_parallel(copy.deepcopy(reference), mesh["tp"]), torch_fully_shard, mesh["dp"])
    # The composed placements: the RaggedShard cuts each rank's TP shard.
    block = ours.layers[0]
    for param, tp in [
        (block.attn.wq.weight, Shard(0)),
        (block.attn.wq.bias, Shard(0)),
        (block.w2.weight, Shard(1)),
        (block.attn.wo.bias, Replicate()),
        (block.mlp_norm.weight, Replicate()),
        (ours.embed.weight, Shard(0)),
    ]:
        assert param.device_mesh.mesh_dim_names == ("dp", "tp")
        assert param.placements[1] == tp
        expected = StridedRaggedShard if tp == Shard(0) else RaggedShard
        assert type(param.placements[0]) is expected, param.placements

    def backward(step):
        tokens, targets = token_batch(step, dp_rank)
        ours_loss, _ = _backward_both_equal([lm_loss(m, tokens, targets) for m in (ours, theirs)])
        ref_loss = sum(lm_loss(reference, *token_batch(step, d)) for d in range(dp_size)) / dp_size
        ref_loss.backward()
        _assert_global_loss(ours_loss, ref_loss, mesh.get_group("dp"))
        if step == 0:  # gradients arrive on the sharded parameters' composed layout
            assert block.w2.weight.grad.placements == block.w2.weight.placements

    _train_like_both(ours, theirs, reference, STEPS, backward, clip=0.5, grads_at_step_0=True)


def test_tp2_x_fsdp2_matches_fsdp2_and_unsharded(dist_run):
    dist_run(_tp_fsdp_parity, 4)


def _hsdp_x_tp_parity():
    """HSDP x TP on a (replicate=2, shard=1, tp=2) mesh (4 ranks): the replicas' all-reduce
    composes with the TP layout; FSDP2's HSDP x TP on the same mesh, and unsharded."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp_rank, dp_size = mesh.get_local_rank(0), mesh.size(0)
    reference = Transformer()
    ours = data_parallel(tensor_parallel(copy.deepcopy(reference), mesh["tp"]), fully_shard, mesh["replicate", "shard"])
    theirs = data_parallel(
        tensor_parallel(copy.deepcopy(reference), mesh["tp"]), torch_fully_shard, mesh["replicate", "shard"]
    )
    wq = ours.layers[0].attn.wq.weight
    assert wq.device_mesh.mesh_dim_names == ("replicate", "shard", "tp")
    assert wq.placements[0] == Replicate()
    assert type(wq.placements[1]) is StridedRaggedShard
    assert wq.placements[2] == Shard(0)

    def backward(step):
        tokens, targets = token_batch(step, dp_rank)
        _backward_both_equal([lm_loss(m, tokens, targets) for m in (ours, theirs)])
        (sum(lm_loss(reference, *token_batch(step, d)) for d in range(dp_size)) / dp_size).backward()

    _train_like_both(ours, theirs, reference, 3, backward, clip=0.5)


def test_hsdp_x_tp_matches_fsdp2_and_unsharded(dist_run):
    dist_run(_hsdp_x_tp_parity, 4)


# -- checkpoints move between FSDP sizes -----------------------------------------------------


def _train_and_save(path):
    mesh = _mesh_2x2()
    model = data_parallel(tensor_parallel(Transformer(), mesh["tp"]), fully_shard, mesh["dp"])
    opt = default_adamw(model)
    for step in range(2):
        lm_loss(model, *token_batch(step, mesh.get_local_rank(0))).backward()
        opt.step()
        opt.zero_grad()
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return {name: p.detach().full_tensor() for name, p in model.named_parameters()}, {
        f"{name}.{key}": v.full_tensor()
        for name, state in optim_state["state"].items()
        for key, v in state.items()
        if isinstance(v, DTensor)
    }


def _load_at_dp1_tp2(path):
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = data_parallel(tensor_parallel(Transformer(), mesh["tp"]), fully_shard, mesh["dp"])
    opt = default_adamw(model)
    lm_loss(model, *token_batch(0, 0)).backward()  # creates optimizer state to load into
    opt.step()
    opt.zero_grad()
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_state, optim_state = get_state_dict(model, opt)
    return {name: p.detach().full_tensor() for name, p in model.named_parameters()}, {
        f"{name}.{key}": v.full_tensor()
        for name, state in optim_state["state"].items()
        for key, v in state.items()
        if isinstance(v, DTensor)
    }


def test_tp_x_fsdp_checkpoint_loads_at_another_fsdp_size(dist_run, tmp_path):
    path = str(tmp_path / "ckpt")
    saved_params, saved_optim = dist_run(_train_and_save, 4, path)[0]
    loaded_params, loaded_optim = dist_run(_load_at_dp1_tp2, 2, path)[0]
    assert saved_params.keys() == loaded_params.keys()
    assert saved_optim.keys() == loaded_optim.keys()
    for name in saved_params:
        assert torch.equal(saved_params[name], loaded_params[name]), name
    for name in saved_optim:
        assert torch.equal(saved_optim[name], loaded_optim[name]), name
    # and in one process, as plain tensors
    plain = {name: torch.zeros_like(t) for name, t in saved_params.items()}
    dcp.load({"model": plain}, checkpoint_id=path, no_dist=True)
    for name in saved_params:
        assert torch.equal(plain[name], saved_params[name]), name


# -- expert parallelism: EP=2 x FSDP=2 on an MoE layer ---------------------------------------

EXPERTS, MOE_DIM, EXPERT_HIDDEN, IN, OUT, TOKENS = 6, 6, 5, 4, 3, 8


class GroupedExperts(nn.Module):
    """``EXPERTS`` two-layer MLPs as stacked weights; under EP each rank holds a Shard(0) of
    them and runs its own experts on every token routed to them in its EP group."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, EXPERT_HIDDEN, MOE_DIM) / MOE_DIM**0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, MOE_DIM, EXPERT_HIDDEN) / EXPERT_HIDDEN**0.5)

    def forward(self, x: torch.Tensor, expert: torch.Tensor, first: int) -> torch.Tensor:
        w1 = self.w1.to_local() if isinstance(self.w1, DTensor) else self.w1
        w2 = self.w2.to_local() if isinstance(self.w2, DTensor) else self.w2
        out = torch.zeros_like(x)
        for e in range(w1.shape[0]):
            mask = expert == first + e
            out = out.index_put((mask,), F.gelu(x[mask] @ w1[e].T) @ w2[e].T)
        return out


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, MOE_DIM)
        self.router = nn.Linear(MOE_DIM, EXPERTS, bias=False)
        self.experts = GroupedExperts()
        self.head = nn.Linear(MOE_DIM, OUT)
        self.ep_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        scores = self.router(h).softmax(-1)
        expert = scores.argmax(-1)
        gate = scores.gather(1, expert[:, None])
        routed = h * gate
        if self.ep_group is None:
            return self.head(h + self.experts(routed, expert, 0))
        # EP: gather the group's tokens, run this rank's experts, scatter the sums back
        ep_rank, ep_size = dist.get_rank(self.ep_group), dist.get_world_size(self.ep_group)
        all_routed = all_gather_tensor_autograd(routed, 0, self.ep_group)
        all_expert = all_gather_tensor_autograd(expert, 0, self.ep_group)
        out = self.experts(all_routed, all_expert, ep_rank * EXPERTS // ep_size)
        return self.head(h + reduce_scatter_tensor_autograd(out, "sum", 0, self.ep_group))


def _moe_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 * step + rank)
    return torch.randn(TOKENS, IN, generator=g), torch.randn(TOKENS, OUT, generator=g)


def _expert_parallel(model: MoEModel, ep_mesh) -> MoEModel:
    experts = model.experts
    for name in ("w1", "w2"):
        setattr(experts, name, nn.Parameter(distribute_tensor(getattr(experts, name).detach(), ep_mesh, [Shard(0)])))
    model.ep_group = ep_mesh.get_group()
    return model


def _ep_fsdp_parity():
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_mod_ep", "ep"))
    dp_shard = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    reference = MoEModel()
    models = []
    for shard in (fully_shard, torch_fully_shard):
        model = _expert_parallel(copy.deepcopy(reference), mesh["ep"])
        # torchtitan: experts over the dp-mod-ep ranks; their gradients summed over the EP
        # group's tokens too, so divided by every data-parallel rank
        experts = shard(model.experts, mesh=mesh["dp_mod_ep"])
        experts.set_gradient_divide_factor(world)
        experts.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (FSDP2's divide)
        shard(model, mesh=dp_shard)
        models.append(model)
    ours, theirs = models
    assert type(ours.experts.w1.placements[0]) is StridedRaggedShard
    assert ours.experts.w1.placements[1] == Shard(0)
    assert ours.experts.w1._local_tensor.shape[1:] == (EXPERT_HIDDEN, MOE_DIM)

    def backward(step):
        x, y = _moe_batch(step, dist.get_rank())
        ours_loss, _ = _backward_both_equal([F.mse_loss(m(x), y) for m in (ours, theirs)])
        ref_loss = (
            sum(F.mse_loss(reference(*_moe_batch(step, r)[:1]), _moe_batch(step, r)[1]) for r in range(world)) / world
        )
        ref_loss.backward()
        _assert_global_loss(ours_loss, ref_loss)

    _train_like_both(ours, theirs, reference, STEPS, backward, grads_at_step_0=True)


def test_ep2_x_fsdp2_moe_matches_fsdp2_and_unsharded(dist_run):
    dist_run(_ep_fsdp_parity, 4)


# -- dp_mesh_dims: parameters on the full SPMD mesh ------------------------------------------


def _spmd_model(mesh):
    """The transformer's TP plan on the full (dp, tp) mesh: Replicate on dp."""
    model = Transformer()
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            tp = (
                Shard(0)
                if isinstance(module, nn.Linear) and name == "weight" and module.out_features == HIDDEN
                else Replicate()
            )
            setattr(module, name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate(), tp])))
    return model


class SpmdMLP(nn.Module):
    """Two linears whose parameters live on the full (dp, tp) mesh, as FSDP2's SPMD form
    (``dp_mesh_dims``) expects: Replicate on dp; Colwise then Rowwise on tp."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(IN, 6), nn.Linear(6, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.w2(F.gelu(self.w1(x)))
        if isinstance(out, DTensor):  # (batch on dp, Partial on tp) -> this rank's batch
            out = out.redistribute(out.device_mesh, [Shard(0), Replicate()]).to_local()
        return out


def _on_spmd_mesh(model: SpmdMLP, mesh) -> SpmdMLP:
    tp = {"w1.weight": Shard(0), "w1.bias": Shard(0), "w2.weight": Shard(1), "w2.bias": Replicate()}
    for name, p in list(model.named_parameters()):
        module, attr = name.rsplit(".", 1)
        setattr(
            model.get_submodule(module),
            attr,
            nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate(), tp[name]])),
        )
    return model


def _spmd_backward(ours, theirs, reference, mesh):
    """One step's backward on a (dp, tp) mesh: each dp rank's batch as a DTensor through both
    engines (equal losses), the unsharded reference over every dp rank's batch."""
    dp_rank, dp_size = mesh.get_local_rank(0), mesh.size(0)

    def backward(step):
        batches = [_moe_batch(step, d) for d in range(dp_size)]
        x, y = batches[dp_rank]
        x = DTensor.from_local(x, mesh, [Shard(0), Replicate()], run_check=False)
        _backward_both_equal([F.mse_loss(m(x), y) for m in (ours, theirs)])
        (sum(F.mse_loss(reference(bx), by) for bx, by in batches) / dp_size).backward()

    return backward


def _dp_mesh_dims_parity():
    mesh = _mesh_2x2()
    reference = SpmdMLP()
    models = []
    for shard in (fully_shard, torch_fully_shard):
        model = _on_spmd_mesh(copy.deepcopy(reference), mesh)
        shard(model.w1, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        models.append(model)
    ours, theirs = models
    assert ours.w1.weight.device_mesh is mesh
    assert ours.w1.weight.placements[1] == Shard(0)
    assert type(ours.w1.weight.placements[0]) is StridedRaggedShard
    assert type(ours.w2.weight.placements[0]) is RaggedShard

    _train_like_both(ours, theirs, reference, STEPS, _spmd_backward(ours, theirs, reference, mesh))


@needs_dp_mesh_dims
def test_dp_mesh_dims_on_a_dp_x_tp_mesh_matches_fsdp2_and_unsharded(dist_run):
    dist_run(_dp_mesh_dims_parity, 4)


def _dp_mesh_dims_replicate_only_parity():
    """DDP on an SPMD mesh (replicate dims only): parameters stay the module's DTensors, on
    the full mesh with their placements (FSDP2's), and train as FSDP2's and the unsharded
    model's, gradients averaged over the replicas."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "tp"))
    dims = DataParallelMeshDims(replicate="dp_replicate")
    reference = SpmdMLP()
    models = []
    for shard in (fully_shard, torch_fully_shard):
        model = _on_spmd_mesh(copy.deepcopy(reference), mesh)
        shard(model.w1, mesh=mesh, dp_mesh_dims=dims)
        shard(model, mesh=mesh, dp_mesh_dims=dims)
        models.append(model)
    ours, theirs = models
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert p.device_mesh is mesh, (name, p.placements, q.placements)
        assert p.placements == q.placements, (name, p.placements, q.placements)
    with pytest.raises(ValueError, match=r"its parameter 'weight' is already sharded by fully_shard .* bottom-up"):
        fully_shard(ours.w2, mesh=mesh, dp_mesh_dims=dims)  # the root's unit already has it

    _train_like_both(ours, theirs, reference, 3, _spmd_backward(ours, theirs, reference, mesh), grads_at_step_0=True)


@needs_dp_mesh_dims
def test_dp_mesh_dims_with_replicate_dims_only_matches_fsdp2_and_unsharded(dist_run):
    dist_run(_dp_mesh_dims_replicate_only_parity, 4)


class BatchSpmdMLP(SpmdMLP):
    """SpmdMLP on the full mesh ``mesh``: the batch split over ``batch_placements`` (Shard(0)
    on the data-parallel dims), its output back to this rank's batch."""

    mesh = None
    batch_placements: list

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mesh is None:  # the unsharded reference
            return self.w2(F.gelu(self.w1(x)))
        x = DTensor.from_local(x, self.mesh, self.batch_placements, run_check=False)
        out = self.w2(F.gelu(self.w1(x)))
        return out.redistribute(self.mesh, self.batch_placements).to_local()


def _assert_placements_like_fsdp2(ours: nn.Module, theirs: nn.Module) -> None:
    """Our sharded parameters live on FSDP2's mesh with FSDP2's placements, one RaggedShard
    (StridedRaggedShard) where FSDP2 has its Shard (_StridedShard)."""
    fsdp2_of = {RaggedShard: Shard, StridedRaggedShard: _StridedShard}
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert p.device_mesh == q.device_mesh, (name, p.device_mesh, q.device_mesh)
        ragged = [i for i, t in enumerate(p.placements) if type(t) in fsdp2_of]
        assert len(ragged) == 1, name
        assert type(q.placements[ragged[0]]) is fsdp2_of[type(p.placements[ragged[0]])], name
        assert all(t == u for i, (t, u) in enumerate(zip(p.placements, q.placements)) if i != ragged[0]), name


def _dp_mesh_dims_forms_parity():
    """FSDP2's other dp_mesh_dims forms: HSDP (shard and replicate dims), flattened shard dims
    (torchtitan's dp_shard x cp), flattened shard dims x TP (StridedRaggedShard on the
    flattened dim): ours trains as FSDP2 and the unsharded model, on FSDP2's layout."""
    rank = dist.get_rank()
    tp_plan = {"w1.weight": Shard(0), "w1.bias": Shard(0), "w2.weight": Shard(1), "w2.bias": Replicate()}
    forms = [  # (mesh shape, names, dp_mesh_dims, data-parallel index of this rank, dims with TP)
        (
            (2, 2),
            ("dp_replicate", "dp_shard"),
            DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate"),
            rank,
            0,
        ),
        # torchtitan's data parallelism without sharding: HSDP with one rank per shard group
        (
            (4, 1),
            ("dp_replicate", "dp_shard"),
            DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate"),
            rank,
            0,
        ),
        ((2, 2), ("dp_shard", "cp"), DataParallelMeshDims(shard=("dp_shard", "cp")), rank, 0),
        ((2, 1, 2), ("dp_shard", "cp", "tp"), DataParallelMeshDims(shard=("dp_shard", "cp")), rank // 2, 1),
    ]
    for shape, names, dims, dp_rank, tp_dims in forms:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dp_dims = len(names) - tp_dims
        dp_size = math.prod(shape[:dp_dims])
        torch.manual_seed(0)
        reference = BatchSpmdMLP()
        models = []
        for shard in (fully_shard, torch_fully_shard):
            model = copy.deepcopy(reference)
            model.mesh, model.batch_placements = mesh, [Shard(0)] * dp_dims + [Replicate()] * tp_dims
            for name, p in list(model.named_parameters()):
                module, attr = name.rsplit(".", 1)
                placements = [Replicate()] * dp_dims + [tp_plan[name]] * tp_dims
                setattr(
                    model.get_submodule(module), attr, nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
                )
            shard(model.w1, mesh=mesh, dp_mesh_dims=dims)
            shard(model, mesh=mesh, dp_mesh_dims=dims)
            models.append(model)
        ours, theirs = models
        _assert_placements_like_fsdp2(ours, theirs)

        def backward(step, dp_rank=dp_rank, dp_size=dp_size, ours=ours, theirs=theirs, reference=reference):
            batches = [_moe_batch(step, d) for d in range(dp_size)]
            x, y = batches[dp_rank]
            _backward_both_equal([F.mse_loss(m(x), y) for m in (ours, theirs)])
            (sum(F.mse_loss(reference(bx), by) for bx, by in batches) / dp_size).backward()

        _train_like_both(ours, theirs, reference, 3, backward, grads_at_step_0=True)


@needs_dp_mesh_dims
def test_dp_mesh_dims_hsdp_and_flattened_shard_dims_match_fsdp2_and_unsharded(dist_run):
    dist_run(_dp_mesh_dims_forms_parity, 4)


class SpmdMoE(MoEModel):
    """MoEModel with dense parameters on the dense SPMD mesh and experts on the sparse one
    (torchtitan's storage meshes): the forward runs the experts on local tensors."""

    dense = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is None:  # the unsharded reference
            return super().forward(x)
        dense = self.dense
        h = self.proj(DTensor.from_local(x, dense, [Shard(0)], run_check=False))
        scores = self.router(h).softmax(-1).to_local()
        h = h.to_local()
        expert = scores.argmax(-1)
        routed = h * scores.gather(1, expert[:, None])
        ep_rank, ep_size = dist.get_rank(self.ep_group), dist.get_world_size(self.ep_group)
        all_routed = all_gather_tensor_autograd(routed, 0, self.ep_group)
        all_expert = all_gather_tensor_autograd(expert, 0, self.ep_group)
        out = self.experts(all_routed, all_expert, ep_rank * EXPERTS // ep_size)
        moe = h + reduce_scatter_tensor_autograd(out, "sum", 0, self.ep_group)
        return self.head(DTensor.from_local(moe, dense, [Shard(0)], run_check=False)).to_local()


def _dp_mesh_dims_with_expert_meshes_parity():
    """torchtitan's MoE path with EP: one fully_shard with dp_mesh_dims on the dense mesh and
    a shard_placement_fn giving the experts FSDP2's mesh info of the sparse (efsdp, ep) mesh
    with its own dp_mesh_dims; gradient division off, the loss scaled by the world size."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    world = dist.get_world_size()
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dense_dims, sparse_dims = DataParallelMeshDims(shard="dp_shard"), DataParallelMeshDims(shard="efsdp")
    reference = SpmdMoE()
    models = []
    for shard in (fully_shard, torch_fully_shard):
        model = copy.deepcopy(reference)
        experts = set()
        for name, p in list(model.named_parameters()):
            module, attr = name.rsplit(".", 1)
            on_sparse = module == "experts"
            dt = distribute_tensor(
                p.detach(), *((sparse, [Replicate(), Shard(0)]) if on_sparse else (dense, [Replicate()]))
            )
            setattr(model.get_submodule(module), attr, nn.Parameter(dt))
            if on_sparse:
                experts.add(getattr(model.get_submodule(module), attr))
        model.ep_group, model.dense = sparse.get_group("ep"), dense
        infos = _get_mesh_info(sparse, sparse_dims), _get_mesh_info(dense, dense_dims)

        def placement_fn(param, experts=experts, infos=infos):
            return ShardPlacementResult(placement=Shard(0), mesh_info=infos[0] if param in experts else infos[1])

        shard(model, mesh=dense, dp_mesh_dims=dense_dims, shard_placement_fn=placement_fn)
        model.set_gradient_divide_factor(1.0)
        model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (FSDP2's divide)
        models.append(model)
    ours, theirs = models
    _assert_placements_like_fsdp2(ours, theirs)
    assert ours.experts.w1.device_mesh is sparse
    assert ours.proj.weight.device_mesh is dense

    def backward(step):
        x, y = _moe_batch(step, dist.get_rank())
        _backward_both_equal([F.mse_loss(m(x), y) / world for m in (ours, theirs)])
        batches = [_moe_batch(step, r) for r in range(world)]
        (sum(F.mse_loss(reference(bx), by) for bx, by in batches) / world).backward()

    _train_like_both(ours, theirs, reference, 3, backward, grads_at_step_0=True)


@needs_dp_mesh_dims
def test_dp_mesh_dims_with_expert_shard_placement_meshes_matches_fsdp2_and_unsharded(dist_run):
    dist_run(_dp_mesh_dims_with_expert_meshes_parity, 4)


def _dp_mesh_dims_errors():
    mesh = _mesh_2x2()
    cases = [
        (
            dict(mesh=init_device_mesh("cpu", (2, 2)), dp_mesh_dims=DataParallelMeshDims(shard="dp")),
            ValueError,
            "mesh must have mesh_dim_names when dp_mesh_dims is provided",
        ),
        (
            dict(mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="data")),
            ValueError,
            r"Mesh dim name 'data' not found in mesh.mesh_dim_names \('dp', 'tp'\)",
        ),
        (
            dict(mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"), reshard_after_forward=2),
            NotImplementedError,
            r"reshard_after_forward as int is not yet supported with SPMD mesh \(dp_mesh_dims\)",
        ),
        (
            dict(mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate="tp")),
            ValueError,
            r"Expected Replicate\(\) on DP replicate dim 'tp' \(index 1\) but got S\(0\)",
        ),
    ]
    for kwargs, error, message in cases:
        for shard in (fully_shard, torch_fully_shard):
            with pytest.raises(error, match=message):
                shard(_spmd_model(mesh), **kwargs)
    # parameter-level errors, FSDP2's wording, naming the parameter for ours
    plain = Transformer()
    with pytest.raises(
        ValueError, match="When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh"
    ):
        fully_shard(plain, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    sharded_on_dp = nn.Linear(4, 4)
    sharded_on_dp.weight = nn.Parameter(distribute_tensor(sharded_on_dp.weight.detach(), mesh, [Shard(0), Replicate()]))
    sharded_on_dp.bias = nn.Parameter(distribute_tensor(sharded_on_dp.bias.detach(), mesh, [Replicate(), Replicate()]))
    with pytest.raises(
        ValueError,
        match=r"Expected Replicate\(\) on DP shard dim 'dp' \(index 0\) but got S\(0\) \(parameter 'weight'\)",
    ):
        fully_shard(sharded_on_dp, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    other_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="Expected param's DTensor mesh to be the same mesh passed to fully_shard"):
        fully_shard(_spmd_model(mesh), mesh=other_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    dist.barrier()


@needs_dp_mesh_dims
def test_dp_mesh_dims_validation_matches_fsdp2(dist_run):
    dist_run(_dp_mesh_dims_errors, 4)


def _unsupported_combinations():
    mesh = _mesh_2x2()
    # a TP mesh from another root cannot be combined with the dp mesh
    foreign = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), foreign, [Replicate()]))
    with pytest.raises(
        ValueError, match="parameter 'weight' is a DTensor on mesh .* cannot be combined with the data-parallel mesh"
    ):
        fully_shard(lin, mesh=mesh["dp"])
    # the module is untouched: still usable as before
    assert lin.weight.device_mesh == foreign
    assert type(lin).__name__ == "Linear"
    dist.barrier()


def test_unsupported_combinations_are_refused_before_any_collective(dist_run):
    dist_run(_unsupported_combinations, 4)


def _post_forward_groups_of_a_dp_submesh():
    from vescale_plugins.ragged.dtensor import every_copy_of_mesh
    from vescale_plugins.runtime.mesh import post_forward_group

    mesh = _mesh_2x2()
    dp = mesh["dp"]
    assert every_copy_of_mesh(dp).tolist() == [[0, 2], [1, 3]]
    # reshard_after_forward=k on a TP model's dp mesh: every rank creates every copy's groups
    group = post_forward_group(dp, 1)
    assert dist.get_world_size(group) == 1
    assert dist.get_process_group_ranks(group) == [dist.get_rank()]
    dist.barrier()


def test_post_forward_groups_of_a_dp_submesh(dist_run):
    dist_run(_post_forward_groups_of_a_dp_submesh, 4, timeout=60)


def _meta_init_like_torchtitan():
    """torchtitan's order: build on meta, parallelize, fully_shard, to_empty, initialise;
    the sharded random init draws what the eager model drew, and it trains the same."""
    mesh = _mesh_2x2()
    torch.manual_seed(0)
    eager = Transformer()
    with torch.device("meta"):
        model = Transformer()
    data_parallel(tensor_parallel(model, mesh["tp"]), fully_shard, mesh["dp"])
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():  # construction order, as the eager model drew
            if module is not model and hasattr(module, "reset_parameters"):
                module.reset_parameters()
    assert_same(model, eager, "param", dict(rtol=0, atol=0))
    tokens, targets = token_batch(0, mesh.get_local_rank(0))
    torch.testing.assert_close(lm_loss(model, tokens, targets), lm_loss(eager, tokens, targets), **TOL)


def test_meta_init_of_a_tp_x_fsdp_model_draws_the_eager_values(dist_run):
    dist_run(_meta_init_like_torchtitan, 4)


def _accumulation_without_sync():
    """Micro-batches without gradient sync accumulate TP DTensor gradients locally, then
    one reduce-scatter: the same gradients as FSDP2's."""
    mesh = _mesh_2x2()
    reference = Transformer()
    ours = data_parallel(tensor_parallel(copy.deepcopy(reference), mesh["tp"]), fully_shard, mesh["dp"])
    theirs = data_parallel(tensor_parallel(copy.deepcopy(reference), mesh["tp"]), torch_fully_shard, mesh["dp"])
    for model in (ours, theirs):
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            (lm_loss(model, *token_batch(micro, mesh.get_local_rank(0))) / 3).backward()
    assert_same(ours, theirs, "grad", TOL)


def test_gradient_accumulation_without_sync_matches_fsdp2(dist_run):
    dist_run(_accumulation_without_sync, 4)


def _mixed_precision():
    """bf16 compute, fp32 reduce: the TP forward runs on bf16 DTensors; gradients as FSDP2's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = _mesh_2x2()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reference = Transformer()
    models = []
    for shard in (fully_shard, torch_fully_shard):
        model = tensor_parallel(copy.deepcopy(reference), mesh["tp"])
        for block in model.layers:
            shard(block, mesh=mesh["dp"], mp_policy=policy)
        models.append(shard(model, mesh=mesh["dp"], mp_policy=policy))
    ours, theirs = models
    tokens, targets = token_batch(0, mesh.get_local_rank(0))
    losses = [lm_loss(m, tokens, targets) for m in models]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1])
    assert ours.layers[0].w1.weight.dtype == torch.float32
    assert ours.layers[0].w1.weight.grad.dtype == torch.float32
    assert_same(ours, theirs, "grad", dict(rtol=1e-2, atol=1e-4))


def test_mixed_precision_matches_fsdp2(dist_run):
    dist_run(_mixed_precision, 4)


def _int_reshard_with_tp():
    """``reshard_after_forward=2`` on the dp=4 dim of a (dp=4, tp=2) mesh (8 ranks): each
    unit keeps half of itself after forward and backward gathers within 2 dp ranks of the
    same TP position; trains as the unsharded model.

    Not against FSDP2 here: torch 2.13's FSDP2 hangs on this configuration (its post-forward
    ``DeviceMesh`` for an int ``reshard_after_forward`` on a dp submesh is built by the ranks
    of one submesh copy only, and ``new_group`` needs every rank)."""
    import vescale_plugins.dbuffer.buffer as dbuffer_module

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh.get_local_rank(0), mesh.size(0)
    reference = Transformer()

    def shard(module, shard_fn):
        for block in module.layers:
            shard_fn(block, mesh=mesh["dp"], reshard_after_forward=2)
        shard_fn(module, mesh=mesh["dp"], reshard_after_forward=2)
        return module

    ours = shard(tensor_parallel(copy.deepcopy(reference), mesh["tp"]), fully_shard)
    opts = [default_adamw(m) for m in (reference, ours)]
    sizes, ranks, original = [], [], dbuffer_module.all_gather_into

    def counted(output, tensor, group, async_op=False):
        sizes.append(dist.get_world_size(group))
        ranks.append(dist.get_process_group_ranks(group))
        return original(output, tensor, group, async_op=async_op)

    for step in range(2):
        tokens, targets = token_batch(step, dp_rank)
        loss = lm_loss(ours, tokens, targets)
        dbuffer_module.all_gather_into = counted
        try:
            loss.backward()
        finally:
            dbuffer_module.all_gather_into = original
        ref_loss = sum(lm_loss(reference, *token_batch(step, d)) for d in range(dp_size)) / dp_size
        ref_loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=mesh.get_group("dp"))
        torch.testing.assert_close(global_loss / dp_size, ref_loss.detach(), **TOL)
        # every backward all-gather spans 2 dp ranks that hold the same TP shard
        assert sizes, sizes
        assert set(sizes) == {2}, sizes
        me = dist.get_rank()
        assert all(me in group and all(r % 2 == me % 2 for r in group) for group in ranks), ranks
        sizes.clear()
        ranks.clear()
        step_and_zero(*opts)
    assert_same(ours, reference, "param", PARAM_TOL)


@pytest.mark.timeout(420)
def test_reshard_after_forward_to_2_of_4_dp_ranks_with_tp2(dist_run):
    dist_run(_int_reshard_with_tp, 8, timeout=360)


def _ep_x_tp_experts(path: str):
    """Experts on a 2-D (ep, tp) mesh (torch's ExpertParallelWithTP: Shard(0) over ep, w1
    colwise and w2 rowwise over tp), sharded by FSDP over efsdp: on 8 ranks as (efsdp=2,
    ep=2, tp=2), gradients and parameters match FSDP2 and an unsharded reference."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ExpertLayer, ExpertParallelWithTP

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("efsdp", "ep", "tp"))
    torch.manual_seed(0)
    base = ExpertLayer(num_experts=4, dim=6, hidden_dim=10)
    for p in base.parameters():
        nn.init.normal_(p, std=0.3)
    reference = copy.deepcopy(base)
    models = []
    for shard in (torch_fully_shard, fully_shard):
        model = copy.deepcopy(base)
        parallelize_module(model, mesh["tp"], ExpertParallelWithTP(mesh["ep"], mesh["tp"]))
        models.append(shard(model, mesh=mesh["efsdp"]))
    theirs, ours = models
    w1 = ours.experts.w1
    assert w1.device_mesh.mesh_dim_names == ("efsdp", "ep", "tp")
    assert type(w1.placements[0]) is StridedRaggedShard
    assert w1.placements[1:] == (Shard(0), Shard(1))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (theirs, ours, reference)]
    for step in range(3):
        # a TP group reads the same tokens; EP gathers them over ep, FSDP averages over efsdp
        x = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(100 * step + dist.get_rank() // 2))
        losses = []
        for model in (theirs, ours):
            loss = model(x).pow(2).sum()
            loss.backward()
            losses.append(loss.detach())
        reference(x).pow(2).sum().backward()
        for p in reference.parameters():
            dist.all_reduce(p.grad, group=mesh["ep"].get_group())
            dist.all_reduce(p.grad, group=mesh["efsdp"].get_group())
            p.grad.div_(mesh["efsdp"].size())
        torch.testing.assert_close(losses[1], losses[0], **TOL)
        _assert_like_both(ours, theirs, reference, "grad", PARAM_TOL)
        step_and_zero(*optimizers)
    _assert_like_both(ours, theirs, reference, "param", PARAM_TOL)

    # A DCP checkpoint of ours loads into a fresh copy exactly, and into FSDP2's layout too.
    dcp.save(ours.state_dict(), checkpoint_id=path)
    for shard in (fully_shard, torch_fully_shard):
        fresh = parallelize_module(
            ExpertLayer(num_experts=4, dim=6, hidden_dim=10), mesh["tp"], ExpertParallelWithTP(mesh["ep"], mesh["tp"])
        )
        fresh = shard(fresh, mesh=mesh["efsdp"])
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=path)
        fresh.load_state_dict(state)
        assert_same(fresh, ours, "param", {"rtol": 0, "atol": 0})


def test_experts_on_an_ep_x_tp_mesh_match_fsdp2_and_unsharded(dist_run, tmp_path):
    dist_run(_ep_x_tp_experts, 8, str(tmp_path), timeout=120)


def _two_tp_dims_gather_exactly():
    """Parameters on a 2-D (ep, tp) mesh with rows cut by both dims (or by one, uneven: 10 rows
    over 4 and 2 shards), sharded over efsdp: full_tensor and a redistribute to Replicate give
    back the original, as for FSDP2's _StridedShard."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("efsdp", "ep", "tp"))
    torch.manual_seed(0)
    full = torch.randn(10, 3)
    for placements in ([Shard(0), Shard(0)], [Shard(1), Shard(0)], [Shard(0), Replicate()]):
        for shard in (torch_fully_shard, fully_shard):
            holder = nn.Module()
            holder.w = nn.Parameter(distribute_tensor(full, mesh["ep", "tp"], placements))
            shard(holder, mesh=mesh["efsdp"])
            assert torch.equal(holder.w.full_tensor(), full), (placements, shard)
            replicated = holder.w.redistribute(holder.w.device_mesh, [Replicate()] * 3).to_local()
            assert torch.equal(replicated, full), (placements, shard)
        assert type(holder.w.placements[0]) is StridedRaggedShard


def test_two_tp_dims_gather_exactly(dist_run):
    dist_run(_two_tp_dims_gather_exactly, 8)
