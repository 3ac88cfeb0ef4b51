"""Torch 2.15's mixed-precision changes to FSDP2, on CPU/gloo, for either implementation:
``MixedPrecisionPolicy.param_dtype_override_fn`` (per-parameter compute dtype) and the new
gradient dtypes (``reduce_dtype=None`` follows the parameter's ``grad_dtype``, by default
its own dtype, no longer ``param_dtype``; a ``grad_dtype`` set before ``fully_shard`` is
kept by the sharded parameter and its gradient).

Torch 2.15's own test sources for these could not be read here (README, "Torch 2.15
additions"): each case follows the 2.15 ``MixedPrecisionPolicy`` docstring (its
``versionchanged:: 2.15`` note) and the pull requests' descriptions (pytorch#196626
per-parameter mixed precision; pytorch#194434 and #172074 gradient dtypes), checked exactly
against values bf16 cannot hold. Skipped where the installed torch predates the change.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ._compat import api, tc

T = 180  # seconds per case
vescale_xfail = lambda reason: pytest.mark.vescale_xfail(reason)

HAS_OVERRIDE_FN = "param_dtype_override_fn" in getattr(MixedPrecisionPolicy, "__dataclass_fields__", {})
TORCH_215 = torch.torch_version.TorchVersion(torch.__version__) >= "2.15"
needs_override_fn = pytest.mark.skipif(
    not HAS_OVERRIDE_FN,
    reason=f"torch 2.15 API MixedPrecisionPolicy.param_dtype_override_fn; the installed torch {torch.__version__} lacks it",
)
needs_215_grad_dtypes = pytest.mark.skipif(
    not TORCH_215,
    reason=f"torch 2.15's gradient dtypes (reduce_dtype=None follows grad_dtype); installed torch {torch.__version__}",
)

# 1 + 2**-8 needs 9 significant bits: a bf16 sum of rank 0's 1.0 and rank 1's 2**-8 rounds
# to 1.0, an fp32 sum keeps it. Averaged over 2 ranks: 0.501953125 in fp32, 0.5 in bf16.
_SMALL = 2.0**-8
_FP32_AVG = (1.0 + _SMALL) / 2
_BF16_AVG = 0.5


def _rank_input(dim: int) -> torch.Tensor:
    return torch.full((1, dim), 1.0 if dist.get_rank() == 0 else _SMALL)


# -- reduce_dtype=None reduces in the parameter's dtype, not param_dtype (2.15) ---------------


def _reduce_dtype_default(impl, reduce_dtype):
    A = api(impl)
    dim = 4
    model = nn.Linear(dim, 2, bias=False)
    nn.init.ones_(model.weight)
    A.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
    model(_rank_input(dim)).float().sum().backward()
    grad = model.weight.grad
    tc.assertIsInstance(grad, DTensor)
    tc.assertEqual(grad.dtype, torch.float32)  # the sharded gradient keeps the parameter's dtype
    expected = _FP32_AVG if reduce_dtype is None else _BF16_AVG
    tc.assertEqual(grad.full_tensor(), torch.full((2, dim), expected), atol=0, rtol=0)


@needs_215_grad_dtypes
@pytest.mark.parametrize("reduce_dtype", [None, torch.bfloat16], ids=["none", "bf16"])
def test_reduce_dtype_none_follows_parameter_dtype(dist_run, impl, reduce_dtype):
    dist_run(_reduce_dtype_default, 2, impl, reduce_dtype, timeout=T)


# -- a grad_dtype set before fully_shard is kept (2.15) -------------------------------------


def _grad_dtype_set_before_fully_shard(impl):
    A = api(impl)
    dim = 4
    model = nn.Linear(dim, 2, bias=False, dtype=torch.bfloat16)
    nn.init.ones_(model.weight)
    model.weight.grad_dtype = torch.float32
    A.fully_shard(model)
    tc.assertEqual(model.weight.grad_dtype, torch.float32)
    for step in range(2):
        model(_rank_input(dim).bfloat16()).float().sum().backward()
        grad = model.weight.grad
        tc.assertEqual(model.weight.dtype, torch.bfloat16)
        tc.assertEqual(grad.dtype, torch.float32)
        # Reduced in the gradient's fp32, accumulated in fp32 across backwards.
        tc.assertEqual(grad.full_tensor(), torch.full((2, dim), _FP32_AVG * (step + 1)), atol=0, rtol=0)


@needs_215_grad_dtypes
def test_grad_dtype_set_before_fully_shard(dist_run, impl):
    dist_run(_grad_dtype_set_before_fully_shard, 2, impl, timeout=T)


# -- param_dtype_override_fn (2.15, pytorch#196626) -----------------------------------------


class _FP32Gate(nn.Module):
    """A router-like scale kept in fp32 under bf16 compute (the override's use case)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * self.weight).to(x.dtype)


class _Net(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.gate = _FP32Gate(dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.gate(self.lin1(x)))


def _reference_forward(ref: _Net, x: torch.Tensor) -> torch.Tensor:
    """bf16 compute with fp32 master weights, the gate's weight in fp32: the override's policy."""
    x = x.bfloat16()
    x = F.linear(x, ref.lin1.weight.bfloat16(), ref.lin1.bias.bfloat16())
    x = ref.gate(x)
    return F.linear(x, ref.lin2.weight.bfloat16(), ref.lin2.bias.bfloat16())


def _param_dtype_override_fn(impl):
    A = api(impl)
    dim = 16
    torch.manual_seed(42)
    model = _Net(dim)
    ref_model = copy.deepcopy(model)
    fp32_params = {id(p) for p in model.gate.parameters()}
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        param_dtype_override_fn=lambda p: torch.float32 if id(p) in fp32_params else None,
    )
    A.fully_shard(model, mp_policy=policy)  # one unit holding bf16 and fp32 compute parameters
    seen = {}
    for name, sub in model.named_children():
        sub.register_forward_pre_hook(lambda m, _, name=name: seen.__setitem__(name, m.weight.dtype))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank() + 1)
    for _ in range(3):
        inp = torch.randn(4, dim)
        loss = model(inp).float().sum()
        ref_loss = _reference_forward(ref_model, inp).float().sum()
        tc.assertEqual(seen, {"lin1": torch.bfloat16, "gate": torch.float32, "lin2": torch.bfloat16})
        tc.assertEqual(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        for p in ref_model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        for (name, p), ref_p in zip(model.named_parameters(), ref_model.parameters()):
            tc.assertEqual(p.dtype, torch.float32, msg=name)
            tc.assertEqual(p.grad.dtype, torch.float32, msg=name)
            tc.assertEqual(p.grad.full_tensor(), ref_p.grad, msg=name)
        for _optim in (optim, ref_optim):
            _optim.step()
            _optim.zero_grad()


@needs_override_fn
def test_param_dtype_override_fn(dist_run, impl):
    dist_run(_param_dtype_override_fn, 2, impl, timeout=T)


def _param_dtype_override_fn_invalid(impl):
    A = api(impl)
    for bad, match in ((torch.float16, "param_dtype_override_fn must return None"), ("fp32", "torch.dtype")):
        model = nn.Linear(4, 4)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p, bad=bad: bad)
        with tc.assertRaisesRegex(ValueError, match):
            A.fully_shard(model, mp_policy=policy)


@needs_override_fn
def test_param_dtype_override_fn_invalid(dist_run, impl):
    dist_run(_param_dtype_override_fn_invalid, 2, impl, timeout=T)
