"""The multi-process harness itself: results, failures, hangs, and cleanup."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import MAX_POOLS, DistributedRunner, DistributedTestError, build_one_vescale_unit


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), os.getpid()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def _hang_on_rank_zero():
    if dist.get_rank() == 0:
        time.sleep(60)
    return dist.get_rank()


def _pid():
    return os.getpid()


def _mark_prepared():
    os.environ["HARNESS_PREPARED"] = str(int(os.environ.get("HARNESS_PREPARED", "0")) + 1)


def _prepared_count():
    return os.environ.get("HARNESS_PREPARED")


def _patches_installed():
    from vescale_plugins.ragged.dtensor import is_installed

    return is_installed()


def _random_draw():
    return torch.rand(3).tolist()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_runs_the_body_in_one_group(dist_run, world_size):
    results = dist_run(_rank_and_sum, world_size)
    assert [r[0] for r in results] == list(range(world_size))
    assert all(r[1] == world_size for r in results)
    assert all(r[2] == world_size * (world_size + 1) / 2 for r in results)
    assert len({r[3] for r in results}) == world_size


def test_pool_is_reused_between_bodies(dist_run):
    assert dist_run(_pid, 2) == dist_run(_pid, 2)


def test_a_pool_per_world_size_outlives_bodies_of_other_sizes(dist_run):
    two = dist_run(_pid, 2)
    three = dist_run(_pid, 3)
    assert dist_run(_pid, 2) == two
    assert dist_run(_pid, 3) == three


def test_least_recently_used_pool_is_closed_beyond_the_bound(dist_run):
    sizes = list(range(1, MAX_POOLS + 2))
    first = dist_run(_pid, sizes[0])
    for size in sizes[1:]:
        dist_run(_pid, size)
    assert set(dist_run(_pid, sizes[0])).isdisjoint(first)
    with pytest.raises(ProcessLookupError):
        os.kill(first[0], 0)


def test_failing_rank_traceback_is_reported_and_pool_rebuilt(dist_run):
    before = dist_run(_pid, 2)
    with pytest.raises(DistributedTestError) as info:
        dist_run(_fail_on_rank_one, 2)
    assert "rank 1 failed" in str(info.value)
    assert "boom on rank one" in str(info.value)
    after = dist_run(_pid, 2)
    assert set(before).isdisjoint(after)
    for pid in before:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_hang_times_out_and_kills_every_rank(dist_run):
    pids = dist_run(_pid, 3)
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="did not finish"):
        dist_run(_hang_on_rank_zero, 3, timeout=3)
    assert time.monotonic() - start < 20
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_bodies_are_seeded_identically_on_every_rank(dist_run):
    first = dist_run(_random_draw, 3)
    assert all(r == first[0] for r in first)
    assert dist_run(_random_draw, 3) == first


@pytest.mark.distributed
def test_prepare_runs_once_in_every_worker_before_its_bodies():
    runner = DistributedRunner(prepare=_mark_prepared)
    try:
        assert runner(_prepared_count, 2) == ["1", "1"]
        assert runner(_prepared_count, 2) == ["1", "1"]
    finally:
        runner.close()


@pytest.mark.distributed
def test_fsdp2s_side_runs_with_our_torch_patches_installed_in_every_worker():
    """What ``--fsdp-impl=torch`` gives every worker (tests/conftest.py): our unit built, so our
    patches are in place while FSDP2's own cases run."""
    runner = DistributedRunner(prepare=build_one_vescale_unit)
    try:
        assert runner(_patches_installed, 2) == [True, True]
    finally:
        runner.close()
