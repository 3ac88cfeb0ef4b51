"""vescale_plugins.fully_shard trains exactly what an unsharded model and FSDP2 train.

Each body runs on W gloo ranks. The reference is the same model on one process, fed the
global batch (so its gradient is the mean of the ranks' gradients, as DDP computes it).
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor

from tests.support.comm_counts import comm_counts
from tests.support.models import TwoBlocks, batch, clone, local_batch, loss_fn, make_decoder, reference_step
from tests.support.parity import (
    PARAM_TOL,
    TOL,
    adamw,
    assert_matches,
    assert_sharded_views,
    meta_init_sharded_decoder,
    reference_and_ours,
    reference_ours_and_fsdp2s,
    shard_decoder,
    sharded_step,
    step_and_zero,
    train_like_reference,
    train_together,
)
from tests.support.routed import RoutedExperts, assert_ddp_gradients, ddp_backward
from vescale_plugins import fully_shard

WORLD_SIZES = [1, 2, 3, 4]
STEPS = 5


# ----------------------------------------------------------------------------------
# parity with an unsharded model and with FSDP2
# ----------------------------------------------------------------------------------


def _parity_with_unsharded(reshard_after_forward):
    world = dist.get_world_size()
    reference, model = reference_and_ours(reshard_after_forward=reshard_after_forward)
    opt, ref_opt = adamw(model), adamw(reference)
    for step in range(STEPS):
        ref_loss = reference_step(reference, step, world)
        loss = sharded_step(model, step)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        assert_matches(model, reference, "grad")
        assert_sharded_views(model)
        step_and_zero(opt, ref_opt)
        assert_matches(model, reference, "param")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_trains_like_the_unsharded_model(dist_run, world):
    dist_run(_parity_with_unsharded, world, None)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_reshard_after_forward_true_and_false(dist_run, reshard_after_forward):
    dist_run(_parity_with_unsharded, 3, reshard_after_forward)


def _parity_with_fsdp2(mp_policy, offload_policy=None):
    offload_policy = offload_policy or OffloadPolicy()
    _, ours, theirs = reference_ours_and_fsdp2s(mp_policy=mp_policy, offload_policy=offload_policy)
    opt, their_opt = adamw(ours), adamw(theirs)
    tol = TOL if mp_policy.param_dtype is None else dict(rtol=2e-2, atol=2e-3)
    for step in range(STEPS):
        torch.testing.assert_close(sharded_step(ours, step), sharded_step(theirs, step), **tol)
        for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
            torch.testing.assert_close(
                p.grad.full_tensor(), q.grad.full_tensor(), **tol, msg=lambda m: f"grad {name}: {m}"
            )
        opt.step()
        their_opt.step()
        opt.zero_grad()
        their_opt.zero_grad()
        for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
            torch.testing.assert_close(
                p.full_tensor(),
                q.full_tensor(),
                **(PARAM_TOL if tol is TOL else tol),
                msg=lambda m: f"param {name}: {m}",
            )


@pytest.mark.parametrize("world", [2, 3])
def test_trains_like_torch_fsdp2_step_by_step(dist_run, world):
    dist_run(_parity_with_fsdp2, world, MixedPrecisionPolicy())


def test_mixed_precision_bf16_params_fp32_reduce_matches_fsdp2(dist_run):
    dist_run(_parity_with_fsdp2, 3, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


def test_cpu_offload_trains_like_fsdp2(dist_run):
    # pin_memory=False: what FSDP2 trains with where there is no accelerator (this machine)
    dist_run(_parity_with_fsdp2, 2, MixedPrecisionPolicy(), CPUOffloadPolicy(pin_memory=False))


def _mixed_precision_dtypes():
    model = shard_decoder(
        make_decoder(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    tokens, targets = local_batch(0)
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    loss_fn(logits, targets).backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert p.grad.dtype == torch.float32, name
    unit = model._vescale_fsdp_unit
    assert [b.param_dtype for b in unit.dbuffers] == [torch.bfloat16]
    assert [b.reduce_dtype for b in unit.dbuffers] == [torch.float32]


def test_mixed_precision_keeps_fp32_shards_and_grads(dist_run):
    dist_run(_mixed_precision_dtypes, 2)


# ----------------------------------------------------------------------------------
# gradient accumulation, frozen parameters, clipping
# ----------------------------------------------------------------------------------


def _gradient_accumulation_without_communication(keep_unsharded):
    """Micro-batch 0 accumulates locally (optionally keeping the units gathered, as FSDP2's
    ``set_reshard_after_backward(False)`` allows); micro-batch 1 syncs and reshards."""
    world = dist.get_world_size()
    reference, model = reference_and_ours()
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)
        model.set_reshard_after_backward(micro == 1 or not keep_unsharded)
        tokens, targets = local_batch(micro)
        loss = loss_fn(model(tokens), targets) / 2
        _, counts = comm_counts(loss.backward)
        blocks_gathered = [layer._vescale_fsdp_unit.is_unsharded for layer in model.layers]
        if micro == 0:
            assert "reduce_scatter" not in counts, counts
            assert blocks_gathered == [keep_unsharded] * len(model.layers)
            # Sharded parameters have no gradient yet (gathered blocks show their full ones).
            assert all(p.grad is None for p in model.parameters() if isinstance(p, DTensor))
        else:
            assert not any(blocks_gathered)
            # Who got gradients rides in the reduce-scatters: no other collective.
            assert counts.get("reduce_scatter") == len(model.layers) + 1, counts
            assert "all_reduce" not in counts, counts
    for micro in range(2):
        (reference_step(reference, micro, world) * 0).sum()
    # the reference accumulated two mean-loss gradients; ours accumulated halves
    for p in reference.parameters():
        p.grad /= 2
    assert_matches(model, reference, "grad")


@pytest.mark.parametrize("keep_unsharded", [False, True])
def test_gradient_accumulation_matches_one_big_batch(dist_run, keep_unsharded):
    dist_run(_gradient_accumulation_without_communication, 3, keep_unsharded)


def _frozen_parameters_inside_a_unit():
    reference = make_decoder()
    reference.layers[1].up.weight.requires_grad_(False)
    reference.norm.bias.requires_grad_(False)
    model = shard_decoder(clone(reference))

    def check_step(loss, reference_loss):
        assert model.layers[1].up.weight.grad is None
        assert model.norm.bias.grad is None
        assert_matches(model, reference, "grad")

    train_like_reference(model, reference, 3, check_step)


def test_frozen_parameters_inside_a_unit(dist_run):
    dist_run(_frozen_parameters_inside_a_unit, 3)


def _unused_parameters_inside_a_unit():
    """A parameter no gradient reaches keeps ``grad=None`` and its buffer slice (never written
    by a gradient) is zeroed before the reduce-scatter, so it cannot leak into its neighbours.
    A unit none of whose parameters gets a gradient is still reduced on every rank."""
    reference = make_decoder()
    reference.layers[0].unused = torch.nn.Linear(7, 5)  # registered last: lies after `down` in the buffer
    reference.layers[1].unused_first = torch.nn.Linear(3, 9)
    model = shard_decoder(clone(reference))

    def check_step(loss, reference_loss):
        assert model.layers[0].unused.weight.grad is None
        assert model.layers[1].unused_first.bias.grad is None
        assert_matches(model, reference, "grad")

    train_like_reference(model, reference, 3, check_step)


def test_unused_parameters_inside_a_unit(dist_run):
    dist_run(_unused_parameters_inside_a_unit, 3)


def _clip_grad_norm_parity():
    world = dist.get_world_size()
    reference, model = reference_and_ours()
    for step, norm_type in enumerate((2.0, float("inf"))):
        reference_step(reference, step, world)
        sharded_step(model, step)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type=norm_type)
        got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type=norm_type)
        torch.testing.assert_close(got.full_tensor(), want, **TOL)
        assert_matches(model, reference, "grad")
        for m in (model, reference):
            m.zero_grad()


def test_clip_grad_norm_parity(dist_run):
    dist_run(_clip_grad_norm_parity, 3)


# ----------------------------------------------------------------------------------
# block-wise shards, meta-device init
# ----------------------------------------------------------------------------------


class _Blocky(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(36, 64)
        self.b = torch.nn.Linear(64, 96)
        self.c = torch.nn.Linear(96, 32)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _thirty_two_row_blocks():
    world = dist.get_world_size()
    torch.manual_seed(0)
    reference = _Blocky()
    model = clone(reference)
    fully_shard(model, block_size_fn=lambda name, p: 32 if p.dim() == 2 else None)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            assert p.placements[0].local_units[dist.get_rank()] == p.to_local().shape[0] // 32, name
            assert p.to_local().shape[0] % 32 == 0, (name, p.to_local().shape)
            assert sum(p.placements[0].local_units) == p.shape[0] // 32
    g = torch.Generator().manual_seed(5)
    x = torch.randn(world * 4, 36, generator=g)
    rank = dist.get_rank()

    def backward(step):
        reference(x).square().mean().backward()
        model(x[rank * 4 : (rank + 1) * 4]).square().mean().backward()
        assert_matches(model, reference, "grad")

    train_together(model, reference, 3, backward)


@pytest.mark.parametrize("world", [2, 3])
def test_block_size_fn_keeps_32_row_blocks_whole(dist_run, world):
    dist_run(_thirty_two_row_blocks, world)


def _meta_device_init_matches_eager():
    eager = make_decoder(seed=7)
    model = meta_init_sharded_decoder()
    torch.manual_seed(7)
    model.reset_parameters()
    assert_matches(model, eager, "param", tol=dict(rtol=0, atol=0))
    assert_sharded_views(model)
    train_like_reference(model, eager, 2)


def test_meta_device_init_matches_the_eager_model(dist_run):
    dist_run(_meta_device_init_matches_eager, 3)


# ----------------------------------------------------------------------------------
# FSDP2 methods
# ----------------------------------------------------------------------------------


def _explicit_unshard_reshard_and_prefetch():
    world = dist.get_world_size()
    reference, model = reference_and_ours()
    layers = list(model.layers)
    for i, layer in enumerate(layers[:-1]):
        layer.set_modules_to_forward_prefetch([layers[i + 1]])
    for i, layer in enumerate(layers[1:], start=1):
        layer.set_modules_to_backward_prefetch([layers[i - 1]])
    handle = model.unshard(async_op=True)
    handle.wait()
    assert isinstance(model.embed.weight, torch.Tensor)
    assert not isinstance(model.embed.weight, DTensor)
    model.reshard()
    assert isinstance(model.embed.weight, DTensor)
    for unit_module in [*model.layers, model]:  # each unit's own factor, as FSDP2's
        unit_module.set_gradient_divide_factor(world * 2.0)
    opt, ref_opt = adamw(model), adamw(reference)
    for step in range(2):
        reference_step(reference, step, world)
        for p in reference.parameters():
            p.grad /= 2
        sharded_step(model, step)
        assert_matches(model, reference, "grad")
        step_and_zero(opt, ref_opt)


def test_unshard_reshard_prefetch_and_divide_factor(dist_run):
    dist_run(_explicit_unshard_reshard_and_prefetch, 3)


def _forward_method_registration():
    from vescale_plugins import register_fsdp_forward_method

    model = make_decoder()
    reference = clone(model)
    model.embed_only = lambda tokens: model.embed(tokens).sum(-1)
    reference.embed_only = lambda tokens: reference.embed(tokens).sum(-1)
    fully_shard(model)
    tokens, _ = local_batch(0)
    with pytest.raises(RuntimeError):
        model.embed_only(tokens)  # sharded DTensor weight, plain tokens: the unit never gathered
    register_fsdp_forward_method(model, "embed_only")
    torch.testing.assert_close(model.embed_only(tokens), reference.embed_only(tokens))
    model.reshard()
    assert isinstance(model.embed.weight, DTensor)


def test_register_fsdp_forward_method(dist_run):
    dist_run(_forward_method_registration, 2)


def _eval_forward_then_state_dict_and_dtype_change():
    model = shard_decoder(make_decoder())
    tokens, _ = local_batch(0)
    with torch.no_grad():
        model(tokens)
    assert all(isinstance(v, DTensor) for k, v in model.state_dict().items() if k != "position_scale")
    model.unshard()  # explicitly gathered: state_dict() still reports the sharded parameters
    assert isinstance(model.state_dict()["embed.weight"], DTensor)

    reference = make_decoder().to(torch.bfloat16)
    model.to(torch.bfloat16)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.dtype == torch.bfloat16, name
        assert p._local_tensor.dtype == torch.bfloat16, name
        assert torch.equal(p.full_tensor(), q), name
    assert_sharded_views(model)
    loss_fn(model(tokens), local_batch(0)[1]).backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_eval_forward_state_dict_and_dtype_change(dist_run):
    dist_run(_eval_forward_then_state_dict_and_dtype_change, 3)


def _synchronous_reduce_scatter_gives_the_same_gradients():
    import vescale_plugins.dbuffer.buffer as dbuffer_module

    world = dist.get_world_size()
    reference, model = reference_and_ours()
    original = dbuffer_module.DBuffer.reduce_scatter
    dbuffer_module.DBuffer.reduce_scatter = lambda self, factor, accumulate, async_op=False, **kwargs: original(
        self, factor, accumulate, async_op=False, **kwargs
    )
    try:
        for step in range(2):
            reference_step(reference, step, world)
            sharded_step(model, step)
            assert_matches(model, reference, "grad")
            assert_sharded_views(model)
            for m in (model, reference):
                m.zero_grad()
    finally:
        dbuffer_module.DBuffer.reduce_scatter = original


def test_synchronous_reduce_scatter_gives_the_same_gradients(dist_run):
    dist_run(_synchronous_reduce_scatter_gives_the_same_gradients, 3)


class _RoutedModel(torch.nn.Module):
    def __init__(self, vocab=101, dim=12, experts=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.moe = RoutedExperts(dim, experts)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        route = int(tokens[0, 0]) % len(self.moe.experts)
        return self.out(self.moe(self.embed(tokens), route))


def _routed_batch(step, world, per_rank=2):
    """Rank r's first token routes it to expert r % 3 (at W=2, expert 2 gets no data)."""
    tokens, targets = batch(step, world, per_rank)
    for r in range(world):
        tokens[r * per_rank, 0] = r + 3 * step
    return tokens, targets


