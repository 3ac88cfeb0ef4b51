"""What the peers pay on the same shapes: padding models of FSDP2, flat sharding, Megatron-FSDP.

For the report only; sizes in elements. Each model takes one FSDP unit's tensors, in module
order, with the same block sizes the planner gets, and the world size.

* FSDP2 ``Shard(0)``: every parameter is padded on dim 0 to ``W * c`` slices, ``c =
  ceil(dim0 / W)`` rounded up so a rank's chunk holds whole blocks (at 1-row blocks this is
  plain FSDP2).
* Flat element-wise sharding (FSDP1's FlatParameter; DeepSpeed ZeRO-3 partitions each
  parameter element-wise likewise): the unit's tensors back to back, padded to a multiple
  of ``W``. Little padding, but rank boundaries cut blocks.
* Megatron-FSDP: a model of ``build_data_parallel_buffer_index`` (Megatron-LM,
  ``megatron_fsdp/param_and_grad_buffer.py``) with its ``chunk_size_factor`` set to the lcm
  of the unit's block sizes: each parameter padded to a multiple of it (two remainders may
  share a chunk, small parameters fill the gaps), the bucket padded to ``W`` chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vescale_plugins.planner.bounds import round_up

__all__ = ["flat_padding_and_cut_blocks", "fsdp2_padding", "megatron_fsdp_padding"]


def fsdp2_padding(shapes: Sequence[Sequence[int]], block_sizes: Sequence[int], world_size: int) -> int:
    """Padding elements of FSDP2 ``Shard(0)`` over one unit (see the module docstring)."""
    padding = 0
    for shape, block in zip(shapes, block_sizes):
        numel = math.prod(shape)
        slice_numel = numel // shape[0]
        chunk_multiple = block // math.gcd(block, slice_numel)
        per_rank = round_up(-(-shape[0] // world_size), chunk_multiple)
        padding += world_size * per_rank * slice_numel - numel
    return padding


def flat_padding_and_cut_blocks(numels: Sequence[int], block_sizes: Sequence[int], world_size: int) -> tuple[int, int]:
    """Padding elements of flat element-wise sharding, and the blocks a rank boundary cuts."""
    total = sum(numels)
    shard = -(-total // world_size)
    cut, start = 0, 0
    for numel, block in zip(numels, block_sizes):
        first_boundary = (start // shard + 1) * shard
        for boundary in range(first_boundary, start + numel, shard):
            cut += (boundary - start) % block != 0
        start += numel
    return world_size * shard - total, cut


def megatron_fsdp_padding(numels: Sequence[int], block_sizes: Sequence[int], world_size: int) -> int:
    """Padding elements of the Megatron-FSDP bucket model (see the module docstring)."""
    chunk = math.lcm(*block_sizes)
    regular = [numel for numel in numels if numel >= chunk]
    fragments = sorted((numel for numel in numels if numel < chunk), reverse=True)
    size = 0
    while regular:
        numel = regular.pop(0)
        remainder = numel % chunk
        size += round_up(numel, chunk)
        if not remainder:
            continue
        space = chunk - remainder
        partner = next((n for n in regular if n % chunk and n % chunk <= space), None)
        if partner is not None:
            # Megatron puts the partner's remainder in this chunk's tail.
            regular.remove(partner)
            space -= partner % chunk
            size += partner - partner % chunk
        for fragment in [f for f in fragments if f <= space]:
            if fragment <= space:
                fragments.remove(fragment)
                space -= fragment
    size += sum(fragments)
    return round_up(size, world_size * chunk) - sum(numels)
