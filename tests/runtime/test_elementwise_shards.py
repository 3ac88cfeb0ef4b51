"""Parameters cut element-wise: where one buffer of whole rows would pad more than FSDP2 (rows
of different lengths), ``fully_shard`` with no ``block_size_fn`` cuts them anywhere
(``RaggedShard`` over all dims, 1-D local shards) and trains exactly what FSDP2 and the
unsharded model train; a checkpoint saved at 2 ranks loads at 3.

The model's weights are (6, 250) and (6, 330): FSDP2 pads nothing at 2 or 3 ranks (6 rows
divide evenly), while one buffer of whole rows of 250 and 330 elements cannot split 3,084
elements evenly, so the planner cuts them element-wise at both world sizes.
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from tests.support.models import clone
from tests.support.parity import TOL, adamw, assert_matches, assert_sharded_views, full_params
from vescale_plugins import RaggedShard, fully_shard

GLOBAL_BATCH = 12  # divides by 2 and 3: every rank the same share
STEPS = 3
MAX_NORM = 0.05  # below the gradients' norm: clip_grad_norm_ scales every step


class _TwoWidths(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(250, 6)
        self.b = torch.nn.Linear(330, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x[:, :250]) * self.b(x[:, 250:])


def _batch(step: int) -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, 580, generator=torch.Generator().manual_seed(100 + step))


def _local(x: torch.Tensor) -> torch.Tensor:
    share = GLOBAL_BATCH // dist.get_world_size()
    return x[dist.get_rank() * share : (dist.get_rank() + 1) * share]


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _assert_cut_elementwise(model: torch.nn.Module) -> None:
    unit = model._vescale_fsdp_unit
    assert len(unit.buffers) == 1  # one buffer: no more collectives than rows would take
    for name, p in model.named_parameters():
        placement = p.placements[0]
        assert isinstance(placement, RaggedShard), name
        assert placement.dims == tuple(range(p.dim())), (name, placement)
        assert p.to_local().dim() == 1, (name, p.to_local().shape)
    # FSDP2 pads nothing here; neither do we, beyond the 16-byte alignment.
    layout = unit.dbuffers[0].layout
    assert layout.padding < 4 * dist.get_world_size() + 4 * len(layout.numels), layout.padding


def _trains_like_fsdp2_and_unsharded(mp: MixedPrecisionPolicy) -> None:
    torch.manual_seed(0)
    reference = _TwoWidths()
    ours, theirs = clone(reference), clone(reference)
    fully_shard(ours, mp_policy=mp)
    torch_fully_shard(theirs, mp_policy=mp)
    _assert_cut_elementwise(ours)
    mixed = mp.param_dtype is not None
    tol = dict(rtol=2e-2, atol=2e-3) if mixed else TOL
    opts = [adamw(m) for m in (reference, ours, theirs)]
    for step in range(STEPS):
        x = _batch(step)
        _loss(reference, x).backward()
        for model in (ours, theirs):
            _loss(model, _local(x)).backward()
        norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM) for m in (reference, ours, theirs)]
        assert norms[0] > MAX_NORM  # the clip is applied
        torch.testing.assert_close(norms[1].full_tensor(), norms[2].full_tensor(), **tol)
        assert_matches(ours, theirs, "grad", tol)
        if not mixed:
            torch.testing.assert_close(norms[1].full_tensor(), norms[0], **TOL)
            assert_matches(ours, reference, "grad")
        assert_sharded_views(ours)
        for p in ours.parameters():
            assert p.grad.to_local().dim() == 1
            assert p.grad.placements == p.placements
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_matches(ours, theirs, "param", None if not mixed else tol)
        if not mixed:
            assert_matches(ours, reference, "param")


@pytest.mark.parametrize(
    ("world", "mp"),
    [
        (2, MixedPrecisionPolicy()),
        (3, MixedPrecisionPolicy()),
        (3, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
    ],
    ids=["w2", "w3", "w3-bf16-params-fp32-reduce"],
)
def test_elementwise_shards_train_like_fsdp2_and_the_unsharded_model(dist_run, world, mp):
    dist_run(_trains_like_fsdp2_and_unsharded, world, mp)


def _trained(steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = fully_shard(_TwoWidths())
    _assert_cut_elementwise(model)
    opt = adamw(model)
    for step in range(steps):
        _loss(model, _local(_batch(step))).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(path: str) -> None:
    model, opt = _trained(2)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    full = full_params(model)
    state = {k: v.full_tensor() for k, v in opt.state[next(iter(model.parameters()))].items() if k != "step"}
    if dist.get_rank() == 0:
        torch.save((full, state), f"{path}/full.pt")
    # A full state dict round trip at this world size.
    options = StateDictOptions(full_state_dict=True)
    restored, _ = _trained(0)
    set_model_state_dict(restored, get_model_state_dict(model, options=options), options=options)
    for name, value in full_params(restored).items():
        assert torch.equal(value, full[name]), name


def _load(path: str) -> None:
    model, opt = _trained(0)
    _loss(model, _local(_batch(0))).backward()  # AdamW's state exists to be loaded into
    opt.step()
    opt.zero_grad()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    full, moments = torch.load(f"{path}/full.pt")
    for name, value in full_params(model).items():
        assert torch.equal(value, full[name]), name
    for key, value in opt.state[next(iter(model.parameters()))].items():
        if key != "step":
            assert value.to_local().dim() == 1
            assert torch.equal(value.full_tensor(), moments[key]), key
    _assert_cut_elementwise(model)


def _meta_init_matches_eager() -> None:
    # Each rank draws its element-wise slice of what a draw of the full tensor gives.
    torch.manual_seed(7)
    eager = _TwoWidths()
    with torch.device("meta"):
        model = _TwoWidths()
    fully_shard(model)
    model.to_empty(device="cpu")
    _assert_cut_elementwise(model)
    torch.manual_seed(7)
    for linear in (model.a, model.b):
        linear.reset_parameters()
    assert_matches(model, eager, "param", dict(rtol=0, atol=0))
    assert_sharded_views(model)


def test_elementwise_checkpoint_saved_at_2_ranks_loads_at_3(dist_run, tmp_path):
    dist_run(_save, 2, str(tmp_path))
    dist_run(_load, 3, str(tmp_path))


def test_elementwise_meta_init_matches_the_eager_model(dist_run):
    dist_run(_meta_init_matches_eager, 3)
