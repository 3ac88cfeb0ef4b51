"""Run a function on W local ranks (gloo on CPU, NCCL on GPUs) and collect what each returns.

:func:`launch_ranks` spawns the ranks for one run (the benchmark, the forecast's calibration,
the GPU check). The pieces it is made of serve the test suite's pooled runner too, which
keeps its ranks alive between test bodies:

* :func:`rendezvous_store`: the parent's store, on a port the kernel picks, so launches never
  collide;
* :func:`exit_when_orphaned` and :func:`join_process_group`: a rank's bootstrap;
* :func:`run_and_report`: run one body and put its result, or its traceback, on the queue;
* :func:`await_ranks`: wait for every rank's result; a failing rank's traceback, a rank that
  dies silently or the deadline raise :class:`RankFailure` (the caller then kills every rank,
  :func:`kill`).

A rank reports progress with :func:`report_progress` (rank 0's reaches ``on_progress``).
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "RankFailure",
    "await_ranks",
    "exit_when_orphaned",
    "join_process_group",
    "kill",
    "launch_ranks",
    "rendezvous_store",
    "report_progress",
    "run_and_report",
]

STORE_TIMEOUT_S = 60.0
# After one rank fails, the others may be stuck in a collective with it: this long to report.
FAILURE_GRACE_S = 3.0
# How often the parent looks for ranks that died without reporting.
POLL_S = 0.5

# Messages on the results queue: (task, rank, kind, payload), kind one of these.
DONE, ERROR, PROGRESS = "done", "error", "progress"

_progress: Callable[[str], None] = lambda what: None


class RankFailure(RuntimeError):
    """Ranks failed, died or ran out of time; the message has each failing rank's traceback."""


def rendezvous_store(world: int) -> dist.TCPStore:
    """The parent's TCPStore for ``world`` ranks, on a free port the kernel picks (``store.port``)."""
    return dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)


def exit_when_orphaned(parent_pid: int) -> None:
    """End this process once ``parent_pid`` is gone (checked every second, on a daemon thread).

    Daemon children die with a parent that exits, not with one that is SIGKILLed; and under
    forkserver a rank's parent is the fork server, not the process that asked for it.
    """

    def watch() -> None:
        while True:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="exit-when-orphaned").start()


def join_process_group(rank: int, world: int, port: int, backend: str, timeout_s: float) -> None:
    """Initialise the default process group through the parent's store on ``port``.

    NCCL: this rank drives GPU ``rank % device_count`` (set before the group, which binds to it).
    ``timeout_s``: how long a collective may wait.
    """
    device_id = None
    if backend == "nccl":
        device_id = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device_id)
    store = dist.TCPStore(
        "127.0.0.1", port, world + 1, is_master=False, timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)
    )
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device_id,
    )


