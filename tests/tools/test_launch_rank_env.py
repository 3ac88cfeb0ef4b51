"""``launch_ranks(rank_env=...)``: each rank's environment is set before it joins the group.

What puts several NCCL ranks on one GPU in the device check (a distinct ``NCCL_HOSTID`` per
rank, read by NCCL when the group starts); checked here on gloo ranks.
"""

import os

import pytest

from vescale_plugins.tools.gpu_parts.context import one_gpu_rank_env
from vescale_plugins.tools.launch import launch_ranks


def _environment_seen() -> dict[str, str]:
    return {k: os.environ[k] for k in one_gpu_rank_env(0)}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_each_rank_joins_with_its_own_environment():
    seen = launch_ranks(_environment_seen, 2, timeout_s=90, backend="gloo", threads=1, rank_env=one_gpu_rank_env)
    assert seen == [one_gpu_rank_env(0), one_gpu_rank_env(1)]
    assert seen[0]["NCCL_HOSTID"] != seen[1]["NCCL_HOSTID"]
    assert seen[0]["NCCL_SOCKET_IFNAME"] == "lo"
    assert seen[0]["NCCL_P2P_DISABLE"] == "1"
