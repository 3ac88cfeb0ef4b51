"""Stand-in parts for the device check's driver tests (``tests/tools/test_gpu_check.py``)."""

from __future__ import annotations

import time
from typing import Any


def passes(ctx: Any) -> dict[str, Any]:
    return {"summary": f"ran with world {ctx.world}", "timeout_s": ctx.timeout_s}


def raises(ctx: Any) -> dict[str, Any]:
    raise RuntimeError("this part fails")


def overruns(ctx: Any) -> dict[str, Any]:
    time.sleep(600)
    return {}


def skips(ctx: Any) -> dict[str, Any]:
    return {"status": "skipped", "reason": "its subject is absent"}
