"""FSDP2's behaviour at the edges users rely on: tied weights across units, the gradient divide
factor's scope, accumulation in the reduce dtype, a grouped head called per chunk, parameters
replaced after ``fully_shard``, post-accumulate-grad hooks, 0-dim, non-contiguous and
zero-size parameters, ``reset_iter_state()`` after an exception, two backwards through one
forward, and a unit run again after its post-backward.

Each case is checked against FSDP2 itself in the same body (and against an unsharded model
where FSDP2 has no behaviour of its own to match).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from tests.support import models
from tests.support.models import clone, local_batch, loss_fn, make_decoder, reference_step
from tests.support.parity import (
    PARAM_TOL,
    TOL,
    adamw,
    assert_matches,
    meta_init_sharded_decoder,
    reference_ours_and_fsdp2s,
    shard_decoder,
    sharded_step,
    step_and_zero,
    train_like_reference,
)
from vescale_plugins import fully_shard


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_same_grads(ours, theirs, tol=TOL):
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(_full(p.grad), _full(q.grad), **tol, msg=lambda m: f"grad {name}: {m}")


# ----------------------------------------------------------------------------------
# a weight tied across sibling units
# ----------------------------------------------------------------------------------


def _tied_weight_across_sibling_units():
    for shard in (torch_fully_shard, fully_shard):
        model = make_decoder()  # head.weight is embed.weight
        shard(model.embed)
        if shard is torch_fully_shard:
            # FSDP2 refuses at the root's first forward, before any collective.
            shard(model.head)
            shard(model)
            with pytest.raises(ValueError, match="shared with a parameter already managed by another FSDP group"):
                model(local_batch(0)[0])
            continue
        with pytest.raises(
            ValueError,
            match=r"'weight' of the Linear module is shared with 'weight' of the Embedding unit.*fully_shard\(\[module_a, module_b\]\)",
        ):
            shard(model.head)
    # Both in one unit: tied, trains like the unsharded model.
    world = dist.get_world_size()
    reference = make_decoder()
    model = clone(reference)
    fully_shard([model.embed, model.head])
    shard_decoder(model)
    assert model.head.weight is model.embed.weight
    opt, ref_opt = adamw(model), adamw(reference)
    for step in range(2):
        reference_step(reference, step, world)
        sharded_step(model, step)
        step_and_zero(opt, ref_opt)
        assert model.head.weight is model.embed.weight
    assert_matches(model, reference, "param")


def test_weight_tied_across_sibling_units_is_refused_or_grouped(dist_run):
    dist_run(_tied_weight_across_sibling_units, 2)


# ----------------------------------------------------------------------------------
# set_gradient_divide_factor applies to the unit it is called on
# ----------------------------------------------------------------------------------


def _divide_factor_scope():
    reference, ours, theirs = reference_ours_and_fsdp2s()
    theirs.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    for model in (ours, theirs):
        model.set_gradient_divide_factor(1.0)  # the root only: sums there, means below
        sharded_step(model, 0)
    _assert_same_grads(ours, theirs)
    # and it differs from the default on the root's parameters only
    plain = shard_decoder(clone(reference))
    sharded_step(plain, 0)
    world = dist.get_world_size()
    torch.testing.assert_close(_full(ours.norm.weight.grad), _full(plain.norm.weight.grad) * world, **TOL)
    torch.testing.assert_close(
        _full(ours.layers[0].up.weight.grad), _full(plain.layers[0].up.weight.grad), rtol=0, atol=0
    )


def test_gradient_divide_factor_is_scoped_to_its_unit_as_in_fsdp2(dist_run):
    dist_run(_divide_factor_scope, 2)


# ----------------------------------------------------------------------------------
# accumulation without sync happens in the reduce dtype
# ----------------------------------------------------------------------------------


def _accumulate_in_reduce_dtype():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _, ours, theirs = reference_ours_and_fsdp2s(mp_policy=mp)
    micro_batches = 4
    for model in (ours, theirs):
        for micro in range(micro_batches):
            model.set_requires_gradient_sync(micro == micro_batches - 1)
            tokens, targets = local_batch(micro)
            (loss_fn(model(tokens), targets) / micro_batches).backward()
    # Same arithmetic as FSDP2 (fp32 accumulators of bf16 gradients): equal to fp32 rounding.
    _assert_same_grads(ours, theirs, tol=dict(rtol=1e-5, atol=1e-7))


def test_accumulation_without_sync_happens_in_reduce_dtype_as_fsdp2(dist_run):
    dist_run(_accumulate_in_reduce_dtype, 2)


# ----------------------------------------------------------------------------------
# a grouped head unit skipped in forward and called per chunk (torchtitan's chunked loss)
# ----------------------------------------------------------------------------------


class ChunkedHeadDecoder(models.Decoder):
    """Forward stops after the final norm; the loss calls the (untied) head per chunk."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(models.HIDDEN, models.VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) * self.position_scale[:, : tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def _chunked_loss(model, tokens, targets, chunks=3):
    hidden = model(tokens)
    total = 0
    for h, t in zip(hidden.chunk(chunks, dim=1), targets.chunk(chunks, dim=1)):
        total = total + F.cross_entropy(model.head(h).float().flatten(0, 1), t.flatten(), reduction="sum")
    return total / targets.numel()


