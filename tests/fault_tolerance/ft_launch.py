"""Launching two torchft replica groups of 2 ranks (each rank a ``python -m
tests.fault_tolerance.ft_train`` process) under a lighthouse started here on loopback, every
process under a deadline: for :mod:`.test_manager_heal` and :mod:`.measure_async_heal`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from torchft._torchft import LighthouseServer

from tests.fault_tolerance.ft_train import CRASH_EXIT

STEPS = 8
DEADLINE_S = 150.0
ROOT = Path(__file__).resolve().parents[2]


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
) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if restarted:
            env["RESTARTED"] = "1"
        if async_quorum:
            env["ASYNC_QUORUM"] = "1"
        env.update(TORCHFT_LIGHTHOUSE=lighthouse, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        log = open(out / f"log{replica}.{rank}{'.restarted' if restarted else ''}.txt", "w")
        cmd = [
            sys.executable,
            "-m",
            "tests.fault_tolerance.ft_train",
            engine,
            transport,
            str(replica),
            str(STEPS),
            str(out),
            scenario,
        ]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait(procs: list[subprocess.Popen], out: Path, until: float, what: str, exit_code: int = 0) -> None:
    while any(p.poll() is None for p in procs) and time.monotonic() < until:
        time.sleep(0.2)
    failed = [p for p in procs if p.poll() != exit_code]
    if failed:
        logs = "\n".join(f.read_text()[-3000:] for f in sorted(out.glob("log*.txt")))
        raise AssertionError(f"{what}: {len(failed)} rank(s) failed or passed the deadline\n{logs}")


def run_heal(
    engine: str, transport: str, out: Path, scenario: str, async_quorum: bool = False
) -> dict[tuple[int, int], dict]:
    """Run the scenario (see :mod:`.ft_train`); every rank's result by (replica, rank)."""
    # A replica whose heartbeat is older than heartbeat_timeout_ms counts as dead, and a group
    # alone may then form a quorum by itself (min_replicas=1); 3 s leaves room for a heartbeat
    # late on a loaded 2-core machine, and is what a crashed group's old heartbeat holds up
    # the live group's next quorum.
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2 if scenario == "healthy" else 1, heartbeat_timeout_ms=3_000
    )
    procs: list[subprocess.Popen] = []
    try:
        until = time.monotonic() + DEADLINE_S
        address = lighthouse.address()
        procs += _start_group(engine, transport, 0, address, out, scenario, async_quorum=async_quorum)
        if scenario == "restart":
            while not list(out.glob("waiting0.*")):
                assert time.monotonic() < until, "replica 0 did not reach WAIT_AT in time"
                assert all(p.poll() is None for p in procs), "a rank of replica 0 exited before WAIT_AT"
                time.sleep(0.1)
        group1 = _start_group(engine, transport, 1, address, out, scenario, async_quorum=async_quorum)
        procs += group1
        if scenario == "crash":
            _wait(group1, out, until, "replica 1 before its crash", exit_code=CRASH_EXIT)
            procs += _start_group(
                engine, transport, 1, address, out, scenario, restarted=True, async_quorum=async_quorum
            )
        _wait([p for p in procs if p not in group1 or scenario != "crash"], out, until, f"{engine} over {transport}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    return {(r, k): torch.load(out / f"result{r}.{k}.pt", weights_only=False) for r in range(2) for k in range(2)}
