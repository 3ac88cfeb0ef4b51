"""docs/design.md's walk through one training step names exactly the files the step enters.

Two decoder blocks under ``fully_shard`` at W=2: the set-up (``fully_shard`` and the first
iteration, whose forward, backward and ``AdamW.step()`` run the lazy set-up), then one steady
iteration phase by phase (forward, backward, step with ``zero_grad``), traced with
``sys.setprofile``: for each phase the set of our files entered must equal the files the doc
lists for it (its ``Files entered:`` lines), so the map cannot drift from the code.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections import defaultdict

import torch
import torch.nn as nn

from tests.support.launched import REPO

PHASES = ("set-up", "forward", "backward", "step")
# RaggedShard's value equality (and its runs'), which torch's own caches ask for in a steady
# phase only when two equal placements are not one object: that depends on which specs those
# caches handed out first (on the tests before), so a steady phase may or may not enter them.
VALUE_EQUALITY = {"vescale_plugins/ragged/placement.py", "vescale_plugins/ragged/units.py"}
OURS = ("vescale_plugins", "lightning_strategy", "accelerate_plugin")


class _Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1)
        return self.o(scores @ x)


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = _Attention(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x + self.attn(x))


class _FileTracer:
    """Our files entered (called into from another file) while ``phase`` is set."""

    def __init__(self) -> None:
        self.files: dict[str, set[str]] = defaultdict(set)
        self.phase: str | None = None
        self._root = str(REPO) + os.sep

    def __call__(self, frame, event, arg) -> None:
        if event != "call" or self.phase is None:
            return
        path = frame.f_code.co_filename
        if path.startswith(self._root) and path[len(self._root) :].startswith(OURS):
            self.files[self.phase].add(path[len(self._root) :])

    def __enter__(self) -> _FileTracer:
        sys.setprofile(self)
        threading.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


def _traced_step() -> dict[str, list[str]]:
    from vescale_plugins import fully_shard
    from vescale_plugins.dbuffer.reduction import gradient_reduction
    from vescale_plugins.runtime.fsdp2_semantics import defers_upcast

    # Answers cached per argument: the walk traces a fresh process's set-up, whatever the tests
    # before asked in this worker.
    gradient_reduction.cache_clear()
    defers_upcast.cache_clear()

    model = nn.Sequential(_Block(16), _Block(16))
    inputs = torch.randn(4, 8, 16)
    with _FileTracer() as tracer:
        tracer.phase = "set-up"
        for block in model:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # The first iteration's lazy work (the root's, the optimizer's states) is set-up's.
        model(inputs).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        tracer.phase = "forward"
        loss = model(inputs).sum()
        tracer.phase = "backward"
        loss.backward()
        tracer.phase = "step"
        optimizer.step()
        optimizer.zero_grad()
        tracer.phase = None
    return {phase: sorted(files) for phase, files in tracer.files.items()}


def documented_files() -> dict[str, list[str]]:
    """The ``Files entered (<phase>):`` lines of docs/design.md, as repository paths."""
    text = (REPO / "docs" / "design.md").read_text()
    listed: dict[str, list[str]] = {}
    for phase, body in re.findall(r"^Files entered \(([\w-]+)\):(.*?)(?:\n\n|\Z)", text, re.M | re.S):
        listed[phase] = sorted(re.findall(r"`([\w/]+\.py)`", body))
    return listed


def test_design_doc_lists_each_phase():
    assert set(documented_files()) == set(PHASES)


def test_design_walk_enters_the_documented_files(dist_run):
    traced = dist_run(_traced_step, 2)[0]
    documented = documented_files()
    for phase in PHASES:
        entered, listed = set(traced.get(phase, [])), set(documented[phase])
        if phase != "set-up":
            entered -= VALUE_EQUALITY
        assert entered == listed, (
            f"docs/design.md's {phase} files differ from the traced step's: "
            f"entered but not listed {sorted(entered - listed)}, listed but not entered {sorted(listed - entered)}"
        )