def _chunked_head(reshard_after_forward):
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = ChunkedHeadDecoder()
    models_ = {}
    for name, shard in (("ours", fully_shard), ("theirs", torch_fully_shard)):
        model = clone(reference)
        for layer in model.layers:
            shard(layer)
        shard([model.norm, model.head], reshard_after_forward=reshard_after_forward)
        shard(model)
        models_[name] = model
    opts = [adamw(m) for m in (reference, *models_.values())]
    for step in range(3):
        tokens, targets = models.batch(step, world)
        for r in range(world):
            rows = slice(2 * r, 2 * r + 2)
            (_chunked_loss(reference, tokens[rows], targets[rows]) / world).backward()
        for model in models_.values():
            rows = slice(2 * rank, 2 * rank + 2)
            _chunked_loss(model, tokens[rows], targets[rows]).backward()
        assert_matches(models_["ours"], reference, "grad")
        _assert_same_grads(models_["ours"], models_["theirs"])
        step_and_zero(*opts)
    assert_matches(models_["ours"], reference, "param")


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_chunked_head_in_a_grouped_unit_matches_unsharded_and_fsdp2(dist_run, reshard_after_forward):
    dist_run(_chunked_head, 2, reshard_after_forward)


# ----------------------------------------------------------------------------------
# parameters replaced after fully_shard (meta init, then assign)
# ----------------------------------------------------------------------------------


def _replaced_after_meta_init(how):
    eager = make_decoder(seed=5)
    model = meta_init_sharded_decoder()
    if how == "assign":
        # A sharded state dict of the same layout, loaded by assignment (DCP's pattern).
        source = shard_decoder(clone(eager))
        model.load_state_dict(get_model_state_dict(source), assign=True)
    else:
        # Plain full tensors assigned to the modules, as users of HF-style init do.
        for (name, module), (_, eager_module) in zip(model.named_modules(), eager.named_modules()):
            for pname, p in list(module._parameters.items()):
                if p is not None and name.split(".")[-1:] != ["head"]:
                    setattr(module, pname, nn.Parameter(eager_module._parameters[pname].detach().clone()))
        model.head.weight = model.embed.weight
        model.position_scale.copy_(eager.position_scale)
    train_like_reference(model, eager, 2)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        assert p.device.type == "cpu", name


@pytest.mark.parametrize("how", ["assign", "setattr"])
def test_parameters_replaced_after_fully_shard_are_adopted(dist_run, how):
    dist_run(_replaced_after_meta_init, 3, how)


# ----------------------------------------------------------------------------------
# post-accumulate-grad hooks on sharded parameters (optimizer in backward)
# ----------------------------------------------------------------------------------


def _optimizer_in_backward(model):
    """One AdamW per parameter, stepped from the parameter's post-accumulate-grad hook."""
    optimizers = {p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, eps=1e-6) for p in model.parameters()}

    def step(param):
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)


def _post_accumulate_grad_hooks():
    world = dist.get_world_size()
    reference, ours, theirs = reference_ours_and_fsdp2s()
    for model in (ours, theirs):
        _optimizer_in_backward(model)
    ref_opt = adamw(reference)
    for step in range(3):
        reference_step(reference, step, world)
        step_and_zero(ref_opt)
        for model in (ours, theirs):
            sharded_step(model, step)
            assert all(p.grad is None for p in model.parameters())  # stepped and zeroed in backward
        assert_matches(ours, reference, "param")
        for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
            torch.testing.assert_close(p.full_tensor(), q.full_tensor(), **PARAM_TOL, msg=lambda m: f"{name}: {m}")


def test_post_accumulate_grad_hooks_run_on_reduced_sharded_gradients(dist_run):
    dist_run(_post_accumulate_grad_hooks, 2)


# ----------------------------------------------------------------------------------
# parameters FSDP2 refuses: 0-dim and non-contiguous (we shard them; exactly)
# ----------------------------------------------------------------------------------


class _OddParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-dim
        self.weight = nn.Parameter(torch.randn(13, 7).t())  # non-contiguous (7, 13)
        self.bias = nn.Parameter(torch.randn(13))

    def forward(self, x):
        return self.scale * (x @ self.weight) + self.bias


