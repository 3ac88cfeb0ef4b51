"""Run a real launcher (``accelerate launch``, ``torchrun``) as a test does: bounded, whole tree killed on timeout.

The launched processes run this repository's code (``PYTHONPATH``) with one thread each, and
with no ``ACCELERATE_*``/``FSDP_*`` variables of the test process leaking into them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KILL_GRACE_S = 15


def launch(args: list[str], *, timeout_s: float, env: dict[str, str] | None = None) -> str:
    """Run ``python ARGS`` from the repository root; fail the test unless it exits 0 within ``timeout_s``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    full_env.update(
        OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    full_env.update(env or {})
    command = [sys.executable, *args]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # torchrun stops its workers on SIGTERM; SIGKILL (which would orphan them) only as a last resort.
        os.killpg(process.pid, signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        pytest.fail(f"{' '.join(args[:4])} ... did not finish within {timeout_s:.0f}s:\n{output[-4000:]}")
    assert process.returncode == 0, f"{' '.join(args)} exited with {process.returncode}:\n{output[-6000:]}"
    return output
