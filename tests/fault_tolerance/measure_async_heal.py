"""Live heals under torchft's asynchronous quorum, ours against FSDP2: how many runs of the
``restart`` scenario (:mod:`.ft_train`, healed over ``PGTransport``) fail, out of ``RUNS``.

    python -m tests.fault_tolerance.measure_async_heal [RUNS]

A run fails when a rank exits with an error or passes the deadline, or the healed group does
not end bit for bit equal to the live one; the first line of each failure's cause is printed.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import torch

from tests.fault_tolerance.ft_launch import run_heal


def _failure(out: Path, error: Exception) -> str:
    """The first error line of the ranks' logs that is a cause (not a peer's lost connection
    or a timeout that follows it), else the exception's first line."""
    lines = []
    for log in sorted(out.glob("log*.txt")):
        lines += re.findall(r"^(?:\[rank\d+\]: )?\w*(?:Error|Exception): .*$", log.read_text(), re.MULTILINE)
    causes = [line for line in lines if "Connection closed by peer" not in line and "timed out" not in line.lower()]
    return ((causes or lines or [str(error).splitlines()[0]])[0])[:200]


def _run(engine: str, out: Path) -> str | None:
    try:
        results = run_heal(engine, "pg", out, "restart", async_quorum=True)
    except Exception as error:  # a failed run is what is counted
        return _failure(out, error)
    for rank in range(2):
        live, healed = results[(0, rank)], results[(1, rank)]
        if any(not torch.equal(value, healed["full"][key]) for key, value in live["full"].items()):
            return f"rank {rank}: the healed group differs from the live one"
    return None


def main(runs: int) -> None:
    for engine in ("vescale", "torch"):
        failures = []
        for run in range(runs):
            with tempfile.TemporaryDirectory() as tmp:
                failure = _run(engine, Path(tmp))
            if failure is not None:
                failures.append(failure)
                print(f"{engine} run {run}: {failure}", flush=True)
        print(f"{engine}: {len(failures)} of {runs} async-quorum live heals failed", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