def _odd_parameters():
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = _OddParams()
    model = clone(reference)
    assert not model.weight.is_contiguous()
    fully_shard(model)
    opt, ref_opt = adamw(model), adamw(reference)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(world * 2, 7, generator=g)
        for r in range(world):
            (reference(x[2 * r : 2 * r + 2]).square().mean() / world).backward()
        model(x[2 * rank : 2 * rank + 2]).square().mean().backward()
        assert_matches(model, reference, "grad")
        step_and_zero(opt, ref_opt)
        assert_matches(model, reference, "param")
    assert model.scale.full_tensor().dim() == 0


@pytest.mark.parametrize("world", [2, 3])
def test_zero_dim_and_non_contiguous_parameters_train_exactly(dist_run, world):
    dist_run(_odd_parameters, world)


# ----------------------------------------------------------------------------------
# zero-size parameters, which FSDP2 accepts: they shard to nothing and train alongside the rest
# ----------------------------------------------------------------------------------


class _WithEmpty(nn.Module):
    """A model with zero-size parameters (an empty prefix table, a zero-width adapter)."""

    def __init__(self, use_empty: bool) -> None:
        super().__init__()
        self.use_empty = use_empty
        self.first = nn.Linear(6, 5)
        self.empty_rows = nn.Parameter(torch.empty(0, 5))
        self.empty_cols = nn.Parameter(torch.empty(5, 0))
        self.second = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.use_empty:  # gradients of zero elements (FSDP2's backward refuses these)
            h = h + self.empty_rows.sum() + (h @ self.empty_cols).sum()
        return self.second(h)


def _zero_size_batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))


def _train_with_empty(shard, use_empty, steps=2):
    torch.manual_seed(0)
    model = _WithEmpty(use_empty)
    if shard is None:  # the unsharded reference: the mean of every rank's loss
        losses = lambda step: torch.stack(
            [model(_zero_size_batch(step, r)).square().mean() for r in range(dist.get_world_size())]
        ).mean()
    else:
        shard(model.first)
        shard(model)
        losses = lambda step: model(_zero_size_batch(step, dist.get_rank())).square().mean()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(steps):
        losses(step).backward()
        opt.step()
        opt.zero_grad()
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for name, p in model.named_parameters()}


def _assert_same_trained(ours, theirs):
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert ours[name].shape == theirs[name].shape, name
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6)
    assert ours["empty_rows"].shape == (0, 5)
    assert ours["empty_cols"].shape == (5, 0)


def _zero_size_parameters_match_fsdp2_and_unsharded():
    _assert_same_trained(
        _train_with_empty(fully_shard, use_empty=False), _train_with_empty(torch_fully_shard, use_empty=False)
    )
    _assert_same_trained(_train_with_empty(fully_shard, use_empty=True), _train_with_empty(None, use_empty=True))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_zero_size_parameters_train_like_fsdp2(dist_run, world):
    dist_run(_zero_size_parameters_match_fsdp2_and_unsharded, world)


# ----------------------------------------------------------------------------------
# reset_iter_state() after an exception mid-forward or mid-backward
# ----------------------------------------------------------------------------------


class _Boom(RuntimeError):
    pass


def _raise_in_backward(grad):
    raise _Boom("backward")


def _fail_in_forward(model, tokens, targets):
    handle = model.layers[1].register_forward_hook(lambda *a: (_ for _ in ()).throw(_Boom("forward")))
    try:
        model(tokens)
    finally:
        handle.remove()


def _fail_in_backward(model, tokens, targets):
    out = model(tokens)
    out.register_hook(_raise_in_backward)
    loss_fn(out, targets).backward()


def _recovery_after_exceptions():
    world = dist.get_world_size()
    reference, ours, theirs = reference_ours_and_fsdp2s()
    opts = [adamw(m) for m in (reference, ours, theirs)]
    for step in range(4):
        if step in (1, 2):  # every rank fails at the same point, in forward then in backward
            for model in (ours, theirs):
                tokens, targets = local_batch(step)
                fail, where = (_fail_in_forward, "forward") if step == 1 else (_fail_in_backward, "backward")
                with pytest.raises(_Boom, match=where):
                    fail(model, tokens, targets)
                model.reset_iter_state()
                for p in model.parameters():
                    p.grad = None
            continue
        reference_step(reference, step, world)
        sharded_step(ours, step)
        sharded_step(theirs, step)
        step_and_zero(*opts)
    assert_matches(ours, reference, "param")
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), **PARAM_TOL, msg=lambda m: f"{name}: {m}")
    with pytest.raises(RuntimeError, match="root"):
        ours.layers[0].reset_iter_state()


def test_reset_iter_state_recovers_after_an_exception_as_fsdp2(dist_run):
    dist_run(_recovery_after_exceptions, 2)


