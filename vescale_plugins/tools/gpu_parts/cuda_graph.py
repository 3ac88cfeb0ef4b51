"""``cuda_graph``: one training step (forward and backward) captured in a CUDA graph, both engines.

torchtitan captures forward and backward in a CUDA graph by default; by its account FSDP2
cannot be captured with ``reshard_after_forward=True``. Each case (engine, ``reshard_after_forward``, and ours
also with ``set_keep_unsharded_storage(True)``) shards the decoder (a unit per block and the
root) on the part's ranks, runs the step eagerly on a batch for reference, warms up on a side
stream (as ``torch.cuda.graph``'s docs ask), captures the step on another batch, then copies
the reference batch into the static inputs, replays, and compares loss and gradients with
the eager ones. It reports, never fails: "captured ok" or "failed: <error>", and whether the
replay gave the eager numbers. On CUDA each case runs in ranks of its own (a failed capture
can leave a rank's stream or communicator unusable, or the ranks out of step), which note
what they found in a folder as they go, so a case whose ranks then hang still says why.

Off CUDA, a dry run of the same code with the capture replaced by an eager call (the graph is
CUDA only): it checks the part, not capture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vescale_plugins.tools import parity_model
from vescale_plugins.tools.gpu_parts.context import PartContext, launch

__all__ = ["run", "each_case_in_its_ranks", "CASES"]

# (engine, reshard_after_forward, keep_unsharded_storage); the question first (can ours be
# captured where FSDP2 cannot?), in case the budget runs out.
CASES = [
    ("fsdp2", True, False),
    ("vescale", True, False),
    ("fsdp2", False, False),
    ("vescale", False, False),
    ("vescale", True, True),
]
WARMUP_STEPS = 3
CASE_BUDGET_S = 40.0
# Replay runs the captured kernels on the same inputs; only order-dependent kernels (the
# embedding's backward atomics) can differ.
RTOL, ATOL = 1e-5, 1e-6


def _name(engine: str, reshard: bool, keep: bool) -> str:
    return f"{engine} reshard_after_forward={reshard}" + (" keep_unsharded_storage" if keep else "")


def _sharded(engine: str, reshard: bool, keep: bool, device: torch.device) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from vescale_plugins import fully_shard

    shard: Callable[..., Any] = fully_shard if engine == "vescale" else torch_fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = parity_model.make_decoder().to(device)
    for layer in model.layers:
        shard(layer, mesh=mesh, reshard_after_forward=reshard)
    shard(model, mesh=mesh, reshard_after_forward=reshard)
    if keep:
        cast(Any, model).set_keep_unsharded_storage(True)  # FSDP2 has it from torch 2.15 only
    return model


def _grads(model: torch.nn.Module) -> torch.Tensor:
    """This rank's gradient shards, flat, in fp32 (a copy); NaN marks a missing gradient."""
    return torch.cat(
        [
            cast(DTensor, p.grad).to_local().float().flatten()
            if p.grad is not None
            else torch.full((1,), float("nan"), device=p.device)
            for p in model.parameters()
        ]
    )


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() if got.numel() else 0.0


def _case_rank(kind: str, engine: str, reshard: bool, keep: bool, notes: str | None = None) -> dict[str, Any]:
    """One case on this rank: eager reference, warm-up, capture, replay, comparison. With
    ``notes`` (a folder), what this rank knows is also written there as soon as it knows
    it, for when another rank hangs and the launch is killed."""
    cuda = kind == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = _sharded(engine, reshard, keep, device)
    batches = [tuple(t.to(device) for t in parity_model.local_batch(step)) for step in (0, 1)]
    static_tokens, static_targets = (t.clone() for t in batches[0])

    def step() -> torch.Tensor:
        loss = parity_model.loss_fn(model(static_tokens), static_targets)
        loss.backward()
        return loss.detach()

    def use(batch: tuple[torch.Tensor, ...]) -> None:
        static_tokens.copy_(batch[0])
        static_targets.copy_(batch[1])

    def note(out: dict[str, Any]) -> dict[str, Any]:
        if notes is not None:
            (Path(notes) / f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
        return out

    use(batches[1])
    eager_loss, eager_grads = step().clone(), _grads(model)
    use(batches[0])
    _warm_up(model, step, cuda)
    model.zero_grad(set_to_none=True)  # the captured backward allocates the gradients in the graph's pool
    graph = torch.cuda.CUDAGraph() if cuda else None
    try:
        if graph is not None:
            with torch.cuda.graph(graph):
                static_loss = step()
        else:
            static_loss = step()
    except Exception as error:  # the answer, not a failure of the part
        return note({"capture": f"failed: {type(error).__name__}: {error}"[:1500]})
    out = note({"capture": "captured ok" if cuda else "dry run ok (no capture off CUDA)"})
    use(batches[1])
    try:
        if graph is not None:
            graph.replay()
            torch.cuda.synchronize()
        else:
            model.zero_grad(set_to_none=True)
            static_loss = step()
    except Exception as error:
        return note({**out, "replay": f"failed: {type(error).__name__}: {error}"[:1500]})
    grads = _grads(model)
    return note(
        {
            **out,
            "loss_diff": (static_loss.float() - eager_loss.float()).abs().item(),
            "max_grad_diff": _max_diff(grads, eager_grads),
            "replay_equals_eager": torch.allclose(grads, eager_grads, rtol=RTOL, atol=ATOL)
            and torch.allclose(static_loss.float(), eager_loss.float(), rtol=RTOL, atol=ATOL),
        }
    )


def _warm_up(model: torch.nn.Module, step: Callable[[], torch.Tensor], cuda: bool) -> None:
    """A few steps on a side stream before capture (``torch.cuda.graph``'s docs ask for it)."""
    side = torch.cuda.Stream() if cuda else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for _ in range(WARMUP_STEPS):
            model.zero_grad(set_to_none=True)
            step()
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)


