"""Stand-in parts for the device check's driver tests (``tests/tools/test_gpu_check.py``)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist


def passes(ctx: Any) -> dict[str, Any]:
    return {"summary": f"ran with world {ctx.world}", "timeout_s": ctx.timeout_s}


def raises(ctx: Any) -> dict[str, Any]:
    raise RuntimeError("this part fails")


def overruns(ctx: Any) -> dict[str, Any]:
    time.sleep(600)
    return {}


def skips(ctx: Any) -> dict[str, Any]:
    return {"status": "skipped", "reason": "its subject is absent"}


def case_noted_then_died(kind: str, engine: str, reshard: bool, keep: bool, notes: str) -> dict[str, Any]:
    """A ``cuda_graph`` case whose rank 0 captures (and notes it) and whose other ranks then
    die without a word, as a rank stuck in a collective is killed at the case's deadline."""
    note = Path(notes) / "rank0.json"
    if dist.get_rank() == 0:
        out = {"capture": "captured ok"}
        note.write_text(json.dumps(out))
        return out
    while not note.exists():
        time.sleep(0.1)
    os._exit(3)
