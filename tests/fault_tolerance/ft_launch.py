"""Launching two torchft replica groups of 2 ranks (each rank a process running
:func:`tests.fault_tolerance.ft_train.main`) under a lighthouse started here on loopback, every
process under a deadline: for :mod:`.test_manager_heal`, :mod:`.test_heal_matrix` and
:mod:`.measure_async_heal`.

Rank processes are forked from a multiprocessing fork server that imported torch, torchft and
the package once: a case starts 6 processes, and importing them afresh in each (about 4 s of
CPU apiece) was most of a case's time on 2 cores. Each child is then what ``python -m
tests.fault_tolerance.ft_train`` would be: its own environment, working directory, log file.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
from torchft._torchft import LighthouseServer

from tests.fault_tolerance.ft_case import CRASH_EXIT, Case

STEPS = 8
DEFAULT_CASE = Case()  # the decoder, the modules' state dicts, the all-reduce hook, a flat mesh
DEADLINE_S = 150.0
ROOT = Path(__file__).resolve().parents[2]
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["tests.fault_tolerance.ft_train"])


def _rank_process(env: dict[str, str], log: str, args: list[str]) -> None:
    """A child of the fork server: ``python -m tests.fault_tolerance.ft_train ARGS`` with
    ``env`` as its environment and ``log`` as its stdout and stderr."""
    import sys

    import torch

    from tests.fault_tolerance import ft_train

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    torch.set_num_threads(1)
    sys.argv = ["ft_train", *args]
    ft_train.main(args[0], args[1], int(args[2]), int(args[3]), Path(args[4]), args[5])


class _RankProcess:
    """The ``_RankProcess`` surface the launcher uses, over a fork server's child."""

    def __init__(self, env: dict[str, str], log: Path, args: list[str]) -> None:
        self.process: Any = _FORKS.Process(target=_rank_process, args=(env, str(log), args), daemon=True)
        self.process.start()

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self) -> None:
        self.process.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_group(
    engine: str,
    transport: str,
    replica: int,
    lighthouse: str,
    out: Path,
    scenario: str,
    restarted: bool = False,
    async_quorum: bool = False,
    case: Case = DEFAULT_CASE,
) -> list[_RankProcess]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if restarted:
            env["RESTARTED"] = "1"
        if async_quorum:
            env["ASYNC_QUORUM"] = "1"
        env.update(FT_CASE=case.to_env(), TORCHFT_LIGHTHOUSE=lighthouse, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        log = out / f"log{replica}.{rank}{'.restarted' if restarted else ''}.txt"
        args = [engine, transport, str(replica), str(STEPS), str(out), scenario]
        procs.append(_RankProcess(env, log, args))
    return procs


def _wait(procs: list[_RankProcess], out: Path, until: float, what: str, exit_code: int = 0) -> None:
    while any(p.poll() is None for p in procs) and time.monotonic() < until:
        time.sleep(0.2)
    failed = [p for p in procs if p.poll() != exit_code]
    if failed:
        logs = "\n".join(f.read_text()[-3000:] for f in sorted(out.glob("log*.txt")))
        raise AssertionError(f"{what}: {len(failed)} rank(s) failed or passed the deadline\n{logs}")


def run_heal(
    engine: str, transport: str, out: Path, scenario: str, async_quorum: bool = False, case: Case = DEFAULT_CASE
) -> dict[tuple[int, int], dict]:
    """Run the scenario (see :mod:`.ft_train`); every rank's result by (replica, rank)."""
    # A replica whose heartbeat is older than heartbeat_timeout_ms counts as dead, and a group
    # alone may then form a quorum by itself (min_replicas=1); 3 s leaves room for a heartbeat
    # late on a loaded 2-core machine, and is what a crashed group's old heartbeat holds up
    # the live group's next quorum.
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2 if scenario == "healthy" else 1, heartbeat_timeout_ms=3_000
    )
    procs: list[_RankProcess] = []
    try:
        until = time.monotonic() + DEADLINE_S
        address = lighthouse.address()
        procs += _start_group(engine, transport, 0, address, out, scenario, async_quorum=async_quorum, case=case)
        if scenario == "restart":
            while not list(out.glob("waiting0.*")):
                assert time.monotonic() < until, "replica 0 did not reach WAIT_AT in time"
                assert all(p.poll() is None for p in procs), "a rank of replica 0 exited before WAIT_AT"
                time.sleep(0.1)
        group1 = _start_group(engine, transport, 1, address, out, scenario, async_quorum=async_quorum, case=case)
        procs += group1
        if scenario == "crash":
            _wait(group1, out, until, "replica 1 before its crash", exit_code=CRASH_EXIT)
            procs += _start_group(
                engine, transport, 1, address, out, scenario, restarted=True, async_quorum=async_quorum, case=case
            )
        _wait([p for p in procs if p not in group1 or scenario != "crash"], out, until, f"{engine} over {transport}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    return {(r, k): torch.load(out / f"result{r}.{k}.pt", weights_only=False) for r in range(2) for k in range(2)}
