"""``to_empty`` on a meta-built unit holds one copy of the shard at its peak, as FSDP2's: the
DBuffer is allocated on the target device and the sharded parameters become its views, with
no per-parameter local tensor allocated first and copied in."""

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from vescale_plugins import fully_shard
from vescale_plugins.observe.allocations import AllocationTracker

_FEATURES = 4096  # one 4096 x 4096 fp32 Linear: 64 MiB, 32 MiB per rank at W=2


def _to_empty_peak(shard):
    """Peak live bytes during ``to_empty`` of a meta-built, sharded Linear, and one rank's
    share of its weight (bytes)."""
    with torch.device("meta"):
        model = nn.Linear(_FEATURES, _FEATURES, bias=False)
    shard(model)
    with AllocationTracker("cpu") as tracker:
        with tracker.region("to_empty"):
            model.to_empty(device="cpu")
    shard_bytes = _FEATURES * _FEATURES * 4 // torch.distributed.get_world_size()
    # The parameters are usable afterwards (and still views of the unit's storage).
    with torch.no_grad():
        model.weight.to_local().fill_(1.0)
    assert model.weight.to_local().sum().item() == model.weight.to_local().numel()
    return tracker.region_memory("to_empty").peak_bytes, shard_bytes


def _both_engines():
    return _to_empty_peak(fully_shard), _to_empty_peak(torch_fully_shard)


def test_to_empty_of_meta_unit_peaks_at_one_shard_copy(dist_run):
    (peak, shard_bytes), (fsdp2_peak, _) = dist_run(_both_engines, 2)[0]
    # FSDP2 allocates the shard once; so do we (small temporaries allowed, not a second copy).
    assert fsdp2_peak < shard_bytes * 5 // 4, (fsdp2_peak, shard_bytes)
    assert peak < shard_bytes * 5 // 4, (peak, fsdp2_peak, shard_bytes)
