"""A slice of a CUDA full-tensor draw (``uniform_``, ``normal_``), drawn without the full tensor.

torch's CUDA distributions (``distribution_nullary_kernel`` in
``aten/src/ATen/native/cuda/DistributionTemplates.h``) fill ``n`` contiguous elements with a
grid-stride loop of ``T`` threads, ``T = 256 * min(ceil(n / 256), SMs * (threads per SM //
256))``. In loop iteration ``k`` thread ``t`` makes one Philox call (subsequence ``t``, counter
``offset / 4 + k``, ``offset`` the generator's philox offset when the launch began) that gives
``u`` values (``u`` = 4 for float, half and bfloat16, 2 for double) for elements
``u*T*k + i*T + t``, ``i < u``; the launch advances the offset by ``4 * ceil(n / (u*T))``.

So every element of a full draw is fixed by the seed, the launch's offset, ``T`` and its index,
and a draw of ``m`` elements started at offset ``offset + 4*k`` gives exactly elements
``[u*T*k, u*T*k + m)`` of the full draw whenever it runs ``T`` threads too or ``m <= T``: true
for every ``m`` once ``T`` is the device's maximum, and for a smaller ``T`` (the whole tensor
fits one iteration) the one window is at most ``T`` elements. A shard therefore draws from
the ``u*T``-aligned element before its slice to the slice's end, in windows of at least one
stride (``u*T`` elements, 4 MiB in fp32 on an H200), and sets the generator to where the full
draw leaves it.

A tensor past 32-bit indexing (more than ``2**31 - 1`` bytes) is drawn by torch as halves,
split recursively, each its own launch after the whole tensor's offset was reserved: modelled
by :func:`launches`.

DTensor's ``OffsetBasedRNGTracker`` (``torch/distributed/tensor/_random.py``) does something
else: shard ``i`` draws its own local shape from offset ``i * numel(first shard)`` (rounded up
to 4) and every rank ends at ``offset + numel`` (rounded up). Shards get disjoint counter
ranges and every rank of one shard the same values, but the values are no slice of one
full-tensor draw (a launch's element-to-counter map depends on its own size), so they change
with the world size and, for uneven shards, with where the cuts fall. A RaggedShard it would
not see as a cut at all (it counts only ``Shard`` and ``_StridedShard``): every rank would draw
its local shape from the same offset. Here a shard is the slice of the unsharded draw at every
world size, as on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Launch", "Window", "draw_slice", "launches", "max_threads", "windows"]

BLOCK = 256  # DistributionTemplates.h's block_size_bound
OFFSETS_PER_CALL = 4  # max_generator_offsets_per_curand_call: one Philox call per iteration
INDEX_LIMIT = 2**31 - 1  # TensorIterator.can_use_32bit_indexing: elements and max byte offset


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a full draw: elements ``[start, start + numel)``, begun at the
    generator's offset plus ``offset``."""

    start: int
    numel: int
    offset: int


@dataclass(frozen=True)
class Window:
    """One draw that reproduces elements ``[start, start + numel)`` of the full draw when
    begun at the generator's offset plus ``offset``."""

    start: int
    numel: int
    offset: int


def max_threads(device: torch.device) -> int:
    """The most threads a distribution kernel launches on ``device``."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count * (props.max_threads_per_multi_processor // BLOCK) * BLOCK


def unroll(dtype: torch.dtype) -> int:
    """Values per Philox call: a float4 of float accumulators, or a double2."""
    return 2 if dtype == torch.float64 else 4


def threads(numel: int, most: int) -> int:
    return BLOCK * min(-(-numel // BLOCK), most // BLOCK)


def advance(numel: int, values_per_call: int, most: int) -> int:
    """How far one launch of ``numel`` elements moves the generator's offset."""
    return OFFSETS_PER_CALL * ((numel - 1) // (threads(numel, most) * values_per_call) + 1)


def launches(numel: int, itemsize: int, values_per_call: int, most: int) -> tuple[list[Launch], int]:
    """The launches torch's draw of ``numel`` contiguous elements makes, and how far it moves
    the generator's offset in all."""
    reserved = advance(numel, values_per_call, most)
    if _fits_32bit(numel, itemsize):
        return [Launch(0, numel, 0)], reserved
    parts = []
    for start, size in _halves(0, numel, itemsize):  # the whole reserved first, then each half
        parts.append(Launch(start, size, reserved))
        reserved += advance(size, values_per_call, most)
    return parts, reserved


def windows(launch: Launch, start: int, stop: int, values_per_call: int, most: int, piece: int) -> Iterator[Window]:
    """Draws that together cover elements ``[start, stop)`` of ``launch`` (clipped to it),
    each at most ``max(piece, stride)`` elements, ``stride = values_per_call * T``."""
    low, high = max(start, launch.start), min(stop, launch.start + launch.numel)
    if low >= high:
        return
    stride = values_per_call * threads(launch.numel, most)
    size = stride * max(1, piece // stride)
    iteration = (low - launch.start) // stride
    while launch.start + iteration * stride < high:
        first = launch.start + iteration * stride
        yield Window(first, min(size, high - first), launch.offset + OFFSETS_PER_CALL * iteration)
        iteration += size // stride


def draw_slice(
    op: Any,
    out: torch.Tensor,
    start: int,
    numel: int,
    args: tuple,
    kwargs: dict,
    generator: Any,
    most: int,
    piece: int,
) -> None:
    """``out`` = elements ``[start, start + out.numel())`` of ``op`` on a fresh contiguous
    tensor of ``numel`` elements drawn from ``generator`` (its philox offset is moved, and left
    where that full draw leaves it)."""
    stop = start + out.numel()
    values_per_call = unroll(out.dtype)
    base = generator.get_offset()
    parts, moved = launches(numel, out.element_size(), values_per_call, most)
    plan = [w for launch in parts for w in windows(launch, start, stop, values_per_call, most, piece)]
    if plan:
        drawn = torch.empty(max(w.numel for w in plan), dtype=out.dtype, device=out.device)
    for window in plan:
        generator.set_offset(base + window.offset)
        part = drawn[: window.numel]
        op(part, *args, **kwargs)
        low, high = max(window.start, start), min(window.start + window.numel, stop)
        out[low - start : high - start].copy_(part[low - window.start : high - window.start])
    generator.set_offset(base + moved)


def _fits_32bit(numel: int, itemsize: int) -> bool:
    return numel <= INDEX_LIMIT and 1 + (numel - 1) * itemsize <= INDEX_LIMIT


def _halves(start: int, numel: int, itemsize: int) -> Iterator[tuple[int, int]]:
    """TensorIterator's ``with_32bit_indexing`` on a 1-D run: split in halves (the first
    ``numel // 2`` elements first) until each part fits."""
    if _fits_32bit(numel, itemsize):
        yield start, numel
        return
    yield from _halves(start, numel // 2, itemsize)
    yield from _halves(start + numel // 2, numel - numel // 2, itemsize)
