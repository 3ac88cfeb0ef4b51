"""FSDP2's all-gather extensions (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) train as
under FSDP2, and what veScale-FSDP does not run is refused on every rank, naming the parameter.

The weights are float8-style (one scale per tensor, data gathered in float8) and MXFP8-style
(per-block scales of 32 along the last dim, gathered as a second input of 1/32 the data's
numel) from ``tests/support/extension_tensors.py``; FSDP2 runs the same model in the same
process. Shapes are uneven (rows that W does not divide); FSDP2 is given padded inputs, as it
asks of an unevenly sharded parameter.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from tests.support.extension_tensors import BLOCK, Float8Weight, MXFP8Weight
from tests.support.parity import EXACT, PARAM_TOL, TOL
from vescale_plugins import fully_shard
from vescale_plugins.runtime.registry import fsdp_param_of

STEPS = 3
T = 120


UNEVEN = (64, 97, 64, 33)  # rows W=2 and W=3 do not divide
EVEN = (64, 96, 96, 30)  # FSDP2 cannot gather per-block scales of unevenly sharded rows


def _model(weight_cls, pad_to_chunks, dims):
    """Linears of ``dims``; every weight whose last dim the block divides (all for float8) is
    a ``weight_cls``; biases stay plain (another DBuffer of the unit)."""
    torch.manual_seed(0)
    layers = []
    for d_in, d_out in zip(dims, dims[1:]):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    for linear in model[::2]:
        if weight_cls is Float8Weight or linear.weight.shape[-1] % BLOCK == 0:
            linear.weight = nn.Parameter(weight_cls(linear.weight.detach().clone(), pad_to_chunks))
    return model


def _plain_value(tensor):
    """The full-precision values a weight wraps (ours, torchao's) or the tensor itself."""
    for inner in ("_data", "_tensor"):
        if hasattr(tensor, inner):
            return getattr(tensor, inner)
    return tensor


def _plain(tensor):
    return _plain_value(tensor._local_tensor)


def _full(param):
    """The flat parameter from its plain local shards (a collective): each rank holds a run of
    whole rows, in rank order, in both engines' layouts."""
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, _plain(param).detach().reshape(-1).clone())
    return torch.cat(pieces)


