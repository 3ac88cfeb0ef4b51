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
from vescale_plugins.ragged.dtensor import philox_slice

aten = torch.ops.aten
DRAWS = [(aten.uniform_.default, (-0.3, 0.7)), (aten.normal_.default, (0.1, 2.0))]


@pytest.mark.parametrize(("op", "args"), DRAWS, ids=["uniform_", "normal_"])
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
    assert largest > 4 * piece, (largest, max(allocated))
    assert max(allocated) <= 2 * piece, (largest, max(allocated))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3])
def test_meta_init_matches_eager_without_a_full_size_temporary(dist_run, world):
    dist_run(_meta_init_without_full_copies, world, 64, timeout=300)


# -- CUDA: the slice of a full draw from windows of its Philox counters (philox_slice) --------
# The kernel cannot run here; its element-to-counter map is transcribed from torch's
# DistributionTemplates.h (calc_execution_policy, distribution_elementwise_grid_stride_kernel,
# distribution_nullary_kernel's 32-bit split) and each element is named by the Philox value it
# takes: (subsequence, counter, lane). A slice drawn in windows must name the same values as
# the full draw, and leave the generator's offset where the full draw does.

SMS, THREADS_PER_SM = 3, 512  # a small device: grids of at most 6 blocks of 256 threads


class _PhiloxGenerator:
    """A CUDA generator's philox offset (what draw_slice reads and sets)."""

    def __init__(self, offset):
        self.offset = offset

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        assert offset % 4 == 0, "CUDA generators refuse offsets that are not multiples of 4"
        self.offset = offset


def _launch(out, offset, values_per_call):
    """distribution_elementwise_grid_stride_kernel on ``out`` (a list): element -> (t, counter, lane)."""
    numel = len(out)
    grid = min((numel + 255) // 256, SMS * (THREADS_PER_SM // 256))
    threads = 256 * grid
    counter_offset = ((numel - 1) // (threads * values_per_call) + 1) * 4  # calc_execution_policy
    rounded = ((numel - 1) // (threads * values_per_call) + 1) * threads * values_per_call
    for idx in range(threads):
        counter = offset // 4  # curand_init(seed, idx, offset): skips offset 32-bit values
        for linear_index in range(idx, rounded, threads * values_per_call):
            for ii in range(values_per_call):
                li = linear_index + threads * ii
                if li < numel:
                    out[li] = (idx, counter, ii)
            counter += 1  # one Philox call per iteration
    return counter_offset


def _full_draw(numel, itemsize, values_per_call, generator, index_limit):
    """distribution_nullary_kernel: the whole tensor's offset reserved, then each 32-bit part."""
    out = [None] * numel
    grid = min((numel + 255) // 256, SMS * (THREADS_PER_SM // 256))
    offset = generator.offset
    generator.offset += ((numel - 1) // (256 * grid * values_per_call) + 1) * 4

    def fits(size):
        return size <= index_limit and 1 + (size - 1) * itemsize <= index_limit

    def draw(start, size):  # SplitUntil32Bit: the first half (numel // 2) first
        if not fits(size):
            draw(start, size // 2)
            draw(start + size // 2, size - size // 2)
            return
        part = [None] * size
        used = generator.offset
        generator.offset += _launch(part, used, values_per_call)
        out[start : start + size] = part

    if fits(numel):
        _launch(out, offset, values_per_call)
    else:
        draw(0, numel)
    return out


def _fake_op(values_per_call):
    """An in-place draw on a CPU tensor that stores the index of each element's Philox value."""

    def op(tensor, generator):
        names = [None] * tensor.numel()
        generator.offset += _launch(names, generator.offset, values_per_call)
        code = [(t * 100 + counter) * 4 + lane for t, counter, lane in names]  # exact in fp32
        tensor.copy_(torch.tensor(code, dtype=tensor.dtype))

    return op


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["4_per_call", "2_per_call"])
@pytest.mark.parametrize("index_limit", [2**31 - 1, 30_000], ids=["32bit", "split"])
def test_a_cuda_slice_from_philox_windows_equals_the_full_draw(monkeypatch, dtype, index_limit):
    monkeypatch.setattr(philox_slice, "INDEX_LIMIT", index_limit)
    values_per_call, most = philox_slice.unroll(dtype), SMS * THREADS_PER_SM
    itemsize = torch.empty(0, dtype=dtype).element_size()
    for numel in (1, 255, 300, 1535, 1536, 1537, 6144, 6145, 9000, 20011):
        full_generator = _PhiloxGenerator(8)
        full = _full_draw(numel, itemsize, values_per_call, full_generator, index_limit)
        cuts = sorted({0, 1, numel // 3, numel // 2, numel - 1, numel})
        for start, stop in zip(cuts, cuts[1:]):
            generator = _PhiloxGenerator(8)
            out = torch.zeros(stop - start, dtype=dtype)
            philox_slice.draw_slice(
                _fake_op(values_per_call), out, start, numel, (), {"generator": generator}, generator, most, 1000
            )
            want = [(t * 100 + counter) * 4 + lane for t, counter, lane in full[start:stop]]
            assert out.tolist() == want, (numel, start, stop)
            assert generator.offset == full_generator.offset, "the generator must end where the full draw leaves it"


def test_philox_windows_hold_at_most_a_piece_or_a_stride():
    values_per_call, most = 4, SMS * THREADS_PER_SM
    stride = values_per_call * most
    (launch,), _ = philox_slice.launches(50 * stride, 4, values_per_call, most)
    for piece, largest in ((1000, stride), (3 * stride + 5, 3 * stride)):
        plan = list(philox_slice.windows(launch, 7 * stride + 3, 20 * stride, values_per_call, most, piece))
        assert plan[0].start == 7 * stride
        assert plan[-1].start + plan[-1].numel == 20 * stride
        assert max(w.numel for w in plan) == largest


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.hip is not None, reason="torch's CUDA kernels (the device check)"
)
@pytest.mark.parametrize(("op", "args"), DRAWS, ids=["uniform_", "normal_"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_on_cuda_a_philox_slice_equals_the_full_draw(op, args, dtype):
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.cuda.default_generators[device.index]
    most = philox_slice.max_threads(device)
    stride = philox_slice.unroll(dtype) * most
    sizes = [1000, most - 3, stride + 1, 9 * stride + 17]
    if dtype == torch.float32:
        sizes.append(2**29 + 12345)  # past 2**31 bytes: torch draws it in halves
    for numel in sizes:
        torch.cuda.manual_seed(numel)
        full = torch.empty(numel, dtype=dtype, device=device)
        op(full, *args)
        after = generator.get_offset()
        cuts = [0, numel // 3, numel // 2 + 5, numel]
        for start, stop in zip(cuts, cuts[1:]):
            torch.cuda.manual_seed(numel)
            out = torch.empty(stop - start, dtype=dtype, device=device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            philox_slice.draw_slice(op, out, start, numel, args, {}, generator, most, bridge._RANDOM_PIECE)
            temporary = torch.cuda.max_memory_allocated(device) - before
            assert torch.equal(out, full[start:stop]), (numel, start, stop)
            assert generator.get_offset() == after, "the generator must end where the full draw leaves it"
            window = max(bridge._RANDOM_PIECE, stride) * full.element_size()
            assert temporary <= window + 512, (numel, temporary)  # the allocator rounds blocks to 512 B
        del full
