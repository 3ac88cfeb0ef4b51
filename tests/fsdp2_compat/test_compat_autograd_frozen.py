"""test_fully_shard_autograd.py and test_fully_shard_frozen.py (FSDP2) on CPU/gloo.

The frozen cases' checks of FSDP2 internals (the numel passed to the patched
``dist.reduce_scatter_tensor`` and the call count of FSDP2's private
``RegisterPostBackwardFunction.backward``) run for ``--fsdp-impl=torch`` only: they
observe how FSDP2 is built, not what it computes (listed in the README). Every parity
assertion runs for both.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import checkpoint, replicate
from torch.nn.parallel.scatter_gather import _is_namedtuple
from torch.testing._internal.common_fsdp import MLP, DoubleLinear, check_sharded_parity

from ._compat import api, tc

T = 180
vescale_xfail = lambda reason: pytest.mark.vescale_xfail(reason)
RAF = [True, False, 2]


def _world(reshard_after_forward) -> int:
    return 4 if reshard_after_forward == 2 else 2  # 2 must be a proper divisor of the group


def _reduce_1d_partial_grads(module: nn.Module) -> None:
    for param in module.parameters():
        if param.grad is not None:
            param.grad.div_(dist.get_world_size())


# -- TestFullyShardAutograd --------------------------------------------------------------


def _unused_forward_output(impl, reshard_after_forward):
    A = api(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    local_batch_size = 2
    global_batch_size, dim = world_size * local_batch_size, 24
    model = DoubleLinear(dim=dim, use_second_linear=True)
    ref_model = copy.deepcopy(model)
    A.fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
    A.fully_shard(model, reshard_after_forward=reshard_after_forward)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)  # same on all ranks
    for iter_idx in range(10):
        global_inp = torch.rand((global_batch_size, dim))
        local_inp = global_inp[rank * local_batch_size : (rank + 1) * local_batch_size].detach()
        out1, out2 = model(local_inp)
        loss = (out1 * out2).sum() if iter_idx < 3 else out1.sum()
        loss.backward()
        optim.step()
        ref_out1, ref_out2 = ref_model(global_inp)
        ref_loss = (ref_out1 * ref_out2).sum() if iter_idx < 3 else ref_out1.sum()
        ref_loss.backward()
        _reduce_1d_partial_grads(ref_model)
        ref_optim.step()
        dist.all_reduce(loss)  # partial -> replicated
        tc.assertEqual(loss, ref_loss)
        optim.zero_grad(set_to_none=(iter_idx % 2))
        ref_optim.zero_grad(set_to_none=(iter_idx % 2))
        check_sharded_parity(tc, ref_model, model)


@pytest.mark.parametrize("reshard_after_forward", RAF)
def test_unused_forward_output(dist_run, impl, reshard_after_forward):
    dist_run(_unused_forward_output, _world(reshard_after_forward), impl, reshard_after_forward, timeout=T)


def _unused_forward_module(impl, reshard_after_forward):
    A = api(impl)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    local_batch_size, dim = 2, 24
    global_batch_size = world_size * local_batch_size
    model = DoubleLinear(dim=dim, use_second_linear=False)
    ref_model = copy.deepcopy(model)
    A.fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
    A.fully_shard(model.lin2, reshard_after_forward=reshard_after_forward)
    A.fully_shard(model, reshard_after_forward=reshard_after_forward)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for iter_idx in range(10):
        global_inp = torch.rand((global_batch_size, dim))
        local_inp = global_inp[rank * local_batch_size : (rank + 1) * local_batch_size].detach()
        losses = []
        for _model, inp in ((ref_model, global_inp), (model, local_inp)):
            losses.append(_model(inp).sum())
            losses[-1].backward()
        _reduce_1d_partial_grads(ref_model)
        dist.all_reduce(losses[1])
        tc.assertEqual(losses[0], losses[1])
        check_sharded_parity(tc, ref_model, model)
        for _optim in (optim, ref_optim):
            _optim.step()
            _optim.zero_grad(set_to_none=(iter_idx % 2))


@pytest.mark.parametrize("reshard_after_forward", RAF)
def test_unused_forward_module(dist_run, impl, reshard_after_forward):
    dist_run(_unused_forward_module, _world(reshard_after_forward), impl, reshard_after_forward, timeout=T)


class _Module(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()

    def forward(self, inp):
        if isinstance(inp, list):
            return [self._forward(inp[0])]
        if _is_namedtuple(inp):
            return type(inp)(*([self._forward(inp[0])] + list(inp[1:])))
        if isinstance(inp, tuple):
            return (self._forward(inp[0]),)
        if isinstance(inp, dict):
            return {"x": self._forward(inp["x"])}
        raise NotImplementedError(type(inp))

    def _forward(self, x):
        return self.relu(self.lin2(self.relu(self.lin1(x))))


_NT = collections.namedtuple("NT", "x y")


class _ToContainer(nn.Module):
    def __init__(self, container_type):
        super().__init__()
        self.container_type = container_type

    def forward(self, x):
        return {
            list: lambda: [x],
            "namedtuple": lambda: _NT(x, torch.ones_like(x)),
            tuple: lambda: (x,),
            dict: lambda: {"x": x},
        }[self.container_type]()


class _FromContainer(nn.Module):
    def __init__(self, container_type):
        super().__init__()
        self.container_type = container_type

    def forward(self, x):
        return x["x"] if self.container_type is dict else x[0]


def _nontensor_activations(impl, container_name):
    A = api(impl)
    container_type = {"list": list, "namedtuple": "namedtuple", "tuple": tuple, "dict": dict}[container_name]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    local_batch_size, dim = 2, 24
    global_batch_size = world_size * local_batch_size
    model = nn.Sequential(
        _ToContainer(container_type), _Module(dim), _Module(dim), _Module(dim), _FromContainer(container_type)
    )
    ref_model = copy.deepcopy(model)
    for module in model:
        A.fully_shard(module)
    A.fully_shard(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for iter_idx in range(10):
        global_inp = torch.rand((global_batch_size, dim))
        local_inp = global_inp[rank * local_batch_size : (rank + 1) * local_batch_size].detach()
        losses = []
        for _model, inp in ((ref_model, global_inp), (model, local_inp)):
            losses.append(_model(inp).sum())
            losses[-1].backward()
        _reduce_1d_partial_grads(ref_model)
        dist.all_reduce(losses[1])
        tc.assertEqual(losses[0], losses[1])
        check_sharded_parity(tc, ref_model, model)
        for _optim in (optim, ref_optim):
            _optim.step()
            _optim.zero_grad(set_to_none=(iter_idx % 2))


@pytest.mark.parametrize("container", ["list", "namedtuple", "tuple", "dict"])
def test_nontensor_activations(dist_run, impl, container):
    dist_run(_nontensor_activations, 2, impl, container, timeout=T)


# -- TestFullyShardFrozen ----------------------------------------------------------------


@contextlib.contextmanager
def _fsdp2_internal_checks(impl, assert_numel):
    """(torch only) FSDP2's reduce-scatter numel and post-backward autograd-function count."""
    counts = {"backward": 0}
    if impl != "torch":
        yield None
        return
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import RegisterPostBackwardFunction
    from torch.testing._internal.common_fsdp import (
        patch_reduce_scatter,
        patch_register_post_backward_hook_backward,
        reduce_scatter_with_assert,
    )

    orig_backward = RegisterPostBackwardFunction.backward

    def backward_with_count(*args, **kwargs):
        counts["backward"] += 1
        return orig_backward(*args, **kwargs)

    ctx = [patch_register_post_backward_hook_backward(backward_with_count)]
    if assert_numel is not None:
        rs = functools.partial(reduce_scatter_with_assert, tc, dist.reduce_scatter_tensor, assert_numel)
        ctx.append(patch_reduce_scatter(rs))
    with contextlib.ExitStack() as stack:
        for c in ctx:
            stack.enter_context(c)
        yield counts