# ----------------------------------------------------------------------------------
# two backward passes through one forward (retain_graph=True)
# ----------------------------------------------------------------------------------


def _two_backwards_through_one_forward():
    world = dist.get_world_size()
    reference, ours, theirs = reference_ours_and_fsdp2s()
    tokens, targets = local_batch(0)
    for model in (ours, theirs):
        loss = loss_fn(model(tokens), targets)
        loss.backward(retain_graph=True)
        loss.backward()  # each unit gathers and reduces again; the gradients accumulate
    for _ in range(2):
        reference_step(reference, 0, world)
    assert_matches(ours, reference, "grad")
    _assert_same_grads(ours, theirs)
    # and the next forward and backward run as usual
    torch.testing.assert_close(sharded_step(ours, 1), sharded_step(theirs, 1), **TOL)
    _assert_same_grads(ours, theirs)


@pytest.mark.parametrize("world", [2, 3])
def test_two_backwards_through_one_forward_accumulate_as_fsdp2(dist_run, world):
    dist_run(_two_backwards_through_one_forward, world, timeout=120)


# ----------------------------------------------------------------------------------
# a unit run again in forward after its post-backward can run (PyTorch's pre-2.13
# test_fully_shard_compile.py nested model, run eagerly)
# ----------------------------------------------------------------------------------


class _Reused(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.param1 = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.param2 = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return torch.relu(torch.matmul(x, self.param1) * self.param2)


class _ReusingModel(nn.Module):
    """Each layer twice in a row, then all layers twice: the first call of each layer takes
    an input that needs no gradient only for the first layer, whose post-backward (reached
    through its second call's inputs) therefore comes before its first call's backward."""

    def __init__(self, dim: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Reused(dim) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(layer(x))
        for _ in range(2):
            for layer in self.layers:
                x = layer(x)
        return x


def _unit_run_again_after_its_post_backward(reshard_after_forward):
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = _ReusingModel()
    models = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("ours", fully_shard)):
        model = clone(reference)
        for layer in model.layers:
            shard(layer, reshard_after_forward=reshard_after_forward)
        shard(model, reshard_after_forward=reshard_after_forward)
        models[name] = (model, torch.optim.Adam(model.parameters(), lr=1e-2))
    ref_optim = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        losses = {}
        for name, (model, _) in models.items():
            losses[name] = model(x).sum()
            losses[name].backward()
        ref_loss = reference(x).sum()
        ref_loss.backward()
        for p in reference.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        for name, (model, _) in models.items():
            torch.testing.assert_close(losses[name], ref_loss, **TOL)
            for (pname, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(_full(p.grad), q.grad, **TOL, msg=lambda m: f"{name} grad {pname}: {m}")
        for optim in (ref_optim, *(optim for _, optim in models.values())):
            optim.step()
            optim.zero_grad()
    for (pname, p), q in zip(models["ours"][0].named_parameters(), models["fsdp2"][0].parameters(), strict=True):
        torch.testing.assert_close(_full(p), _full(q), **PARAM_TOL, msg=lambda m: f"param {pname}: {m}")


@pytest.mark.parametrize(("world", "reshard_after_forward"), [(2, True), (3, False)])
def test_unit_run_again_after_its_post_backward_matches_fsdp2_and_unsharded(dist_run, world, reshard_after_forward):
    dist_run(_unit_run_again_after_its_post_backward, world, reshard_after_forward, timeout=120)


class _Routed(nn.Module):
    """One of two weights per call, as the parent routes it (different on each rank)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.b = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.route = 0

    def forward(self, x):
        return torch.tanh(x @ (self.a if self.route == 0 else self.b))


class _RoutedTwice(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.layer = _Routed(dim)

    def forward(self, x):
        route = dist.get_rank() % 2
        self.layer.route = route
        x = self.layer(x)
        self.layer.route = 1 - route
        return self.layer(x)


def _routed_unit_run_again_after_its_post_backward():
    """The unit's first reduction in backward carries, on each rank, one weight's gradient
    from this rank and the other's from other ranks only; the second adds the rest. Checked
    against the unsharded model (FSDP2 cannot route per rank: its reduce-scatter inputs
    would differ in size between ranks)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    reference = _RoutedTwice()
    model = clone(reference)
    fully_shard(model.layer)
    fully_shard(model)
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).sum()
        loss.backward()
        ref_loss = reference(x).sum()
        ref_loss.backward()
        for p in reference.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(_full(p.grad), q.grad, **TOL, msg=lambda m: f"grad {name}: {m}")
        model.zero_grad()
        reference.zero_grad()


@pytest.mark.parametrize("world", [2, 3])
def test_routed_unit_run_again_after_its_post_backward_matches_unsharded(dist_run, world):
    dist_run(_routed_unit_run_again_after_its_post_backward, world, timeout=120)
