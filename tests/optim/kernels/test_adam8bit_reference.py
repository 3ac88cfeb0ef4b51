"""The vectorised torch 8-bit AdamW step against a straightforward per-tile loop, and the
quantisation map against torchao's (bitsandbytes' dynamic map)."""

from __future__ import annotations

import math

import pytest
import torch

from vescale_plugins.optim.kernels.adam8bit_torch import AdamHyper, adam8bit_step_
from vescale_plugins.optim.kernels.quant_map import dynamic_map, quantize
from vescale_plugins.optim.tiles import TileGrid, tile_rows


def test_map_is_torchaos_dynamic_map_and_codes_match_its_quantizer():
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    for signed in (True, False):
        qmap = torch.tensor(quant_utils.create_dynamic_map(signed=signed), dtype=torch.float32)
        assert torch.equal(qmap, dynamic_map(signed))
        gen = torch.Generator().manual_seed(0)
        # Every magnitude the map covers, its own values, the exact midpoints, out-of-range values.
        x = torch.cat(
            [torch.rand(20_000, generator=gen) * scale for scale in (1.0, 1e-3, 1e-6, 1e-9)]
            + [qmap, (qmap[1:] + qmap[:-1]) / 2, torch.tensor([0.0, 1.0, 2.0])]
        )
        x = torch.cat([x, -x]) if signed else x
        assert torch.equal(quantize(x, signed), quant_utils.quantize_8bit_with_qmap(x, qmap))


@pytest.mark.parametrize("signed", [True, False])
def test_quantize_applies_torchaos_rule_at_every_rounding_threshold(signed):
    """The bucketed lookup against the rule itself, written plainly, a few ulps either side of
    every value where a code changes (where a lookup could be off by one) and across ranges."""
    qmap = dynamic_map(signed)
    half_gaps = torch.cat([(qmap[1:] - qmap[:-1]) * 0.5, torch.tensor([float("inf")])])

    def rule(x):
        c = (torch.searchsorted(qmap, x, right=True) - 1).clamp(0, 255)
        return (c + ((x - qmap[c]) >= half_gaps[c])).to(torch.uint8)

    edges = torch.cat([qmap, qmap[:-1] + half_gaps[:-1]])
    near, below, above = [edges], edges, edges
    for _ in range(3):
        below, above = torch.nextafter(below, torch.tensor(-2.0)), torch.nextafter(above, torch.tensor(2.0))
        near += [below, above]
    gen = torch.Generator().manual_seed(0)
    spread = [torch.rand(5000, generator=gen) * 10.0**-k for k in range(9)]
    x = torch.cat(
        near + spread + [-s for s in spread] + [torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0, -3.0, 1e-30, -1e-30])]
    )
    assert torch.equal(quantize(x, signed), rule(x))
    out = torch.empty(x.shape, dtype=torch.uint8)
    assert quantize(x, signed, out=out) is out
    assert torch.equal(out, rule(x))


