"""torchtitan's recipe end to end, for our fully_shard and FSDP2's in the same test, against an
unsharded model: build on meta -> tensor parallel -> activation checkpointing -> each block
``compile(fullgraph=True)`` -> ``fully_shard`` (blocks, the embedding, ``[norm, output]``,
the root; gradient division off) -> ``to_empty`` + ``init_weights`` -> AdamW steps -> DCP
save, a fresh model through the same recipe, DCP load, more steps.

The llama3-style model takes torchtitan's DTensor path (``parallelize_module`` on the tp
dim, ``fully_shard`` over the dp_shard dim) and its chunked loss (the output head kept
unsharded across chunks with ``set_requires_gradient_sync(False, recurse=False)``, one
reduce-scatter at the last chunk, the decoder's backward from the accumulated gradient).
The MoE-style model takes its SPMD path (every dense parameter on the full (dp_shard, tp)
mesh, ``dp_mesh_dims``, the experts on the sparse (efsdp, ep) mesh through
``apply_fsdp_to_decoder``'s ``shard_placement_fn``).

The compile backend is ``aot_eager``: what Dynamo and AOT autograd see of the hooks and
DTensors is the same as under inductor (test_compile.py covers inductor), and inductor's
code generation for 2 blocks x 2 engines would cost minutes on 2 cores.
"""

from __future__ import annotations

from typing import TypeVar

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import fsdp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from tests.support.parity import EXACT, PARAM_TOL, TOL, adamw
from tests.support.torchtitan_models import (
    MOE_IN,
    MOE_OUT,
    VOCAB,
    Llama,
    MoE,
    chunked_loss,
    init_weights,
    spmd_parallel_moe,
    tensor_parallel_llama,
)
from vescale_plugins import fully_shard

if not hasattr(fsdp, "DataParallelMeshDims"):
    pytest.skip(
        "torch < 2.13: torchtitan's recipe passes dp_mesh_dims, which FSDP2 took from 2.13", allow_module_level=True
    )
DataParallelMeshDims = fsdp.DataParallelMeshDims

pytestmark = pytest.mark.timeout(300)

ENGINES = {"vescale": fully_shard, "torch": torch_fully_shard}
STEPS, RESUME_AT = 4, 2  # steps in all; the checkpoint is taken after RESUME_AT of them
SEQ, BATCH, CHUNKS, CLIP = 8, 2, 2, 1.0


_Model = TypeVar("_Model", bound=nn.Module)


def _checkpoint_and_compile(model: nn.Module) -> None:
    """torchtitan's full activation checkpointing, then each block compiled in place."""
    for name, block in model.layers.items():
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    for block in model.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)


def _without_gradient_division(model: nn.Module) -> None:
    """torchtitan's ``disable_fsdp_gradient_division``; gloo has no PREMUL_SUM, so FSDP2
    needs the sum reduction too."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def _materialized(model: _Model, init: bool) -> _Model:
    """The recipe's last steps once the model is sharded: gradient division off, ``to_empty``
    on the CPU, then (unless a checkpoint will fill them) torchtitan's ``init_weights``."""
    _without_gradient_division(model)
    model.to_empty(device="cpu")
    if init:
        init_weights(model)
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def _parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters by the unsharded model's names (wrappers' prefixes dropped)."""
    return {name.replace("_checkpoint_wrapped_module.", ""): _full(p) for name, p in model.named_parameters()}


def _assert_close(ours: dict, theirs: dict, tol: dict, what: str) -> None:
    assert ours.keys() == theirs.keys(), what
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], **tol, msg=lambda m, name=name: f"{what} {name}: {m}")


def _assert_like_fsdp2_and_unsharded(runs: dict, expected_losses, reference: nn.Module) -> None:
    """Ours against FSDP2 and the unsharded reference: losses and final parameters."""
    (ours_losses, ours), (fsdp2_losses, fsdp2) = runs["vescale"], runs["torch"]
    torch.testing.assert_close(ours_losses, fsdp2_losses, **TOL)
    torch.testing.assert_close(ours_losses, expected_losses, **TOL)
    _assert_close(ours, fsdp2, PARAM_TOL, "FSDP2")
    _assert_close(ours, _parameters(reference), PARAM_TOL, "unsharded")


def _train(model, optimizer, steps, loss_fn, clip: bool) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        losses.append(loss_fn(model, step))
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _run_with_resume(build, loss_fn, path: str, clip: bool) -> tuple[list[torch.Tensor], dict]:
    """``STEPS`` steps of the model ``build()`` gives, a DCP checkpoint after ``RESUME_AT``;
    the steps after it replayed by a fresh model loaded from it must give the same losses
    and parameters. Returns the losses and the final full parameters."""
    model = build()
    optimizer = adamw(model)
    losses = _train(model, optimizer, range(RESUME_AT), loss_fn, clip)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    losses += _train(model, optimizer, range(RESUME_AT, STEPS), loss_fn, clip)

    resumed = build(init=False)
    resumed_optimizer = adamw(resumed)
    model_state, optim_state = get_state_dict(resumed, resumed_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(resumed, resumed_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed_losses = _train(resumed, resumed_optimizer, range(RESUME_AT, STEPS), loss_fn, clip)
    torch.testing.assert_close(resumed_losses, losses[RESUME_AT:], **EXACT)
    params = _parameters(model)
    _assert_close(_parameters(resumed), params, EXACT, "resumed")
    return losses, params


def _global_loss(loss: torch.Tensor, group) -> torch.Tensor:
    """The sum of the data-parallel ranks' losses (each already divided by the global count)."""
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total


