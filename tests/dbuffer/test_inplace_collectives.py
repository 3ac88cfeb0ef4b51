"""The in-place all-gather and reduce-scatter DBuffer uses: gloo's results, without gloo's copies."""

import pytest
import torch
import torch.distributed as dist

from vescale_plugins.dbuffer.collectives import all_gather_into, reduce_scatter_into, uses_point_to_point
from vescale_plugins.observe.allocations import AllocationTracker

WORLD_SIZES = [2, 3, 4]
SHARD = 1000  # elements per rank (not a power of two)


def _rank_tensor(numel, salt, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * salt + dist.get_rank())
    return torch.randn(numel, generator=g).to(dtype)


def _match_gloo():
    group, world = dist.group.WORLD, dist.get_world_size()
    assert uses_point_to_point(group, torch.device("cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        shard = _rank_tensor(SHARD, 1, dtype)
        expected = shard.new_empty(SHARD * world)
        dist.all_gather_single(expected, shard, group=group)
        gathered = torch.full_like(expected, float("nan"))
        all_gather_into(gathered, shard, group)
        assert torch.equal(gathered, expected)

    # The reduce-scatter sums in gloo's order (its ring's, which depends on where its 1 MiB
    # segments fall): the same bits as gloo's own, for any chunk size, dtype, mean.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shard_numel in (1, 7, SHARD, 70_001, 300_001):
            full = _rank_tensor(shard_numel * world, shard_numel, dtype)
            for average in (False, True):
                op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
                expected = full.new_empty(shard_numel)
                dist.reduce_scatter_single(expected, full.clone(), op=op, group=group)
                reduced = torch.full_like(expected, float("nan"))
                reduce_scatter_into(reduced, full.clone(), group, average=average)
                different = (reduced != expected).sum().item()
                assert different == 0, f"{dtype}, {shard_numel} per rank, {op}: {different} elements differ"
    # PREMUL_SUM, which gloo lacks: each input multiplied by 1/3 first.
    full = _rank_tensor(SHARD * world, 2)
    chunks = [torch.empty_like(full) for _ in range(world)]
    dist.all_gather(chunks, full)
    expected = full.new_empty(SHARD)
    dist.reduce_scatter_single(expected, full * (1 / 3), op=dist.ReduceOp.SUM, group=group)
    reduced = torch.empty(SHARD)
    reduce_scatter_into(reduced, full, group, premul_divide=3.0)
    assert torch.equal(reduced, expected)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_results_match_gloos_collectives(dist_run, world):
    dist_run(_match_gloo, world, timeout=60)


def _in_flight_together():
    """Two all-gathers and two reduce-scatters in flight at once, waited in another order:
    each message still lands in its own collective (per-pair order, one tag per kind)."""
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    shards = [_rank_tensor(SHARD, salt) for salt in (3, 4)]
    fulls = [_rank_tensor(SHARD * world, salt) for salt in (5, 6)]
    gathered = [torch.empty(SHARD * world) for _ in shards]
    reduced = [torch.empty(SHARD) for _ in fulls]
    works = [
        all_gather_into(gathered[0], shards[0], group, async_op=True),
        reduce_scatter_into(reduced[0], fulls[0], group, async_op=True),
        all_gather_into(gathered[1], shards[1], group, async_op=True),
        reduce_scatter_into(reduced[1], fulls[1], group, async_op=True),
    ]
    for work in reversed(works):
        work.wait()
    for shard, out in zip(shards, gathered):
        everyone = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(everyone, shard)
        assert torch.equal(out, torch.cat(everyone))
    for full, out in zip(fulls, reduced):
        everyone = [torch.empty_like(full) for _ in range(world)]
        dist.all_gather(everyone, full)
        torch.testing.assert_close(out, sum(f[rank * SHARD : (rank + 1) * SHARD] for f in everyone))


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_in_flight_together_do_not_mix(dist_run, world):
    dist_run(_in_flight_together, world, timeout=60)


def _temporaries():
    """Bytes each collective allocates beyond its output: gloo's stage a full buffer."""
    group, world = dist.group.WORLD, dist.get_world_size()
    shard, full = _rank_tensor(SHARD, 7), _rank_tensor(SHARD * world, 8)
    gathered, reduced = torch.empty(SHARD * world), torch.empty(SHARD)
    figures = {}
    for name, run in {
        "gloo_all_gather": lambda: dist.all_gather_single(gathered, shard, group=group),
        "all_gather_into": lambda: all_gather_into(gathered, shard, group),
        "gloo_reduce_scatter": lambda: dist.reduce_scatter_single(reduced, full, op=dist.ReduceOp.SUM, group=group),
        "reduce_scatter_into": lambda: reduce_scatter_into(reduced, full, group),
    }.items():
        peaks = []
        for _ in range(3):  # the smallest: a free the profiler misses only adds (bench.memory)
            with AllocationTracker() as tracker:
                run()
            peaks.append(tracker.peak_bytes)
        figures[name] = min(peaks)
    return figures


@pytest.mark.parametrize("world", [2, 3])
def test_no_full_buffer_temporaries(dist_run, world):
    full_bytes = SHARD * world * 4
    for figures in dist_run(_temporaries, world, timeout=60):
        # The detector sees gloo's staging, so it would see ours.
        assert figures["gloo_all_gather"] >= full_bytes, figures
        assert figures["gloo_reduce_scatter"] >= full_bytes, figures
        assert figures["all_gather_into"] == 0, figures
        # The first peer's chunk lands in the output; W > 2 stages the other W - 2.
        assert figures["reduce_scatter_into"] == (world - 2) * SHARD * 4, figures


def _native_elsewhere():
    assert not uses_point_to_point(dist.group.WORLD, torch.device("meta"))
    # A group with a backend per device ("cpu:gloo,cuda:nccl" style) is gloo for CPU tensors.
    per_device = dist.new_group(backend="cpu:gloo")
    assert uses_point_to_point(per_device, torch.device("cpu")) == (dist.get_world_size() > 1)
    return uses_point_to_point(dist.group.WORLD, torch.device("cpu"))


def test_point_to_point_only_for_gloo_on_cpu_with_peers(dist_run):
    assert dist_run(_native_elsewhere, 1) == [False]  # one rank: the native call is a copy
    assert dist_run(_native_elsewhere, 2) == [True, True]


@pytest.mark.distributed
def test_collectives_benchmark_cli_runs_and_reports_the_temporaries():
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "vescale_plugins.bench",
        "collectives",
        "--world-size",
        "2",
        "--shard-mib",
        "0.01",
        "--repeats",
        "2",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = {line.split("  ")[1].strip(): line for line in completed.stdout.splitlines() if line.startswith("  ")}
    assert set(lines) == {
        "gloo all_gather_into_tensor",
        "in-place all-gather",
        "gloo reduce_scatter_tensor",
        "in-place reduce-scatter",
    }, completed.stdout
    assert lines["in-place all-gather"].endswith("temporaries   0.00 MiB"), completed.stdout
    assert lines["in-place reduce-scatter"].endswith("temporaries   0.00 MiB"), completed.stdout
