"""Parity on the device: veScale-FSDP against the unsharded model and FSDP2, plain and provoked.

* ``parity_w1`` / ``parity_multi_rank``: the test suite's decoder (uneven shapes, tied
  weights; :mod:`vescale_plugins.tools.parity_model`) trained a few AdamW steps with
  veScale-FSDP against the unsharded model (losses, parameters) and against torch's FSDP2
  (parameters), then bf16-mixed against FSDP2 with the same policy; the collectives' stream
  protocol counted (events recorded and waited on, no ``record_stream``).
* ``race_provocation``: the same training twice from the same state, the second time with a
  GPU sleep (``torch.cuda._sleep``) on the side stream before every collective and on the
  compute stream at every unit's pre-forward: a missing stream wait then reads a buffer
  before it is written (or after it is reused) and the numbers change. Parity required.
* ``fake_pg_w2``: where NCCL gives no second rank, one process of a fake two-rank group
  (``torch.testing``'s ``FakeProcessGroup``: collectives do nothing) runs the W=2 code
  paths on CUDA; it checks that they run, not their numbers.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, TypedDict
from unittest import mock

import torch
import torch.distributed as dist

from vescale_plugins.tools import parity_model
from vescale_plugins.tools.gpu_parts.context import PartContext, launch

__all__ = ["run_w1", "run_multi_rank", "run_race_provocation", "run_fake_pg_w2", "provoked_streams"]

PARITY_STEPS = 3


class Tolerance(TypedDict):
    """``torch.testing.assert_close``'s bounds."""

    rtol: float
    atol: float


