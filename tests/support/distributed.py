"""Run a test body on W gloo processes, with a timeout that never lets a test hang.

Workers are kept alive per world size and run many test bodies in one process group, so a
test pays for a process group only when the previous body failed or timed out. The parent
holds the rendezvous store on a port the kernel picks (port 0), so ports never collide.
On a failure, the traceback of every failing rank is in the pytest message; on a timeout,
every rank is killed and the pool is rebuilt for the next test.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.reduction import ForkingPickler as _ForkingPickler
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0
# After one rank fails, the others may be stuck in a collective with it: give them this
# long to report, then kill the pool.
FAILURE_GRACE_S = 3.0
SEED = 1234

_context = mp.get_context("forkserver")
_context.set_forkserver_preload(["torch", "torch.distributed", "vescale_plugins"])


class DistributedTestError(AssertionError):
    """A test body failed or timed out on one or more ranks."""


def _exit_when_orphaned(parent_pid: int) -> None:
    # Under forkserver our parent is the fork server, so watch the test process itself.
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        time.sleep(1.0)


def _worker(rank: int, world_size: int, port: int, parent_pid: int, tasks: Any, results: Any) -> None:
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    import torch

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_timedelta(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=_timedelta(DEFAULT_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            torch.manual_seed(SEED)
            value = fn(*args, **kwargs)
            # Pickle here, not in the queue's feeder thread, so a bad result is a failure, not a hang.
            _ForkingPickler.dumps(value)
            results.put((task_id, rank, True, value))
        except BaseException:
            results.put((task_id, rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _timedelta(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


@dataclass
class _Pool:
    world_size: int
    store: dist.TCPStore
    processes: list[Any]
    tasks: list[Any]
    results: Any


class DistributedRunner:
    """Keeps one worker pool per world size; call it to run a body on every rank."""

    def __init__(self) -> None:
        self._pools: dict[int, _Pool] = {}
        self._next_task = 0

    def _start(self, world_size: int) -> _Pool:
        store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
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

    def _kill(self, world_size: int) -> None:
        pool = self._pools.pop(world_size, None)
        if pool is None:
            return
        for p in pool.processes:
            if p.is_alive():
                p.kill()
        for p in pool.processes:
            p.join(timeout=10)

    def close(self) -> None:
        for world_size, pool in list(self._pools.items()):
            for q in pool.tasks:
                q.put(None)
            for p in pool.processes:
                p.join(timeout=5)
            self._kill(world_size)

    def __call__(self, fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; return every rank's result.

        ``fn`` must be importable (a module-level function). Raises ``DistributedTestError``
        with each failing rank's traceback, or naming the ranks that did not finish in time.
        """
        __tracebackhide__ = True
        pool = self._pools.get(world_size)
        if pool is None or not all(p.is_alive() for p in pool.processes):
            self._kill(world_size)
            pool = self._pools[world_size] = self._start(world_size)
        self._next_task += 1
        task_id = self._next_task
        for q in pool.tasks:
            q.put((task_id, fn, args, kwargs))
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            dead = [r for r, p in enumerate(pool.processes) if not p.is_alive() and r not in outcomes]
            if remaining <= 0 or dead:
                break
            try:
                got_id, rank, ok, value = pool.results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if got_id == task_id:
                outcomes[rank] = (ok, value)
                if not ok:
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        missing = [r for r in range(world_size) if r not in outcomes]
        errors = {r: v for r, (ok, v) in outcomes.items() if not ok}
        if missing or errors:
            self._kill(world_size)
            parts = [f"{fn.__module__}.{fn.__qualname__} on {world_size} rank(s)"]
            for rank, tb in sorted(errors.items()):
                parts.append(f"--- rank {rank} failed ---\n{tb}")
            if missing:
                reason = "after another rank failed" if errors else f"within {timeout:.0f}s (timed out or died)"
                parts.append(f"ranks {missing} did not finish {reason}; all ranks were killed")
            raise DistributedTestError("\n".join(parts))
        return [outcomes[r][1] for r in range(world_size)]
