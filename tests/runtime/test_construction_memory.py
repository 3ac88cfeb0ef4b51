"""``fully_shard`` never holds a whole unit: its peak live bytes are what stays (the sharded
buffers) plus small temporaries, as FSDP2's (on CUDA a transient whole unit would also stay
reserved in the compute stream's pool)."""

import pytest
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from tests.support.models import make_decoder
from tests.support.parity import shard_decoder
from vescale_plugins import fully_shard
from vescale_plugins.observe.allocations import AllocationTracker


def _construction_memory(shard):
    """Peak live bytes while sharding the decoder, what is live after it, and the largest
    unit's full parameters (bytes)."""
    model = make_decoder()
    in_layers = {id(p) for layer in model.layers for p in layer.parameters()}
    root_only = [p for p in model.parameters() if id(p) not in in_layers]
    units = [list(layer.parameters()) for layer in model.layers] + [root_only]
    largest_unit = max(sum(p.numel() * p.element_size() for p in params) for params in units)
    with AllocationTracker("cpu") as tracker:
        with tracker.region("fully_shard"):
            shard_decoder(model, shard=shard)
    region = tracker.region_memory("fully_shard")
    return region.peak_bytes, region.end_bytes, largest_unit


def _both_engines():
    return _construction_memory(fully_shard), _construction_memory(torch_fully_shard)


@pytest.mark.parametrize("world", [2, 3])
def test_fully_shard_holds_no_whole_unit(dist_run, world):
    (peak, kept, largest_unit), (fsdp2_peak, fsdp2_kept, _) = dist_run(_both_engines, world)[0]
    # Temporaries: the set-up checks' small vectors and per-parameter copies into the shards.
    assert peak - kept < largest_unit // 4, (peak, kept, largest_unit)
    assert fsdp2_peak - fsdp2_kept < largest_unit // 4, (fsdp2_peak, fsdp2_kept, largest_unit)
