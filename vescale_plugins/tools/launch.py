"""Run one function on W spawned ranks (gloo on CPU, NCCL on GPUs) and collect what each
returns; progress events from rank 0 stream to the parent; a failing rank's traceback, a
rank that dies silently, or the deadline stops every rank."""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["launch_ranks"]

# What a rank runs: given a progress callback (a no-op off rank 0), returns picklable data.
RankFn = Callable[[Callable[[str], None]], Any]


def _worker(rank: int, world: int, port: int, run: RankFn, backend: str | None, events: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        result = run((lambda what: events.put(("progress", rank, what))) if rank == 0 else (lambda what: None))
        events.put(("done", rank, result))
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch_ranks(run: RankFn, world: int, timeout_s: float, on_progress: Callable[[str], None] = lambda what: None, backend: str | None = None) -> list[Any]:
    """``run(progress)`` on every rank (``run`` must pickle: a module-level function or a
    ``functools.partial`` of one); the ranks' results in rank order, or an error naming the
    first failing rank with its traceback."""
    context = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    events = context.Queue()
    processes = [context.Process(target=_worker, args=(r, world, store.port, run, backend, events), daemon=True) for r in range(world)]
    for p in processes:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the benchmark did not finish within {timeout_s:.0f} s")
            try:
                kind, rank, payload = events.get(timeout=1.0)
            except queue.Empty:
                if any(not p.is_alive() and i not in results for i, p in enumerate(processes)):
                    raise RuntimeError("a benchmark rank died without reporting")
                continue
            if kind == "progress":
                on_progress(payload)
            elif kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            else:
                results[rank] = payload
    finally:
        for p in processes:
            p.join(timeout=10 if len(results) == world else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    return [results[r] for r in range(world)]
