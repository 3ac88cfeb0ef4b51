"""For scripts/gpu_check.sh only: the device machine's torch (2.11) is older than the package's
floor (2.13), and nothing newer can be installed there. Python imports this file at start-up in
every process of the check (the script puts this folder on PYTHONPATH), and it gives that older
torch the two names of 2.13 the package uses; on torch >= 2.13 it changes nothing."""

import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_common

if not hasattr(dist, "all_gather_single"):  # 2.13's names for the tensor-in/tensor-out collectives
    dist.all_gather_single = dist.all_gather_into_tensor
    dist.reduce_scatter_single = dist.reduce_scatter_tensor
if not hasattr(_fsdp_common, "ShardPlacementResult"):  # 2.13's answer naming another mesh

    class ShardPlacementResult:  # never returned by an older torch's shard_placement_fn
        pass

    _fsdp_common.ShardPlacementResult = ShardPlacementResult
