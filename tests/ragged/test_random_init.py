"""Random initialisation of RaggedShard parameters draws only what each rank keeps.

``reset_parameters()`` / ``nn.init.*`` on a meta-initialised, sharded model must give exactly
the eager model's values at every world size, without building a full-size copy of each
parameter on every rank. On CPU, ``uniform_`` and ``normal_`` are drawn in bounded pieces
that reproduce one full draw exactly (checked here against torch's own full draw, generator
state after the draw included); the sharded case runs with a small piece so that parameters
span many pieces.
"""

import pytest
import torch

import vescale_plugins.ragged.dtensor.random_init as bridge
from tests.support.models import make_decoder
from tests.support.parity import assert_matches, meta_init_sharded_decoder

aten = torch.ops.aten
DRAWS = [(aten.uniform_.default, (-0.3, 0.7)), (aten.normal_.default, (0.1, 2.0))]


@pytest.mark.parametrize("op, args", DRAWS, ids=["uniform_", "normal_"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_piecewise_draw_equals_the_slice_of_one_full_draw(monkeypatch, op, args, dtype):
    monkeypatch.setattr(bridge, "_RANDOM_PIECE", 32)
    for numel in [*range(1, 100, 7), 255, 256, 257, 1000]:
        torch.manual_seed(numel)
        full = torch.empty(numel, dtype=dtype)
        op(full, *args)
        next_draw = torch.rand(3)
        for start, length in (
            (0, numel),
            (0, numel // 2),
            (numel // 3, numel - numel // 3),
            (numel - 1, 1),
            (numel // 2, 0),
        ):
            torch.manual_seed(numel)
            part = torch.empty(length, dtype=dtype)
            bridge._draw_local_part_of_full(op, part, start, numel, args, {})
            assert torch.equal(part, full[start : start + length]), (numel, start, length)
            assert torch.equal(torch.rand(3), next_draw), "the generator must end where a full draw leaves it"


def _meta_init_without_full_copies(piece):
    default_piece, bridge._RANDOM_PIECE = bridge._RANDOM_PIECE, piece
    eager = make_decoder(seed=7)
    model = meta_init_sharded_decoder()
    allocated = []
    original_empty = torch.empty

    def recording_empty(*args, **kwargs):
        tensor = original_empty(*args, **kwargs)
        allocated.append(tensor.numel())
        return tensor

    torch.empty = recording_empty
    try:
        torch.manual_seed(7)
        model.reset_parameters()
    finally:
        torch.empty, bridge._RANDOM_PIECE = original_empty, default_piece
    assert_matches(model, eager, "param", tol=dict(rtol=0, atol=0))
    largest = max(p.numel() for p in eager.parameters())
    assert largest > 4 * piece and max(allocated) <= 2 * piece, (largest, max(allocated))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_meta_init_matches_eager_without_a_full_size_temporary(dist_run, world):
    dist_run(_meta_init_without_full_copies, world, 64, timeout=300)
