"""Run a test body on W gloo processes, with a timeout that never lets a test hang.

Workers are kept alive and run many test bodies in one process group: one pool per world
size, so a test pays for a process group only when the previous body on that pool failed or
timed out, or when its world size was not used recently. At most ``MAX_POOLS`` pools are alive
(the least recently used one is closed to start another): idle ranks wait on a queue and a
gloo group's threads sleep, so a kept pool costs memory, not CPU. Process groups a body
creates (2-D meshes, subgroups) cannot be destroyed when it returns, as torch's DTensor caches
keep the meshes built on them; each holds gloo threads that poll, so a pool holding more
than ``MAX_EXTRA_GROUPS`` of them is replaced after the body. The rendezvous, the workers'
bootstrap, the timeout and the failure report are the launcher's
(``vescale_plugins.tools.launch``): on a failure, the traceback of every failing rank is in
the pytest message; on a timeout, every rank of that pool is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vescale_plugins.tools import launch

DEFAULT_TIMEOUT_S = 120.0
SEED = 1234
# Process groups besides the default one a pool may hold before it is replaced (each rank of
# a 2-D mesh is in 2; each group has a gloo thread that polls while the pool is idle).
MAX_EXTRA_GROUPS = 8
# Pools alive at once: W=1 to 4 cover nearly every test; one for W=8 replaces the least recently
# used. Ten idle workers hold about 2 GB and no CPU to speak of.
MAX_POOLS = 4

_context = mp.get_context("forkserver")
_context.set_forkserver_preload(["torch", "torch.distributed", "vescale_plugins"])


class DistributedTestError(AssertionError):
    """A test body failed or timed out on one or more ranks."""


def _seeded_body(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, int]:
    """``fn``'s value, and the process groups this rank holds besides the default one.

    The pooled worker's environment variables are restored afterwards: a variable one test
    leaves behind changes the next (Lightning's ``seed_everything`` sets ``PL_GLOBAL_SEED``,
    which seeds a later Fabric's ``DistributedSampler``: other data, other losses)."""
    torch.manual_seed(SEED)
    environ = dict(os.environ)
    try:
        value = fn(*args, **kwargs)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return value, len(dist.distributed_c10d._world.pg_map) - 1


def build_one_vescale_unit() -> None:
    """Build, run forward and backward through, one tiny unit of ours on this rank's group.

    A worker pool for FSDP2's own tests (``--fsdp-impl=torch``) runs this first, so that every
    process-wide effect of ours (DTensor patches, hooks, caches) is in place while they run:
    the compatibility suite on torch's side then proves those effects harmless to FSDP2.
    """
    import vescale_plugins

    unit = vescale_plugins.fully_shard(torch.nn.Linear(4, 4))
    unit(torch.ones(2, 4)).sum().backward()


def _worker(
    rank: int,
    world_size: int,
    port: int,
    parent_pid: int,
    tasks: Any,
    results: Any,
    prepare: Callable[[], None] | None,
) -> None:
    launch.exit_when_orphaned(parent_pid)
    torch.set_num_threads(1)
    launch.join_process_group(rank, world_size, port, "gloo", DEFAULT_TIMEOUT_S)
    if prepare is not None:
        prepare()
    while (task := tasks.get()) is not None:
        task_id, fn, args, kwargs = task
        launch.run_and_report(results, task_id, rank, _seeded_body, fn, args, kwargs)
    dist.destroy_process_group()


@dataclass
class _Pool:
    world_size: int
    store: dist.TCPStore
    processes: list[Any]
    tasks: list[Any]
    results: Any


class DistributedRunner:
    """Keeps one worker pool per world size (``MAX_POOLS`` at most); call it to run a body on every rank.

    ``prepare``: an importable function every worker runs once, after joining its process
    group and before its first body (e.g. ``build_one_vescale_unit``).
    """

    def __init__(self, prepare: Callable[[], None] | None = None) -> None:
        self._prepare = prepare
        self._pools: OrderedDict[int, _Pool] = OrderedDict()  # least recently used first
        self._next_task = 0
        self.starts: dict[int, int] = {}  # world size -> pools started, for the summary line

    def _start(self, world_size: int) -> _Pool:
        store = launch.rendezvous_store(world_size)
        results = _context.Queue()
        tasks = [_context.Queue() for _ in range(world_size)]
        processes = [
            _context.Process(
                target=_worker,
                args=(rank, world_size, store.port, os.getpid(), tasks[rank], results, self._prepare),
                daemon=True,
                name=f"gloo-rank{rank}-of-{world_size}",
            )
            for rank in range(world_size)
        ]
        for p in processes:
            p.start()
        self.starts[world_size] = self.starts.get(world_size, 0) + 1
        return _Pool(world_size, store, processes, tasks, results)

    def _kill(self, world_size: int) -> None:
        pool = self._pools.pop(world_size, None)
        if pool is not None:
            launch.kill(pool.processes)

    def _close(self, world_size: int) -> None:
        """Let that pool's workers leave their process group and exit; kill those that do not."""
        pool = self._pools.get(world_size)
        if pool is None:
            return
        for q in pool.tasks:
            q.put(None)
        for p in pool.processes:
            p.join(timeout=5)
        self._kill(world_size)

    def close(self) -> None:
        """Close every pool."""
        for world_size in list(self._pools):
            self._close(world_size)

    def _pool_for(self, world_size: int) -> _Pool:
        pool = self._pools.get(world_size)
        if pool is not None and not all(p.is_alive() for p in pool.processes):
            self._kill(world_size)
            pool = None
        if pool is None:
            while len(self._pools) >= MAX_POOLS:
                self._close(next(iter(self._pools)))
            pool = self._pools[world_size] = self._start(world_size)
        self._pools.move_to_end(world_size)
        return pool

    def __call__(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; return every rank's result.

        ``fn`` must be importable (a module-level function). Raises ``DistributedTestError``
        with each failing rank's traceback, or naming the ranks that did not finish in time.
        """
        __tracebackhide__ = True
        pool = self._pool_for(world_size)
        self._next_task += 1
        for q in pool.tasks:
            q.put((self._next_task, fn, args, kwargs))
        label = f"{fn.__module__}.{fn.__qualname__} on {world_size} rank(s)"
        try:
            outcomes = launch.await_ranks(pool.results, pool.processes, self._next_task, timeout, label)
        except launch.RankFailure as failure:
            self._kill(world_size)
            raise DistributedTestError(str(failure)) from None
        if max(groups for _, groups in outcomes) > MAX_EXTRA_GROUPS:
            self._close(world_size)
        return [value for value, _ in outcomes]