def run_and_report(results: Any, task: int, rank: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """``fn(*args, **kwargs)``; put ``(task, rank, DONE, value)`` or ``(task, rank, ERROR,
    traceback)`` on ``results``. Returns whether it succeeded."""
    try:
        value = fn(*args, **kwargs)
        # Pickled here, not in the queue's feeder thread, so a bad result is a failure, not a hang.
        ForkingPickler.dumps(value)
    except BaseException:
        results.put((task, rank, ERROR, traceback.format_exc()))
        return False
    results.put((task, rank, DONE, value))
    return True


def report_progress(what: str) -> None:
    """Tell the launching process that this rank did ``what`` (only rank 0's count)."""
    _progress(what)


def await_ranks(
    results: Any,
    processes: Sequence[Any],
    task: int,
    timeout_s: float,
    label: str,
    on_progress: Callable[[str], None] | None = None,
) -> list[Any]:
    """Every rank's value for ``task``, in rank order; other tasks' messages are dropped.

    Raises :class:`RankFailure` naming ``label`` (what ran, on how many ranks), with the
    traceback of each rank that failed, and the ranks that died or were still running at the
    deadline (``timeout_s`` from now, or ``FAILURE_GRACE_S`` after the first failure).
    """
    world = len(processes)
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcomes) < world:
        remaining = deadline - time.monotonic()
        # A rank's messages are all in the pipe once it has exited: read what is left, then stop.
        stopped = remaining <= 0 or any(not p.is_alive() and r not in outcomes for r, p in enumerate(processes))
        try:
            got_task, rank, kind, payload = results.get(block=not stopped, timeout=min(max(remaining, 0.0), POLL_S))
        except queue.Empty:
            if stopped:
                break
            continue
        if got_task != task:
            continue
        if kind == PROGRESS:
            if on_progress is not None:
                on_progress(payload)
            continue
        outcomes[rank] = (kind == DONE, payload)
        if kind == ERROR:
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    missing = [r for r in range(world) if r not in outcomes]
    errors = {r: payload for r, (ok, payload) in outcomes.items() if not ok}
    if missing or errors:
        parts = [label]
        parts += [f"--- rank {rank} failed ---\n{tb}" for rank, tb in sorted(errors.items())]
        if missing:
            reason = "after another rank failed" if errors else f"within {timeout_s:.0f}s (timed out or died)"
            parts.append(f"ranks {missing} did not finish {reason}; all ranks were killed")
        raise RankFailure("\n".join(parts))
    return [outcomes[r][1] for r in range(world)]


def kill(processes: Sequence[Any]) -> None:
    """SIGKILL every process still alive and reap them all."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(timeout=10)


def _rank_main(
    rank: int,
    world: int,
    port: int,
    parent_pid: int,
    backend: str,
    threads: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    env: dict[str, str],
) -> None:
    global _progress
    exit_when_orphaned(parent_pid)
    # What launchers (torchrun) set, for code that reads them (Lightning's and Accelerate's).
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    os.environ.update(env)  # before the process group: NCCL reads its variables when it starts
    torch.set_num_threads(threads)
    if rank == 0:
        _progress = lambda what: results.put((0, rank, PROGRESS, what))
    try:
        join_process_group(rank, world, port, backend, timeout_s)
    except BaseException:
        results.put((0, rank, ERROR, traceback.format_exc()))
        return
    try:
        run_and_report(results, 0, rank, fn, *args)
    finally:
        dist.destroy_process_group()


def launch_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout_s: float,
    on_progress: Callable[[str], None] | None = None,
    backend: str | None = None,
    threads: int | None = None,
    rank_env: Callable[[int], dict[str, str]] | None = None,
) -> list[Any]:
    """``fn(*args)`` on ``world`` spawned ranks of one process group; each rank's value, in
    rank order. ``fn`` and ``args`` must pickle (``fn`` a module-level function).

    ``backend``: default NCCL when CUDA is available (one GPU per rank), else gloo.
    ``threads``: torch threads per rank (default: this machine's cores shared among the
    ranks). ``rank_env``: environment variables for each rank (by rank), set before it joins
    the process group. ``timeout_s`` bounds the whole run and each collective; at the deadline, or when
    a rank fails or dies, every rank is killed and :class:`RankFailure` says why.
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    context = mp.get_context("spawn")
    store = rendezvous_store(world)
    results = context.Queue()
    processes = [
        context.Process(
            target=_rank_main,
            args=(
                rank,
                world,
                store.port,
                os.getpid(),
                backend,
                threads,
                timeout_s,
                fn,
                args,
                results,
                rank_env(rank) if rank_env else {},
            ),
            daemon=True,
            name=f"rank{rank}-of-{world}",
        )
        for rank in range(world)
    ]
    for p in processes:
        p.start()
    try:
        values = await_ranks(
            results, processes, 0, timeout_s, f"{fn.__module__}.{fn.__qualname__} on {world} rank(s)", on_progress
        )
    except RankFailure:
        kill(processes)
        raise
    for p in processes:
        p.join(timeout=10)
    kill(processes)
    return values