def _verdict(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The case's result: rank 0's, with the first failure of any rank, the worst differences."""
    out = dict(ranks[0])
    for key in ("capture", "replay"):
        failed = [r[key] for r in ranks if str(r.get(key, "")).startswith("failed")]
        if failed:
            out[key] = failed[0]
    for key in ("loss_diff", "max_grad_diff"):
        if all(key in r for r in ranks):
            out[key] = max(r[key] for r in ranks)
    if "replay_equals_eager" in out:
        out["replay_equals_eager"] = all(r.get("replay_equals_eager", False) for r in ranks)
    return out


def _summary(cases: dict[str, dict[str, Any]]) -> str:
    def line(figures: dict[str, Any]) -> str:
        text = str(figures.get("replay") or figures["capture"]).splitlines()[0][:120]
        if "replay_equals_eager" in figures:
            text += ", replay == eager" if figures["replay_equals_eager"] else ", replay != eager"
        if "ranks_failed" in figures:
            text += f" (ranks failed: {str(figures['ranks_failed']).splitlines()[0][:80]})"
        return text

    return "; ".join(f"{name}: {line(figures)}" for name, figures in cases.items())


def run(ctx: PartContext) -> dict[str, Any]:
    if ctx.kind == "cuda":
        cases = each_case_in_its_ranks(ctx)
    else:  # a dry run: every case in one launch
        ranks = launch(ctx, _all_cases_rank, ctx.kind)
        cases = {name: _verdict([r[name] for r in ranks]) for name in ranks[0]}
    return {"summary": f"W={ctx.world}: {_summary(cases)}", "cases": cases, **ctx.figures()}


def each_case_in_its_ranks(
    ctx: PartContext, case_rank: Callable[..., dict[str, Any]] = _case_rank, cases: list[tuple[str, bool, bool]] = CASES
) -> dict[str, dict[str, Any]]:
    """Each case's verdict, each from ranks of its own within the part's budget; a case whose
    ranks hang or die gets what its ranks noted before, and why the launch failed."""
    out: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + ctx.timeout_s - 5
    for case in cases:
        left = deadline - time.monotonic()
        if left < 10:
            out[_name(*case)] = {"capture": "not run: the part's budget was spent"}
            continue
        started = time.perf_counter()
        case_ctx = dataclasses.replace(ctx, timeout_s=min(CASE_BUDGET_S, left))
        with tempfile.TemporaryDirectory() as notes:
            try:
                figures = _verdict(launch(case_ctx, case_rank, ctx.kind, *case, notes))
            except Exception as error:  # ranks that hung or died: what they noted, and why
                noted = [json.loads(p.read_text()) for p in sorted(Path(notes).glob("rank*.json"))]
                figures = _verdict(noted) if noted else {"capture": "failed: see ranks_failed"}
                figures["ranks_failed"] = f"{type(error).__name__}: {error}"[:1500]
        figures["seconds"] = round(time.perf_counter() - started, 2)
        out[_name(*case)] = figures
    return out


def _all_cases_rank(kind: str) -> dict[str, dict[str, Any]]:
    return {_name(*case): _case_rank(kind, *case) for case in CASES}