def _train(shard, weight_cls, pad_to_chunks, mp_policy, reshard_after_forward):
    model = _model(weight_cls, pad_to_chunks, UNEVEN if weight_cls is Float8Weight else EVEN)
    for linear in model[::2]:
        shard(linear, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    shard(model, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    torch.manual_seed(1 + dist.get_rank())
    for step in range(STEPS):
        loss = model(torch.randn(4, 64)).float().pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return model, losses


def _trains_like_fsdp2(weight_cls, mp, reshard_after_forward=True):
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if mp else MixedPrecisionPolicy()
    ours, our_losses = _train(fully_shard, weight_cls, False, mp_policy, reshard_after_forward)
    theirs, their_losses = _train(torch_fully_shard, weight_cls, True, mp_policy, reshard_after_forward)
    extended = [n for n, p in ours.named_parameters() if isinstance(p._local_tensor, weight_cls)]
    assert len(extended) == 3, extended
    # Exact at W=2; at W=3 our point-to-point reduce-scatter sums the ranks' gradients in
    # another order than gloo's (FSDP2's), as in every parity test with FSDP2.
    exact = dist.get_world_size() == 2
    loss_tol, param_tol = (EXACT, EXACT) if exact else (TOL, PARAM_TOL)
    if mp:
        loss_tol = param_tol = dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(our_losses, their_losses, **loss_tol)
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(_full(p), _full(q), **param_tol, msg=lambda m: f"{name}: {m}")


def _gathered_from_views_of_buffers_per_kind():
    """Uneven rows, MXFP8: the data and the scales each sit in a persistent buffer of their own
    numel; the gathered weight (made from views of them) is what quantising the full weight
    gives; nothing gathers the fp32 weights."""
    model = _model(MXFP8Weight, False, UNEVEN)
    wanted = {}
    for name, p in model.named_parameters():
        if isinstance(p, MXFP8Weight):
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            inputs, metadata = p.fsdp_pre_all_gather(mesh, p.shape, p.stride(), None, MixedPrecisionPolicy())
            wanted[name] = p._dequantise(inputs, metadata, torch.float32)
    fully_shard(model, reshard_after_forward=False)
    model(torch.randn(2, 64)).sum().backward()
    unit = model._vescale_fsdp_unit
    (extended,) = [b for b in unit.buffers if b.extensions is not None]
    data, scales = (buffer for buffer, _ in extended.extensions.inputs)
    assert (data.dtype, scales.dtype) == (torch.float8_e4m3fn, torch.float8_e8m0fnu)
    assert data.shard_size == BLOCK * scales.shard_size
    assert not extended.dbuffer.is_unsharded  # the fp32 weights were never gathered
    assert extended.dbuffer.sharded.untyped_storage().size() == 0  # they live in the weights' own storage
    for p in extended.params:
        assert p.owns_local
        assert fsdp_param_of(p.sharded) is p
    model.unshard()
    for name, value in wanted.items():
        torch.testing.assert_close(model.get_parameter(name), value, **EXACT)
        assert data.holds(model.get_parameter(name)) is False  # dequantised into its own tensor


def _padded_inputs_are_refused_on_every_rank():
    """Rank 0 holds 17 of the 97 rows: its extension pads them to FSDP2's 49-row chunk, which we
    refuse, saying why. Rank 1 holds 80 rows, more than the chunk: the extension itself fails,
    and each rank raises its own error before any all-gather."""
    model = _model(Float8Weight, True, UNEVEN)  # pads to FSDP2's chunk: not this rank's rows
    fully_shard(model)
    expected = {
        0: (ValueError, r"parameter '0\.weight': fsdp_pre_all_gather returned an all-gather input of shape \(49, 64\)"),
        1: (RuntimeError, r"The size of tensor a \(49\) must match the size of tensor b \(80\)"),
    }
    error_type, message = expected[dist.get_rank()]
    with pytest.raises(error_type, match=message) as raised:
        model(torch.randn(2, 64))
    assert type(raised.value) is error_type


def _extensions_get_fsdp2s_arguments():
    """Monkey-patched on plain local shards (views of the DBuffer) after fully_shard: each
    pre-all-gather gets the shard mesh, the full size and contiguous stride, the owning module
    and the policy, as FSDP2 passes them."""
    calls = []

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls.append((mesh, tuple(outer_size), tuple(outer_stride), module, mp_policy))
        return (self,), None

    def post(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (tensor,) = all_gather_outputs
        return None if out is not None else (tensor, (tensor,))

    model = nn.Sequential(nn.Linear(3, 9), nn.Linear(9, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    policy = MixedPrecisionPolicy()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for p in model.parameters():
        p._local_tensor.fsdp_pre_all_gather = pre.__get__(p._local_tensor)
        p._local_tensor.fsdp_post_all_gather = post.__get__(p._local_tensor)
    model(torch.randn(2, 3))
    want = {((9, 3), (3, 1), 0), ((9,), (1,), 0), ((3, 9), (9, 1), 1), ((3,), (1,), 1)}
    assert {(size, stride, list(model).index(module)) for _, size, stride, module, _ in calls} == want
    assert all(m is mesh and mp is policy for m, _, _, _, mp in calls)
    for p, value in zip(model.parameters(), reference):  # gathered through the extension
        torch.testing.assert_close(p, value, **EXACT)


def _torchao_float8_trains_like_replicated(precompute_scales):
    """torchao's float8 training with ``enable_fsdp_float8_all_gather=True`` (its
    ``WeightWithDynamicFloat8CastTensor``), against the same model replicated with its
    gradients all-reduced: FSDP2 itself cannot run it on gloo (no float8 collectives); ours
    gathers the float8 bytes. The weight's scale is the global amax either way, so the float8
    weights, and the steps, are the same (exactly at W=2)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.ReLU(), nn.Linear(96, 48, bias=False))
        return convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))

    ours, reference = build(), build()
    for linear in ours[::2]:
        fully_shard(linear)
    fully_shard(ours)
    assert all(type(p._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor" for p in ours.parameters())
    opt, ref_opt = torch.optim.AdamW(ours.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    world = dist.get_world_size()
    tol, param_tol = (EXACT, EXACT) if world == 2 else (TOL, PARAM_TOL)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(STEPS):
        batch = torch.randn(4, 64)
        loss, ref_loss = (model(batch).float().pow(2).mean() for model in (ours, reference))
        loss.backward()
        ref_loss.backward()
        for p in reference.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        torch.testing.assert_close(loss, ref_loss, **tol)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if precompute_scales:  # torchtitan's default: one all-reduce for every scale
            precompute_float8_dynamic_scale_for_fsdp(ours)
    for (name, p), q in zip(ours.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(_full(p), _plain_value(q).reshape(-1), **param_tol, msg=lambda m: f"{name}: {m}")


class _PreOnly(torch.Tensor):
    def fsdp_pre_all_gather(self, mesh):
        return (self,), None


def _setup_refusals():
    half = nn.Linear(4, 4)
    half.weight = nn.Parameter(half.weight.detach().as_subclass(_PreOnly))
    with pytest.raises(ValueError, match="'weight'.*both fsdp_pre_all_gather and fsdp_post_all_gather"):
        fully_shard(half)
    model = _model(Float8Weight, False, UNEVEN)
    with pytest.raises(NotImplementedError, match="'0.weight'.*reshard_after_forward=<int>"):
        fully_shard(model, reshard_after_forward=2)


# -- the cases, grouped by world size (one pool of ranks per size) ---------------------


def test_extensions_get_fsdp2s_arguments(dist_run):
    dist_run(_extensions_get_fsdp2s_arguments, 2, timeout=T)


def test_inputs_padded_to_fsdp2_chunks_are_refused_on_every_rank(dist_run):
    dist_run(_padded_inputs_are_refused_on_every_rank, 2, timeout=T)


@pytest.mark.parametrize("weight_cls", [Float8Weight, MXFP8Weight], ids=["float8", "mxfp8"])
def test_extension_weights_with_mixed_precision_kept_after_forward_train_like_fsdp2(dist_run, weight_cls):
    dist_run(_trains_like_fsdp2, 2, weight_cls, True, False, timeout=T)


def test_torchao_float8_all_gather_with_dynamic_scales_trains_like_replicated(dist_run):
    dist_run(_torchao_float8_trains_like_replicated, 2, False, timeout=T)


@pytest.mark.parametrize("weight_cls", [Float8Weight, MXFP8Weight], ids=["float8", "mxfp8"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_extension_weights_train_like_fsdp2(dist_run, world_size, weight_cls):
    dist_run(_trains_like_fsdp2, world_size, weight_cls, False, timeout=T)


def test_mxfp8_gathered_from_views_of_buffers_per_kind(dist_run):
    dist_run(_gathered_from_views_of_buffers_per_kind, 3, timeout=T)


def test_torchao_float8_all_gather_with_precomputed_scales_trains_like_replicated(dist_run):
    dist_run(_torchao_float8_trains_like_replicated, 3, True, timeout=T)


def test_unsupported_extensions_are_refused_at_fully_shard(dist_run):
    dist_run(_setup_refusals, 4, timeout=T)