def _train_mixed_requires_grad_per_group(impl, reshard_after_forward, use_activation_checkpointing, freeze_after_init):
    A = api(impl)
    torch.manual_seed(42)
    num_mlps, lin_dim = 3, 32
    model = nn.Sequential(*[MLP(lin_dim) for _ in range(num_mlps)])
    if not freeze_after_init:
        for name, param in model.named_parameters():
            if "bias" not in name:
                param.requires_grad_(False)
    ref_model = replicate(copy.deepcopy(model), find_unused_parameters=freeze_after_init)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        if use_activation_checkpointing:
            checkpoint(mlp)
        A.fully_shard(mlp, reshard_after_forward=reshard_after_forward)
    A.fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    if freeze_after_init:
        for name, param in itertools.chain(model.named_parameters(), ref_model.named_parameters()):
            if "bias" not in name:
                param.requires_grad_(False)
    expected_numel = sum(p._local_tensor.numel() for n, p in model[0].named_parameters() if "bias" in n)

    def assert_fn(output):
        tc.assertEqual(output.numel(), expected_numel)

    torch.manual_seed(42 + dist.get_rank() + 1)
    with _fsdp2_internal_checks(impl, assert_fn) as counts:
        for iter_idx in range(10):
            inp = torch.randn((8, lin_dim))
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            check_sharded_parity(tc, ref_model, model)
            tc.assertEqual(losses[0], losses[1])
            if counts is not None:
                tc.assertTrue(counts["backward"] >= num_mlps - 1)