def _nearest_code(x: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Nearest map value by brute force; ties to the larger code."""
    distance = (x.reshape(-1, 1) - qmap.reshape(1, -1)).abs()
    return (255 - distance.flip(1).argmin(1)).reshape(x.shape).to(torch.uint8)


def _loop_step(p, g, mc, ms, vc, vs, tile_h, tile_w, h: AdamHyper):
    """One tile at a time, written from the AdamW formula (the reference's reference)."""
    qs, qu = dynamic_map(True), dynamic_map(False)
    rows, cols = p.shape
    for ti in range(math.ceil(rows / tile_h)):
        for tj in range(math.ceil(cols / tile_w)):
            r, c = slice(ti * tile_h, (ti + 1) * tile_h), slice(tj * tile_w, (tj + 1) * tile_w)
            m = qs[mc[r, c].long()] * ms[ti, tj]
            v = qu[vc[r, c].long()] * vs[ti, tj]
            grad = g[r, c].float()
            tile_p = p[r, c] * (1 - h.lr * h.weight_decay) if h.decoupled else p[r, c].clone()
            if not h.decoupled:
                grad = grad + h.weight_decay * p[r, c]
            m = m + (1 - h.beta1) * (grad - m)
            v = h.beta2 * v + (1 - h.beta2) * grad * grad
            denom = v.sqrt() / math.sqrt(1 - h.beta2**h.step) + h.eps
            p[r, c] = tile_p - h.lr / (1 - h.beta1**h.step) * m / denom
            ms[ti, tj] = max(m.abs().max().item(), 1e-12)
            vs[ti, tj] = max(v.abs().max().item(), 1e-12)
            mc[r, c] = _nearest_code(m / ms[ti, tj], qs)
            vc[r, c] = _nearest_code(v / vs[ti, tj], qu)


@pytest.mark.parametrize(
    ("shape", "tile"), [((70, 45), 32), ((33,), 4), ((5, 3, 4), 2), ((), 32), ((40, 64), 32), ((9, 17), 8)]
)
@pytest.mark.parametrize("decoupled", [True, False])
def test_reference_equals_the_per_tile_loop(shape, tile, decoupled):
    gen = torch.Generator().manual_seed(3)
    grid = TileGrid.of(shape, tile)
    p = torch.randn(grid.rows, grid.cols, generator=gen)
    state = [
        torch.zeros(grid.rows, grid.cols, dtype=torch.uint8),
        torch.zeros(grid.tile_rows, grid.tile_cols),
        torch.zeros(grid.rows, grid.cols, dtype=torch.uint8),
        torch.zeros(grid.tile_rows, grid.tile_cols),
    ]
    p_loop, state_loop = p.clone(), [s.clone() for s in state]
    for step in range(1, 5):
        g = torch.randn(grid.rows, grid.cols, generator=gen) * (10.0**-step)
        h = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, step, decoupled)
        adam8bit_step_(p, g, *state, grid.tile_h, grid.tile_w, h)
        _loop_step(p_loop, g, *state_loop, grid.tile_h, grid.tile_w, h)
        torch.testing.assert_close(p, p_loop, rtol=1e-6, atol=1e-7)
        for ours, theirs in zip(state, state_loop):
            if ours.dtype == torch.uint8:
                # Same nearest-value rule; a value within rounding of a midpoint may go either way.
                assert (ours.int() - theirs.int()).abs().max() <= 1
                assert (ours != theirs).float().mean() < 1e-3
            else:
                torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
        # Continue from identical state so differences cannot compound.
        state_loop = [s.clone() for s in state]
        p_loop = p.clone()


def test_tile_rows_rule():
    fn = tile_rows(32)
    assert fn("w", torch.nn.Parameter(torch.empty(1031, 384))) == 32
    assert fn("w", torch.nn.Parameter(torch.empty(4, 3, 3))) == 32
    assert fn("b", torch.nn.Parameter(torch.empty(384))) == 1024
    assert fn("s", torch.nn.Parameter(torch.empty(()))) is None
    assert TileGrid.of((1031, 384)).num_tiles == 33 * 12
    assert TileGrid.of((2500,)).num_tiles == 3
    with pytest.raises(ValueError, match="tile must be a positive int"):
        tile_rows(0)


def test_bands_of_tile_rows_step_like_the_whole_matrix(monkeypatch):
    import vescale_plugins.optim.kernels.adam8bit_torch as reference

    gen = torch.Generator().manual_seed(1)
    p, g = torch.randn(103, 70, generator=gen), torch.randn(103, 70, generator=gen)
    state = [
        torch.zeros(103, 70, dtype=torch.uint8),
        torch.zeros(4, 3),
        torch.zeros(103, 70, dtype=torch.uint8),
        torch.zeros(4, 3),
    ]
    banded_p, banded_state = p.clone(), [s.clone() for s in state]
    hyper = AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, 1)
    adam8bit_step_(p, g, *state, 32, 32, hyper)
    monkeypatch.setattr(reference, "_BAND_ELEMENTS", 32 * 70)  # one tile row per band
    adam8bit_step_(banded_p, g, *banded_state, 32, 32, hyper)
    assert torch.equal(p, banded_p)
    assert all(torch.equal(a, b) for a, b in zip(state, banded_state))
