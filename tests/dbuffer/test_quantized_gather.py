"""The int8 weight all-gather (``comm_policy=QuantizedComm(weights="int8")``): the gathered
parameters equal the block-wise quantize-dequantize of each whole parameter, bit for bit, at
every world size and cut (rows, ``block_size_fn`` rows, element-wise); each element within
half a step of its source; nan/inf refused on every rank, naming the parameter; the bytes the
run record logs about half of a bf16 gather's; training stays close to the exact run.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from tests.support.extension_tensors import Float8Weight
from tests.support.quantized import Stack, reference, reference_scales
from vescale_plugins import QuantizedComm, RaggedShard, fully_shard
from vescale_plugins.dbuffer.planning import quantization_block
from vescale_plugins.dbuffer.quant_kernels import Segments, dequantize_segments, quantize_segments
from vescale_plugins.dbuffer.quantized import NonFiniteWeightError
from vescale_plugins.observe.record import record_run

BLOCK = 64  # small, so that small test shapes hold many blocks and several cut kinds
TIMEOUT = dict(timeout=240)


class _Shapes(nn.Module):
    """Rows shorter and longer than a block, a row of prime length, 1-D tensors of several
    lengths, rows in blocks of 4 (``block_size_fn``)."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Linear(37, 30)  # rows of 37: grouped whole, one block per row
        self.wide = nn.Linear(640, 2)  # rows of 640: runs of 64
        self.prime = nn.Parameter(torch.randn(7, 131))  # a row of prime length: one block per row
        self.blocked = nn.Parameter(torch.randn(24, 96))  # block_size_fn: 4 rows per planner block
        self.scalar = nn.Parameter(torch.randn(()))
        self.long_bias = nn.Parameter(torch.randn(1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.narrow(x[:, :37]).sum(1) + self.wide(x[:, :640]).sum(1)
        return y + (self.prime.sum() + self.blocked.sum()) * self.scalar + self.long_bias.sum()


class _TwoWidths(nn.Module):
    """Rows of 250 and 330 elements in one fp32 buffer cannot split evenly at 2 or 3 ranks:
    the planner cuts them element-wise (in blocks of 50 and 55 elements, divisors of the
    rows). In bf16 (16-byte alignment of 8 elements) it keeps rows."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(250, 6)
        self.b = nn.Linear(330, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x[:, :250]) * self.b(x[:, 250:])


def _block_rows(name: str, param: nn.Parameter) -> int | None:
    return 4 if name == "blocked" else None


def _gathered_equal_reference(dtype: torch.dtype, param_dtype: torch.dtype | None) -> None:
    for make in (_Shapes, _TwoWidths):
        _check_gathered_equal_reference(make(), dtype, param_dtype)


def _check_gathered_equal_reference(model: nn.Module, dtype: torch.dtype, param_dtype: torch.dtype | None) -> None:
    torch.manual_seed(0)
    model = model.to(dtype)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    mp = MixedPrecisionPolicy(param_dtype=param_dtype)
    fully_shard(model, comm_policy=QuantizedComm(block=BLOCK), mp_policy=mp, block_size_fn=_block_rows)
    placements = {n: p.placements[0] for n, p in model.named_parameters()}
    assert all(isinstance(p, RaggedShard) for p in placements.values())
    if isinstance(model, _TwoWidths) and dtype == torch.float32 and dist.get_world_size() in (2, 3):
        assert placements["a.weight"].dims == (0, 1), placements["a.weight"]
        assert placements["b.weight"].dims == (0, 1), placements["b.weight"]
    model.unshard()
    compute = param_dtype or dtype
    for name, param in model.named_parameters():
        assert param.dtype == compute, name
        assert torch.equal(param.detach(), reference(full[name], BLOCK, compute)), name
    model.reshard()
    # The sharded (master) parameters are untouched.
    for name, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), full[name]), name


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize(
    ("dtype", "param_dtype"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)],
    ids=["fp32", "bf16", "fp32-master-bf16-compute"],
)
def test_gathered_weights_equal_the_blockwise_quantization_of_each_whole_parameter(dist_run, world, dtype, param_dtype):
    dist_run(_gathered_equal_reference, world, dtype, param_dtype, **TIMEOUT)


def test_quantization_block_is_a_function_of_the_shape():
    assert quantization_block((30, 37), 64) == 37  # one row (64 // 37 == 1)
    assert quantization_block((30, 10), 64) == 60  # six rows
    assert quantization_block((2, 640), 64) == 64  # a divisor of the row
    assert quantization_block((7, 131), 64) == 131  # prime row: the whole row
    assert quantization_block((1000,), 64) == 64  # 1-D: runs, the last shorter
    assert quantization_block((), 64) == 64  # one element: one (short) block
    assert quantization_block((0, 5), 64) == 1


def _quantize_dequantize(x: torch.Tensor, run: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The library's kernels over one flat tensor in runs of ``run`` (the gather's path)."""
    n = x.numel()
    starts = torch.arange(0, n, run)
    lengths = (n - starts).clamp(max=run)
    slots = torch.arange(starts.numel())
    codes = torch.empty(n, dtype=torch.int8)
    scales = torch.empty(starts.numel())
    segments = Segments.of(starts, lengths, slots, n)
    quantize_segments(x.reshape(-1), segments, codes, scales)
    out = torch.empty(n, dtype=torch.float32)
    dequantize_segments(codes, n, n, scales, segments, out)
    return out.view(x.shape), scales.repeat_interleave(lengths).view(x.shape)


def _adversarial(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    random = torch.randn(n, generator=g)
    outliers = torch.randn(n, generator=g) * 1e-3
    outliers[::97] = 1e4
    zeros = torch.zeros(n)
    constant = torch.full((n,), -0.3)
    mixed = torch.cat([zeros[: n // 4], constant[: n // 4], random[: n - n // 2]])
    tiny = torch.randn(n, generator=g) * 1e-30
    huge = torch.randn(n, generator=g) * 1e30
    return dict(random=random, outliers=outliers, zeros=zeros, constant=constant, mixed=mixed, tiny=tiny, huge=huge)


@pytest.mark.parametrize("run", [1, 7, 64, 256])
def test_each_element_within_half_a_step_of_its_source(run):
    for kind, x in _adversarial(4096 + 13).items():
        out, scale = _quantize_dequantize(x, run)
        assert torch.equal(out, reference(x, run, torch.float32)), kind
        # Half a step, plus the two fp32 roundings (the quotient's and the product's).
        bound = scale / 2 + x.abs() * 2**-22
        assert bool(((out - x).abs() <= bound).all()), (kind, float(((out - x).abs() - bound).max()))
        if kind == "zeros":
            assert torch.equal(out, x)
        if kind == "constant":  # a block of one value is its own amax: exact
            assert torch.equal(out, x)


def _gathered_within_half_a_step(dtype: torch.dtype) -> None:
    model = nn.Linear(320, 12, bias=False).to(dtype)
    with torch.no_grad():
        w = _adversarial(model.weight.numel())["mixed"].view(12, 320)
        w[3] = _adversarial(320)["outliers"]
        w[5] = 0.0
        w[7] = 2.5
        model.weight.copy_(w)
    source = model.weight.detach().float().clone()
    fully_shard(model, comm_policy=QuantizedComm(block=BLOCK))
    model.unshard()
    out = model.weight.detach().float()
    scale = reference_scales(source, BLOCK)
    ulp = source.abs() * (2**-22 if dtype == torch.float32 else 2**-8)  # bf16: the compute dtype's rounding
    assert bool(((out - source).abs() <= scale / 2 + ulp).all())
    assert torch.equal(out[5], source[5])  # zeros
    assert torch.equal(out[7], source[7])  # one value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gathered_elements_within_half_a_step_at_three_ranks(dist_run, dtype):
    dist_run(_gathered_within_half_a_step, 3, dtype, **TIMEOUT)


def _non_finite_refused(bad: float) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    fully_shard(model, comm_policy=QuantizedComm(block=BLOCK))
    if dist.get_rank() == 1:  # one rank's shard only: every rank must still raise
        with torch.no_grad():
            local = model[1].weight.to_local()
            local.view(-1)[local.numel() // 2] = bad
    with pytest.raises(NonFiniteWeightError, match=r"parameter '1\.weight'.*nan or inf.*rank 1"):
        model.unshard()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_weights_are_refused_on_every_rank_naming_the_parameter(dist_run, bad):
    dist_run(_non_finite_refused, 2, bad, **TIMEOUT)


def _gathered_bytes(policy: QuantizedComm | None, steps: int = 2) -> tuple[float, list[float]]:
    torch.manual_seed(0)
    model = Stack()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp, comm_policy=policy)
    fully_shard(model, mp_policy=mp, comm_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    with record_run(model, opt) as record:
        for _ in range(steps):
            x = torch.randn(8, 256, generator=g)
            loss = (model(x).float() - 0.5).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            record.mark_step()
            losses.append(loss.item())
    return record.to_dict()["communication"]["summary"]["all_gather"]["bytes_per_step"], losses


def _bytes_about_half_of_bf16() -> None:
    exact, exact_losses = _gathered_bytes(None)
    quantized, quantized_losses = _gathered_bytes(QuantizedComm())
    assert exact > 0
    assert quantized / exact <= 0.53, (quantized, exact)
    # The first step's loss is computed from gathered weights: within int8's error of exact.
    assert abs(quantized_losses[0] - exact_losses[0]) <= 1e-2 * abs(exact_losses[0]), (quantized_losses, exact_losses)


def test_gathered_bytes_at_most_053_of_a_bf16_gather_in_the_run_record(dist_run):
    dist_run(_bytes_about_half_of_bf16, 2, **TIMEOUT)


def test_policy_arguments_are_checked():
    with pytest.raises(ValueError, match="supported formats"):
        QuantizedComm(weights="int4")
    with pytest.raises(ValueError, match="fp8"):
        QuantizedComm(grads="fp8")
    with pytest.raises(ValueError, match="block"):
        QuantizedComm(block=1)


def _refused_before_touching(kind: str) -> None:
    model = nn.Linear(8, 8)
    if kind == "extension":  # on every rank, naming the parameter, during set-up's agreement
        model = nn.Sequential(nn.Linear(8, 8))
        model[0].weight = nn.Parameter(Float8Weight(model[0].weight.detach().clone(), False))
        with pytest.raises(
            ValueError, match=r"parameter '0\.weight' defines FSDP2 all-gather extensions.*comm_policy=None"
        ):
            fully_shard(model, comm_policy=QuantizedComm())
        assert type(model[0].weight.data) is Float8Weight  # left as it was
        return
    if kind == "type":
        with pytest.raises(TypeError, match="comm_policy must be None or a QuantizedComm"):
            fully_shard(model, comm_policy="int8")  # type: ignore[arg-type]
    else:
        with pytest.raises(NotImplementedError, match="CPUOffloadPolicy"):
            fully_shard(model, comm_policy=QuantizedComm(), offload_policy=CPUOffloadPolicy())
    assert not isinstance(model.weight, torch.distributed.tensor.DTensor)  # left as it was


@pytest.mark.parametrize("kind", ["type", "offload", "extension"])
def test_bad_comm_policy_is_refused_before_the_module_changes(dist_run, kind):
    dist_run(_refused_before_touching, 2, kind, **TIMEOUT)


def _meta_init_keeps_the_policy() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(40, 24), nn.Linear(24, 7))
    fully_shard(model, comm_policy=QuantizedComm(block=BLOCK))
    model.to_empty(device="cpu")  # new DBuffers over the same layout
    for layer in model:
        layer.reset_parameters()
    assert all(b.weight_quant_block == BLOCK for b in model._vescale_fsdp_unit.dbuffers)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    model.unshard()
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), reference(full[name], BLOCK, torch.float32)), name


def test_meta_device_init_keeps_the_quantized_gather(dist_run):
    dist_run(_meta_init_keeps_the_policy, 2, **TIMEOUT)