@pytest.mark.parametrize("freeze_after_init", [False, True])
@pytest.mark.parametrize("use_activation_checkpointing", [False, True])
@pytest.mark.parametrize("reshard_after_forward", RAF)
def test_train_mixed_requires_grad_per_group(
    dist_run, impl, reshard_after_forward, use_activation_checkpointing, freeze_after_init
):
    dist_run(
        _train_mixed_requires_grad_per_group,
        _world(reshard_after_forward),
        impl,
        reshard_after_forward,
        use_activation_checkpointing,
        freeze_after_init,
        timeout=T,
    )


def _train_mixed_requires_grad_across_groups(impl, reshard_after_forward, unfreeze_params):
    A = api(impl)
    torch.manual_seed(42)
    num_linears, lin_dim = 6, 32
    modules = []
    for _ in range(num_linears):
        modules += [nn.Linear(lin_dim, lin_dim), nn.ReLU()]
    model = nn.Sequential(*modules)
    ref_model = replicate(copy.deepcopy(model), find_unused_parameters=True)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            A.fully_shard(module, reshard_after_forward=reshard_after_forward)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    def set_requires_grad(seq, requires_grad):
        for i in range(num_linears):
            if i % 2 == 0:  # as the original: the first linear, every other iteration
                for param in seq[i % 2].parameters():
                    param.requires_grad_(requires_grad)

    set_requires_grad(model, False)
    set_requires_grad(ref_model, False)
    num_iters, no_grad_iter_idx = 3, 1
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randn((8, lin_dim))
    with _fsdp2_internal_checks(impl, None) as counts:
        for iter_idx in range(num_iters):
            losses = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                if unfreeze_params and iter_idx == num_iters - 1:
                    set_requires_grad(model, True)
                if iter_idx == no_grad_iter_idx:
                    with torch.no_grad():
                        losses.append(_model(inp).sum())
                else:
                    losses.append(_model(inp).sum())
                    losses[-1].backward()
                    _optim.step()
                    _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        tc.assertEqual(losses[0], losses[1])
        if counts is not None:
            tc.assertTrue(counts["backward"] >= num_linears - 1)


@pytest.mark.parametrize("unfreeze_params", [False, True])
@pytest.mark.parametrize("reshard_after_forward", RAF)
def test_train_mixed_requires_grad_across_groups(dist_run, impl, reshard_after_forward, unfreeze_params):
    dist_run(
        _train_mixed_requires_grad_across_groups,
        _world(reshard_after_forward),
        impl,
        reshard_after_forward,
        unfreeze_params,
        timeout=T,
    )


def _multi_forward_mixed_requires_grad(impl, reshard_after_forward):
    A = api(impl)

    class MultiForwardModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_0 = nn.Linear(5, 5)
            self.layer_no_grad = nn.Linear(5, 5)
            self.layer_with_grad = nn.Linear(5, 5)
            self.layer_no_grad.requires_grad_(False)

        def forward(self, x):
            x = self.layer_0(x)
            for _ in range(3):
                x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
                with torch.no_grad():
                    x += F.relu(self.layer_with_grad(x))
            return x

    torch.manual_seed(42)
    model = MultiForwardModule()
    ref_model = replicate(copy.deepcopy(model))
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            A.fully_shard(module, reshard_after_forward=reshard_after_forward)
    A.fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for iter_idx in range(10):
        inp = torch.randn((8, 5))
        losses = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            losses.append(_model(inp).sum())
            losses[-1].backward()
            _optim.step()
        tc.assertEqual(losses[0], losses[1])


@pytest.mark.parametrize("reshard_after_forward", RAF)
def test_multi_forward_mixed_requires_grad(dist_run, impl, reshard_after_forward):
    dist_run(_multi_forward_mixed_requires_grad, _world(reshard_after_forward), impl, reshard_after_forward, timeout=T)
