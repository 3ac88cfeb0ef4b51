"""Count the collectives a piece of code issues, by kind."""

from torch.distributed.tensor.debug import CommDebugMode

import vescale_plugins.dbuffer.buffer as dbuffer_module
from vescale_plugins.dbuffer.collectives import uses_point_to_point

_COLLECTIVE_NAMES = {
    "allgather": "all_gather",
    "alltoall": "all_to_all",
    "reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce",
    "broadcast": "broadcast",
}


def comm_counts(fn):
    """Run ``fn`` and count the collectives it issued, by kind (c10d op names normalised).

    DBuffer's collectives on gloo are point-to-point messages (``inplace_collectives``), which
    ``CommDebugMode`` does not see: they are counted as the collective they implement.
    """
    counts = {}
    originals = dbuffer_module.all_gather_into, dbuffer_module.reduce_scatter_into

    def counted(kind, collective):
        def run(output, tensor, group, **kwargs):
            if uses_point_to_point(group, output.device):
                counts[kind] = counts.get(kind, 0) + 1
            return collective(output, tensor, group, **kwargs)

        return run

    dbuffer_module.all_gather_into = counted("all_gather", originals[0])
    dbuffer_module.reduce_scatter_into = counted("reduce_scatter", originals[1])
    try:
        with CommDebugMode() as mode:
            out = fn()
    finally:
        dbuffer_module.all_gather_into, dbuffer_module.reduce_scatter_into = originals
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1].replace("_", "") if "reduce_scatter" not in str(op) else "reduce_scatter"
        kind = next((v for k, v in _COLLECTIVE_NAMES.items() if k.replace("_", "") in name), name)
        counts[kind] = counts.get(kind, 0) + n
    return out, counts