# -- llama3: TP x FSDP on a (dp_shard, tp) mesh, the chunked loss ---------------------------


def _tokens(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _chunked_loss(model, tokens, targets, global_tokens: int) -> torch.Tensor:
    """torchtitan's ``ChunkedLossWrapper`` around the FSDP-managed output head."""
    loss, _ = chunked_loss(model(tokens, skip_lm_head=True), model.output, targets, CHUNKS, global_tokens, dim=1)
    return loss


def _llama_recipe(shard, mesh, init: bool = True) -> Llama:
    with torch.device("meta"):
        model = Llama()
    tensor_parallel_llama(model, mesh["tp"])
    _checkpoint_and_compile(model)
    dp = mesh["dp_shard"]
    shard(model.tok_embeddings, mesh=dp)
    for block in model.layers.values():
        shard(block, mesh=dp)
    shard([model.norm, model.output], mesh=dp, reshard_after_forward=False)
    shard(model, mesh=dp)
    return _materialized(model, init)


def _llama_recipe_like_fsdp2_and_unsharded(path: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    dp_rank, dp_size, dp_group = mesh.get_local_rank("dp_shard"), mesh.size(0), mesh.get_group("dp_shard")
    global_tokens = dp_size * BATCH * SEQ

    def sharded_loss(model, step):
        loss = _chunked_loss(model, *_tokens(step, dp_rank), global_tokens)
        loss.backward()
        return _global_loss(loss, dp_group)

    runs = {
        engine: _run_with_resume(
            lambda init=True, shard=shard: _llama_recipe(shard, mesh, init), sharded_loss, f"{path}/{engine}", True
        )
        for engine, shard in ENGINES.items()
    }
    reference = Llama()
    init_weights(reference)

    def reference_loss(model, step):
        loss = sum(
            F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
            for x, y in (_tokens(step, d) for d in range(dp_size))
        )
        (loss / global_tokens).backward()
        return (loss / global_tokens).detach()

    expected_losses = _train(reference, adamw(reference), range(STEPS), reference_loss, True)
    _assert_like_fsdp2_and_unsharded(runs, expected_losses, reference)


def test_llama_through_torchtitans_recipe_matches_fsdp2_and_unsharded(dist_run, tmp_path):
    dist_run(_llama_recipe_like_fsdp2_and_unsharded, 4, str(tmp_path), timeout=300)


# -- MoE: dense params on (dp_shard, tp) with dp_mesh_dims, experts on (efsdp, ep) ----------


def _moe_batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 * step + dp_rank)
    return torch.randn(BATCH * SEQ, MOE_IN, generator=g), torch.randn(BATCH * SEQ, MOE_OUT, generator=g)


def _moe_recipe(shard, dense, sparse, init: bool = True) -> MoE:
    """torchtitan's ``apply_fsdp_to_decoder`` with EP: each block one ``fully_shard`` whose
    ``shard_placement_fn`` gives the experts FSDP2's mesh info of the sparse mesh."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    with torch.device("meta"):
        model = MoE()
    experts = spmd_parallel_moe(model, dense, sparse)
    _checkpoint_and_compile(model)
    dense_dims, sparse_dims = DataParallelMeshDims(shard="dp_shard"), DataParallelMeshDims(shard="efsdp")
    infos = _get_mesh_info(sparse, sparse_dims), _get_mesh_info(dense, dense_dims)

    def placement_fn(param):
        return ShardPlacementResult(placement=Shard(0), mesh_info=infos[0] if param in experts else infos[1])

    for block in model.layers.values():
        shard(block, mesh=dense, dp_mesh_dims=dense_dims, shard_placement_fn=placement_fn)
    shard(model, mesh=dense, dp_mesh_dims=dense_dims)
    return _materialized(model, init)


def _moe_recipe_like_fsdp2_and_unsharded(path: str) -> None:
    dense = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dp_rank, dp_size, dp_group = dense.get_local_rank("dp_shard"), dense.size(0), dense.get_group("dp_shard")
    count = dp_size * BATCH * SEQ * MOE_OUT

    def sharded_loss(model, step):
        x, y = _moe_batch(step, dp_rank)
        loss = F.mse_loss(model(x), y, reduction="sum") / count
        loss.backward()
        return _global_loss(loss, dp_group)

    probe = _moe_recipe(fully_shard, dense, sparse)  # the experts on the sparse mesh, the rest on the dense one
    assert probe.layers["0"].experts.w1.device_mesh == sparse
    assert probe.layers["0"].w_in.weight.device_mesh == dense
    runs = {
        engine: _run_with_resume(
            lambda init=True, shard=shard: _moe_recipe(shard, dense, sparse, init),
            sharded_loss,
            f"{path}/{engine}",
            False,
        )
        for engine, shard in ENGINES.items()
    }
    reference = MoE()
    init_weights(reference)

    def reference_loss(model, step):
        x, y = (torch.cat(t) for t in zip(*(_moe_batch(step, d) for d in range(dp_size))))
        loss = F.mse_loss(model(x), y, reduction="sum") / count
        loss.backward()
        return loss.detach()

    expected_losses = _train(reference, adamw(reference), range(STEPS), reference_loss, False)
    _assert_like_fsdp2_and_unsharded(runs, expected_losses, reference)


def test_moe_through_torchtitans_recipe_with_expert_meshes_matches_fsdp2_and_unsharded(dist_run, tmp_path):
    dist_run(_moe_recipe_like_fsdp2_and_unsharded, 4, str(tmp_path), timeout=300)
