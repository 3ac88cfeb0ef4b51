"""Flat fp32 AdamW and flat clip_grad_norm_: equal to torch's, on plain and sharded params."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.support.uneven_params import UnevenParams, coefficients
from vescale_plugins import fully_shard
from vescale_plugins.optim import AdamW, clip_grad_norm_
from vescale_plugins.optim.flat import contiguous_runs


def _backward(model, step, only_rank0=False):
    coeffs = coefficients(step)
    if only_rank0 and dist.get_rank() != 0:
        model({n: torch.zeros_like(c) for n, c in coeffs.items()}).mul(0.0).backward()
    else:
        model(coeffs).backward()


def test_plain_params_match_torch_fused_adamw_bitwise_and_foreach_closely():
    ours_model, fused_model, foreach_model = UnevenParams(), UnevenParams(), UnevenParams()
    ours = AdamW(ours_model.parameters(), lr=1e-2, weight_decay=0.1)
    fused = torch.optim.AdamW(fused_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    foreach = torch.optim.AdamW(foreach_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(3):
        for model, opt in ((ours_model, ours), (fused_model, fused), (foreach_model, foreach)):
            _backward(model, step)
            opt.step()
            opt.zero_grad()
    for a, b, c in zip(ours_model.parameters(), fused_model.parameters(), foreach_model.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)
    for a, b in zip(ours_model.parameters(), fused_model.parameters()):
        assert set(ours.state[a]) == set(fused.state[b]) == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[a][key], fused.state[b][key])


def test_state_dict_interchanges_with_torch_adamw():
    model, reference = UnevenParams(), UnevenParams()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    _backward(reference, 0)
    torch_opt.step()
    model.load_state_dict(reference.state_dict())
    ours = AdamW(model.parameters(), lr=1e-2)
    ours.load_state_dict(torch_opt.state_dict())
    for m, opt in ((model, ours), (reference, torch_opt)):
        opt.zero_grad()
        _backward(m, 1)
        opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def _sharded_matches_unsharded():
    reference = UnevenParams()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    model = fully_shard(UnevenParams())
    model.set_gradient_divide_factor(1.0)
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        _backward(reference, step)
        _backward(model, step, only_rank0=True)
        held = [p for p in model.parameters() if p.to_local().numel()]
        assert len(held) <= 1 or len(contiguous_runs(held)) < len(held)
        total = clip_grad_norm_(model.parameters(), max_norm=0.5)
        ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.5)
        torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=0)
        for p, r in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-7)
            # Continue from identical gradients so the optimizer comparison is exact.
            p.grad.to_local().copy_(
                p.grad.placements[0].split_full(r.grad.contiguous(), dist.get_rank())
                if p.dim()
                else r.grad
                if p.to_local().numel()
                else p.grad.to_local()
            )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.full_tensor(), r.detach()), name
    inf_model = fully_shard(UnevenParams())
    _backward(inf_model, 0)
    ref_inf = UnevenParams()
    _backward(ref_inf, 0)
    torch.testing.assert_close(
        clip_grad_norm_(inf_model.parameters(), 1.0, norm_type=float("inf")),
        torch.nn.utils.clip_grad_norm_(ref_inf.parameters(), 1.0, norm_type=float("inf")),
    )


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_flat_adamw_and_clip_match_torch_unsharded(dist_run, world):
    dist_run(_sharded_matches_unsharded, world, timeout=120)


def test_amsgrad_refused():
    with pytest.raises(ValueError, match=r"AdamW\(amsgrad=True\) is not supported"):
        AdamW([nn.Parameter(torch.zeros(2))], amsgrad=True)
