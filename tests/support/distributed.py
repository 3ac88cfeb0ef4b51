"""Run a test body on W gloo processes, with a timeout that never lets a test hang.

Workers are kept alive and run many test bodies in one process group, so a test pays for a
process group only when the previous body failed or timed out, or asked for another world
size: one pool is alive at a time (idle ranks of other sizes would only take CPU from the
test that runs). Process groups a body creates (2-D meshes, subgroups) cannot be destroyed
when it returns, as torch's DTensor caches keep the meshes built on them; each holds gloo
threads that poll, so a pool holding more than ``MAX_EXTRA_GROUPS`` of them is replaced
after the body. The rendezvous, the workers' bootstrap, the timeout and the failure report
are the launcher's (``vescale_plugins.tools.launch``): on a failure, the traceback of every
failing rank is in the pytest message; on a timeout, every rank is killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
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

_context = mp.get_context("forkserver")
_context.set_forkserver_preload(["torch", "torch.distributed", "vescale_plugins"])


class DistributedTestError(AssertionError):
    """A test body failed or timed out on one or more ranks."""


def _seeded_body(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, int]:
    """``fn``'s value, and the process groups this rank holds besides the default one."""
    torch.manual_seed(SEED)
    value = fn(*args, **kwargs)
    return value, len(dist.distributed_c10d._world.pg_map) - 1


def _worker(rank: int, world_size: int, port: int, parent_pid: int, tasks: Any, results: Any) -> None:
    launch.exit_when_orphaned(parent_pid)
    torch.set_num_threads(1)
    launch.join_process_group(rank, world_size, port, "gloo", DEFAULT_TIMEOUT_S)
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
    """Keeps one worker pool; call it to run a body on every rank."""

    def __init__(self) -> None:
        self._pool: _Pool | None = None
        self._next_task = 0

    def _start(self, world_size: int) -> _Pool:
        store = launch.rendezvous_store(world_size)
        results = _context.Queue()
        tasks = [_context.Queue() for _ in range(world_size)]
        processes = [
            _context.Process(
                target=_worker,
                args=(rank, world_size, store.port, os.getpid(), tasks[rank], results),
                daemon=True,
                name=f"gloo-rank{rank}-of-{world_size}",
            )
            for rank in range(world_size)
        ]
        for p in processes:
            p.start()
        return _Pool(world_size, store, processes, tasks, results)

    def _kill(self) -> None:
        if self._pool is not None:
            launch.kill(self._pool.processes)
            self._pool = None

    def close(self) -> None:
        """Let the workers leave their process group and exit; kill those that do not."""
        if self._pool is None:
            return
        for q in self._pool.tasks:
            q.put(None)
        for p in self._pool.processes:
            p.join(timeout=5)
        self._kill()

    def __call__(
        self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; return every rank's result.

        ``fn`` must be importable (a module-level function). Raises ``DistributedTestError``
        with each failing rank's traceback, or naming the ranks that did not finish in time.
        """
        __tracebackhide__ = True
        if self._pool is not None and not all(p.is_alive() for p in self._pool.processes):
            self._kill()
        if self._pool is not None and self._pool.world_size != world_size:
            self.close()
        if self._pool is None:
            self._pool = self._start(world_size)
        pool = self._pool
        self._next_task += 1
        for q in pool.tasks:
            q.put((self._next_task, fn, args, kwargs))
        label = f"{fn.__module__}.{fn.__qualname__} on {world_size} rank(s)"
        try:
            outcomes = launch.await_ranks(pool.results, pool.processes, self._next_task, timeout, label)
        except launch.RankFailure as failure:
            self._kill()
            raise DistributedTestError(str(failure)) from None
        if max(groups for _, groups in outcomes) > MAX_EXTRA_GROUPS:
            self.close()
        return [value for value, _ in outcomes]