# Adam turns a gradient's rounding difference into an update difference where the gradient
# is near zero (see tests/support/parity.py); CUDA's atomics (embedding backward) add their
# own order-dependence, so the GPU bound is looser. The JSON keeps the measured differences.
PARAM_TOL = {"cpu": Tolerance(rtol=1e-4, atol=1e-5), "cuda": Tolerance(rtol=1e-3, atol=1e-4)}
LOSS_TOL = {"cpu": Tolerance(rtol=2e-5, atol=2e-6), "cuda": Tolerance(rtol=1e-4, atol=1e-5)}
BF16_TOL = Tolerance(rtol=2e-2, atol=2e-3)
# GPU cycles each provoking sleep spins (about 1 ms at an H200's clock): far longer than any
# kernel of the decoder, so an unordered read lands in the window.
PROVOKING_CYCLES = 2_000_000


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _max_abs_diff(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    worst = 0.0
    for (name, p), (ref_name, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert name == ref_name, (name, ref_name)
        worst = max(worst, (_full(p).float() - _full(q).float()).abs().max().item())
    return worst


def _assert_params_close(ours: torch.nn.Module, theirs: torch.nn.Module, tol: Tolerance) -> None:
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(_full(p), _full(q), **tol, msg=lambda m: f"{name}: {m}")


class _StreamCounter:
    """Counts what the collectives' stream protocol does, and any ``record_stream`` call."""

    def __init__(self) -> None:
        self.events_recorded = self.event_waits = self.record_stream_calls = 0

    def __enter__(self) -> _StreamCounter:
        from vescale_plugins.dbuffer.streams import CommStreams

        counter = self
        record, wait, record_stream = CommStreams.record, CommStreams.wait, torch.Tensor.record_stream

        def counted_record(streams: Any, stream: Any) -> Any:
            event = record(streams, stream)
            counter.events_recorded += event is not None
            return event

        def counted_wait(streams: Any, event: Any) -> None:
            counter.event_waits += event is not None
            wait(streams, event)

        def counted_record_stream(tensor: torch.Tensor, stream: Any) -> None:
            counter.record_stream_calls += 1
            record_stream(tensor, stream)

        self._patches = contextlib.ExitStack()
        self._patches.enter_context(mock.patch.object(CommStreams, "record", counted_record))
        self._patches.enter_context(mock.patch.object(CommStreams, "wait", counted_wait))
        self._patches.enter_context(mock.patch.object(torch.Tensor, "record_stream", counted_record_stream))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._patches.close()


@contextlib.contextmanager
def provoked_streams(cycles: int, which: str = "all") -> Iterator[dict[str, int]]:
    """A GPU sleep of ``cycles`` on the side stream before each collective issued there
    (``which``: "all", or "reduce_scatter" for that stream's only); yields the sleep counts."""
    from vescale_plugins.dbuffer.streams import CommStreams

    original = CommStreams.issue_on
    counts = {"side_stream_sleeps": 0}

    @contextlib.contextmanager
    def issue_on(streams: CommStreams, stream: Any, after: Any = None) -> Iterator[None]:
        with original(streams, stream, after=after):
            if streams.enabled and (which == "all" or stream is streams.reduce_scatter):
                torch.cuda._sleep(cycles)
                counts["side_stream_sleeps"] += 1
            yield

    with mock.patch.object(CommStreams, "issue_on", issue_on):
        yield counts


def _sleep_before_each_unit(model: torch.nn.Module, cycles: int, counts: dict[str, int]) -> list[Any]:
    """A compute-stream sleep at every unit's pre-forward (before the unit's own hooks)."""

    def sleep(module: torch.nn.Module, args: Any) -> None:
        torch.cuda._sleep(cycles)
        counts["pre_forward_sleeps"] = counts.get("pre_forward_sleeps", 0) + 1

    units = [m for m in model.modules() if "_vescale_fsdp_unit" in vars(m)]
    return [unit.register_forward_pre_hook(sleep, prepend=True) for unit in units]


def _setup(kind: str) -> tuple[torch.device, Any, int]:
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "cuda":  # the launcher gave this rank its GPU
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    return device, init_device_mesh(kind, (dist.get_world_size(),)), dist.get_world_size()


def _shard(model: torch.nn.Module, fn: Callable[..., Any], mesh: Any, **kwargs: Any) -> torch.nn.Module:
    for layer in model.get_submodule("layers").children():
        fn(layer, mesh=mesh, **kwargs)
    return fn(model, mesh=mesh, **kwargs)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def _sharded_step(model: torch.nn.Module, step: int, device: torch.device, world: int) -> torch.Tensor:
    tokens, targets = parity_model.local_batch(step)
    loss = parity_model.loss_fn(model(tokens.to(device)), targets.to(device))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / world


def _parity_rank(kind: str) -> dict[str, Any]:
    """veScale-FSDP vs the unsharded model and vs FSDP2 (fp32), then bf16-mixed vs FSDP2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from vescale_plugins import fully_shard
    from vescale_plugins.runtime.state import groups_under

    device, mesh, world = _setup(kind)
    out: dict[str, Any] = {"world_size": world}
    started = time.perf_counter()
    reference = parity_model.make_decoder().to(device)
    ours = _shard(parity_model.clone(reference), fully_shard, mesh)
    theirs = _shard(parity_model.clone(reference), torch_fully_shard, mesh)
    optimizers = [_adamw(m) for m in (reference, ours, theirs)]
    loss_diffs = []
    with _StreamCounter() as streams:
        for step in range(PARITY_STEPS):
            ref_loss = parity_model.reference_step(reference, step, world)
            loss = _sharded_step(ours, step, device, world)
            _sharded_step(theirs, step, device, world)
            torch.testing.assert_close(loss, ref_loss, **LOSS_TOL[kind])
            loss_diffs.append(abs(loss.item() - ref_loss.item()))
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
    if kind == "cuda":
        torch.cuda.synchronize(device)
    out["fp32"] = {
        "steps": PARITY_STEPS,
        "max_loss_diff_vs_unsharded": max(loss_diffs),
        "max_param_diff_vs_unsharded": _max_abs_diff(ours, reference),
        "max_param_diff_vs_fsdp2": _max_abs_diff(ours, theirs),
        "seconds": time.perf_counter() - started,
    }
    _assert_params_close(ours, reference, PARAM_TOL[kind])
    _assert_params_close(ours, theirs, PARAM_TOL[kind])
    dbuffer = groups_under([ours])[0].dbuffers[0]  # the root unit's
    out["comm_streams"] = {
        "enabled": dbuffer.streams.enabled,
        "events_recorded": streams.events_recorded,
        "event_waits": streams.event_waits,
        "record_stream_calls": streams.record_stream_calls,
    }
    if kind == "cuda":
        assert dbuffer.streams.enabled, "CUDA buffers must use the dedicated collective streams"
        assert streams.events_recorded > 0 and streams.event_waits > 0, out["comm_streams"]
    assert streams.record_stream_calls == 0, out["comm_streams"]

    started = time.perf_counter()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = parity_model.make_decoder().to(device)
    ours = _shard(parity_model.clone(base), fully_shard, mesh, mp_policy=policy)
    theirs = _shard(parity_model.clone(base), torch_fully_shard, mesh, mp_policy=policy)
    optimizers = [_adamw(m) for m in (ours, theirs)]
    loss_diffs = []
    for step in range(PARITY_STEPS):
        a, b = _sharded_step(ours, step, device, world), _sharded_step(theirs, step, device, world)
        torch.testing.assert_close(a, b, **BF16_TOL)
        loss_diffs.append(abs(a.item() - b.item()))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    _assert_params_close(ours, theirs, BF16_TOL)
    out["bf16_mixed"] = {
        "steps": PARITY_STEPS,
        "max_loss_diff_vs_fsdp2": max(loss_diffs),
        "max_param_diff_vs_fsdp2": _max_abs_diff(ours, theirs),
        "grad_dtype": str(next(ours.parameters()).dtype),
        "seconds": time.perf_counter() - started,
    }
    if kind == "cuda":
        out["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        out["cuda_max_memory_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return out


def _with_summary(figures: dict[str, Any]) -> dict[str, Any]:
    fp32 = figures["fp32"]
    summary = (
        f"W={figures['world_size']}: max param diff {fp32['max_param_diff_vs_unsharded']:.1e} vs unsharded, "
        f"{fp32['max_param_diff_vs_fsdp2']:.1e} vs FSDP2, bf16 {figures['bf16_mixed']['max_param_diff_vs_fsdp2']:.1e}"
    )
    return {"summary": summary, **figures}


def run_w1(ctx: PartContext) -> dict[str, Any]:
    return _with_summary(launch(ctx, _parity_rank, ctx.kind, world=1)[0])


def run_multi_rank(ctx: PartContext) -> dict[str, Any]:
    if ctx.world < 2:
        return {"status": "skipped", "reason": f"no second rank: {ctx.world_note}; W=1 is parity_w1"}
    return _with_summary({**launch(ctx, _parity_rank, ctx.kind)[0], **ctx.figures()})


def _train_ours(reference: torch.nn.Module, mesh: Any, device: torch.device, world: int, cycles: int) -> Any:
    from vescale_plugins import fully_shard

    model = _shard(parity_model.clone(reference), fully_shard, mesh)
    optimizer = _adamw(model)
    counts: dict[str, int] = {}
    hooks = _sleep_before_each_unit(model, cycles, counts) if cycles else []
    provoking: contextlib.AbstractContextManager[dict[str, int]] = (
        provoked_streams(cycles) if cycles else contextlib.nullcontext({})
    )
    losses = []
    with provoking as stream_counts:
        for step in range(PARITY_STEPS):
            losses.append(_sharded_step(model, step, device, world))
            optimizer.step()
            optimizer.zero_grad()
    for hook in hooks:
        hook.remove()
    torch.cuda.synchronize(device)
    return model, torch.stack(losses), {**counts, **stream_counts}


def _race_rank(kind: str, cycles: int) -> dict[str, Any]:
    # Deterministic kernels (the embedding's backward has a deterministic variant), so the
    # provoked run must give the unprovoked run's numbers bit for bit, not only within bounds.
    torch.use_deterministic_algorithms(True, warn_only=True)
    device, mesh, world = _setup(kind)
    reference = parity_model.make_decoder().to(device)
    plain, plain_losses, _ = _train_ours(reference, mesh, device, world, 0)
    provoked, provoked_losses, counts = _train_ours(reference, mesh, device, world, cycles)
    reference_optimizer = _adamw(reference)  # the unsharded model, trained after both clones
    for step in range(PARITY_STEPS):
        parity_model.reference_step(reference, step, world)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    out = {
        "sleep_cycles": cycles,
        **counts,
        "bitwise_equal_to_unprovoked": all(
            torch.equal(_full(p), _full(q)) for p, q in zip(plain.parameters(), provoked.parameters())
        )
        and torch.equal(plain_losses, provoked_losses),
        "max_param_diff_vs_unprovoked": _max_abs_diff(provoked, plain),
        "max_param_diff_vs_unsharded": _max_abs_diff(provoked, reference),
    }
    assert counts.get("side_stream_sleeps", 0) > 0 and counts.get("pre_forward_sleeps", 0) > 0, counts
    _assert_params_close(provoked, plain, PARAM_TOL[kind])
    _assert_params_close(provoked, reference, PARAM_TOL[kind])
    return out


def run_race_provocation(ctx: PartContext) -> dict[str, Any]:
    if ctx.kind != "cuda":
        return {"status": "skipped", "reason": "CUDA only: off CUDA there is one stream and nothing to race"}
    # cuBLAS's deterministic workspace (this part's process is its own; its ranks inherit it).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    figures = launch(ctx, _race_rank, ctx.kind, PROVOKING_CYCLES)[0]
    summary = (
        f"W={ctx.world}: provoked bit-equal to unprovoked: {figures['bitwise_equal_to_unprovoked']}, "
        f"max diff {figures['max_param_diff_vs_unprovoked']:.1e}"
    )
    return {"summary": summary, **figures, **ctx.figures()}


def run_fake_pg_w2(ctx: PartContext) -> dict[str, Any]:
    if ctx.kind != "cuda":
        return {"status": "skipped", "reason": "CUDA only (the CPU fallback has real gloo ranks)"}
    if ctx.world > 1:
        return {"status": "skipped", "reason": f"real ranks ran the W={ctx.world} paths ({ctx.world_note})"}
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vescale_plugins import fully_shard

    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        device, mesh = torch.device("cuda", 0), init_device_mesh("cuda", (2,))
        model = _shard(parity_model.make_decoder().to(device), fully_shard, mesh)
        optimizer = _adamw(model)
        started = time.perf_counter()
        for step in range(PARITY_STEPS):
            _sharded_step(model, step, device, 2)
            optimizer.step()
            optimizer.zero_grad()
        torch.cuda.synchronize()
        return {
            "world_size": 2,
            "process_group": "fake (collectives do nothing: code paths only, no numbers, no speed)",
            "steps": PARITY_STEPS,
            "seconds": time.perf_counter() - started,
        }
    finally:
        dist.destroy_process_group()