def _gradients_from_other_ranks_only():
    """By default, a parameter this rank's data never reached gets the other ranks' gradient
    (as DDP's ``find_unused_parameters=True``), and one no rank's data reached keeps
    ``grad=None`` on every rank (the optimizer skips it), with no collective beyond the
    reduce-scatters (the presence flags ride in them)."""
    world, rank, per_rank = dist.get_world_size(), dist.get_rank(), 2
    torch.manual_seed(0)
    reference = _RoutedModel()
    model = clone(reference)
    fully_shard(model.moe)
    fully_shard(model)

    def backward(step):
        tokens, targets = _routed_batch(step, world, per_rank)
        ddp_backward(reference, tokens, targets, per_rank)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        _, counts = comm_counts(loss_fn(model(tokens[rows]), targets[rows]).backward)
        assert "all_reduce" not in counts, counts
        assert counts.get("reduce_scatter") == 2, counts
        assert_ddp_gradients(model, reference)

    train_together(model, reference, 3, backward)


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_of_parameters_other_ranks_used(dist_run, world):
    dist_run(_gradients_from_other_ranks_only, world)


def _fused_adamw_matches_unfused():
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        model = TwoBlocks()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused)
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append({name: p.full_tensor() for name, p in model.named_parameters()})
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(600)
def test_fused_adamw_matches_unfused_on_sharded_parameters(dist_run):
    dist_run(_fused_adamw_matches_unfused, 2, timeout=300)
