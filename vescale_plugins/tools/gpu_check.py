"""The CUDA/NCCL path end to end, in one run that fits a short device loan; writes one JSON.

    python -m vescale_plugins.tools.gpu_check [--json gpu_check.json] [--budget 450]
    (or ``vescale-gpu-check``, or scripts/gpu_check.sh [OUT.json] with a hard stop)

With CUDA: every check on NCCL, one rank per GPU. Without: the same checks on CPU/gloo, small
(the "cpu-fallback" mode, which the test suite runs), and the JSON says so. Checks:

* ``parity_w1`` / ``parity_multi_rank``: the test suite's decoder (uneven shapes, tied
  weights; ``vescale_plugins.tools.parity_model``) trained a few AdamW steps with veScale-FSDP against the unsharded
  model (losses and parameters) and against torch's FSDP2 (parameters), at W=1 and at W=all
  GPUs when there are several (W=2 on the fallback);
* ``bf16_mixed``: bf16 parameters and all-gather, fp32 reduce, against FSDP2 with the same
  policy (in the same parity processes);
* ``comm_streams``: the collectives ran on the dedicated all-gather/reduce-scatter streams
  with event waits (events recorded and waited on, counted) and no ``record_stream`` call;
* ``bench`` / ``bench_bf16``: ``python -m vescale_plugins.bench`` (default model on CUDA,
  tiny on the fallback): step time, peak memory (CUDA: ``max_memory_allocated`` and
  ``max_memory_reserved``), page faults, parity;
* ``optimizer_host_syncs``: a second step of AdamW, AdamW8bit and Muon under
  ``torch.cuda.set_sync_debug_mode("error")`` (any host sync raises);
* ``triton_kernels``: ``pytest tests -k triton`` compiled for real on CUDA when Triton
  kernels exist in ``vescale_plugins/optim/kernels/`` and the checkout has its tests;
  skipped (with the reason) otherwise.

Exit status 0 when no check failed (skipped checks do not fail the run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import vescale_plugins
from vescale_plugins.optim import AdamW, AdamW8bit, Muon
from vescale_plugins.tools import parity_model
from vescale_plugins.tools.launch import launch_ranks

# The checkout this package is in (its tests/ are there when it is one).
ROOT = Path(vescale_plugins.__file__).resolve().parents[1]
PARITY_STEPS = 3
# Adam turns a gradient's rounding difference into an update difference where the gradient
# is near zero (see tests/support/parity.py); CUDA's atomics (embedding backward) add their
# own order-dependence, so the GPU bound is looser. The JSON keeps the measured differences.
PARAM_TOL = {"cpu": dict(rtol=1e-4, atol=1e-5), "cuda": dict(rtol=1e-3, atol=1e-4)}
LOSS_TOL = {"cpu": dict(rtol=2e-5, atol=2e-6), "cuda": dict(rtol=1e-4, atol=1e-5)}
BF16_TOL = dict(rtol=2e-2, atol=2e-3)


# -- the per-rank body (runs on the launcher's ranks) ------------------------------------------


def _max_abs_diff(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    worst = 0.0
    for (name, p), (ref_name, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        assert name == ref_name, (name, ref_name)
        a = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        b = q.full_tensor() if hasattr(q, "full_tensor") else q.detach()
        worst = max(worst, (a.float() - b.float()).abs().max().item())
    return worst


def _assert_params_close(ours: torch.nn.Module, theirs: torch.nn.Module, tol: dict[str, float]) -> None:
    for (name, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        a = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        b = q.full_tensor() if hasattr(q, "full_tensor") else q.detach()
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


class _StreamCounter:
    """Counts what the collectives' stream protocol does, and any ``record_stream`` call."""

    def __init__(self) -> None:
        self.events_recorded = self.event_waits = self.record_stream_calls = 0

    def __enter__(self) -> _StreamCounter:
        from vescale_plugins.dbuffer.streams import CommStreams

        self._patched = [
            (CommStreams, "record", CommStreams.record),
            (CommStreams, "wait", CommStreams.wait),
            (torch.Tensor, "record_stream", torch.Tensor.record_stream),
        ]
        counter = self
        record, wait, record_stream = (p[2] for p in self._patched)

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

        CommStreams.record, CommStreams.wait, torch.Tensor.record_stream = (
            counted_record,
            counted_wait,
            counted_record_stream,
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in self._patched:
            setattr(owner, name, original)


def _parity_rank(kind: str) -> dict[str, Any]:
    """veScale-FSDP vs the unsharded model and vs FSDP2 (fp32), then bf16-mixed vs FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from vescale_plugins import fully_shard

    if kind == "cuda":  # the launcher gave this rank its GPU
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(kind, (dist.get_world_size(),))
    world = dist.get_world_size()

    def shard(model: torch.nn.Module, fn: Callable[..., Any], **kwargs: Any) -> torch.nn.Module:
        for layer in model.layers:
            fn(layer, mesh=mesh, **kwargs)
        return fn(model, mesh=mesh, **kwargs)

    def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)

    def sharded_step(model: torch.nn.Module, step: int) -> torch.Tensor:
        tokens, targets = parity_model.local_batch(step)
        loss = parity_model.loss_fn(model(tokens.to(device)), targets.to(device))
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total / world

    out: dict[str, Any] = {"world_size": world}
    started = time.perf_counter()
    reference = parity_model.make_decoder().to(device)
    ours = shard(parity_model.clone(reference), fully_shard)
    theirs = shard(parity_model.clone(reference), torch_fully_shard)
    optimizers = [adamw(m) for m in (reference, ours, theirs)]
    loss_diffs = []
    with _StreamCounter() as streams:
        for step in range(PARITY_STEPS):
            ref_loss = parity_model.reference_step(reference, step, world)
            loss = sharded_step(ours, step)
            sharded_step(theirs, step)
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
    dbuffer = ours._vescale_fsdp_unit.dbuffers[0]
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
    ours = shard(parity_model.clone(base), fully_shard, mp_policy=policy)
    theirs = shard(parity_model.clone(base), torch_fully_shard, mp_policy=policy)
    optimizers = [adamw(m) for m in (ours, theirs)]
    loss_diffs = []
    for step in range(PARITY_STEPS):
        a, b = sharded_step(ours, step), sharded_step(theirs, step)
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


def run_parity(world: int, kind: str, timeout_s: float) -> dict[str, Any]:
    """The parity body on ``world`` ranks; rank 0's figures, or raise with a failure."""
    backend = "nccl" if kind == "cuda" else "gloo"
    return launch_ranks(_parity_rank, world, kind, timeout_s=timeout_s, backend=backend, threads=1)[0]


# -- subprocess checks -----------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_bench(args: list[str], timeout_s: float) -> dict[str, Any]:
    """``python -m vescale_plugins.bench ARGS``; its summary (ratios, memory, page faults)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.json"
        command = [sys.executable, "-m", "vescale_plugins.bench", *args, "--json", str(path), "--plot", ""]
        done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command[1:])} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
            )
        data = json.loads(path.read_text())
    summary = data["summary"]
    keep = (
        "step_ms",
        "tokens_per_s",
        "peak_bytes",
        "cuda_max_allocated_bytes",
        "cuda_max_reserved_bytes",
        "cuda_alloc_retries",
        "page_faults_per_step",
        "sharded_state_bytes",
        "padding_bytes",
    )
    engines = {name: {k: v for k, v in figures.items() if k in keep} for name, figures in summary["engines"].items()}
    for figures in engines.values():
        figures["step_ms"] = {k: v for k, v in figures["step_ms"].items() if k != "samples"}
    parity = summary["parity"]
    if abs(parity["loss"]["fsdp2"] - parity["loss"]["vescale"]) > 1e-3 * max(1.0, abs(parity["loss"]["fsdp2"])):
        raise AssertionError(f"bench losses differ: {parity}")
    return {
        "command": "python -m vescale_plugins.bench " + " ".join(args),
        "environment": data["environment"],
        "ratios": summary["ratios"],
        "engines": engines,
        "parity": parity,
    }


def run_triton(kind: str, timeout_s: float) -> dict[str, Any]:
    """``pytest tests -k triton``, compiled for real on CUDA; a skip when there is nothing to run."""
    kernels = ROOT / "vescale_plugins" / "optim" / "kernels"
    sources = sorted(p.name for p in kernels.glob("*triton*.py"))
    if not sources:
        return {"status": "skipped", "reason": "no Triton kernels in vescale_plugins/optim/kernels/"}
    if not (ROOT / "tests").is_dir():
        return {"status": "skipped", "reason": f"no tests/ beside the package in {ROOT}", "kernels": sources}
    try:
        import triton
    except ImportError:
        return {"status": "skipped", "reason": "triton is not installed", "kernels": sources}
    if kind != "cuda":
        return {
            "status": "skipped",
            "reason": "no CUDA: the test suite runs the kernels under TRITON_INTERPRET=1",
            "kernels": sources,
            "triton": triton.__version__,
        }
    env = _env()
    env.pop("TRITON_INTERPRET", None)
    command = [sys.executable, "-m", "pytest", "-q", "tests", "-k", "triton", "-p", "no:cacheprovider"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
    if done.returncode == 5:
        return {"status": "skipped", "reason": "no test matches -k triton", "kernels": sources}
    if done.returncode != 0:
        raise RuntimeError(f"pytest -k triton exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return {"kernels": sources, "triton": triton.__version__, "pytest": tail[0]}


def run_optimizer_syncs(kind: str, timeout_s: float) -> dict[str, Any]:
    """A steady-state step of each optimizer with CUDA's sync debug mode at "error": any host
    sync (a device scalar read, a pageable copy) raises. Off CUDA the steps run unchecked."""
    device = torch.device(kind)
    stepped = {}
    for name, make in (("AdamW", AdamW), ("AdamW8bit", AdamW8bit), ("Muon", Muon)):
        params = [torch.nn.Parameter(torch.randn(256, 128, device=device))]
        optimizer = make(params, lr=1e-3)
        params[0].grad = torch.randn_like(params[0])
        optimizer.step()  # builds state (quantisation maps are copied to the device once)
        if kind == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            optimizer.step()
        finally:
            if kind == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        stepped[name] = "no host sync" if kind == "cuda" else "stepped (sync debug mode is CUDA only)"
    return {"optimizers": stepped}


# -- the run ---------------------------------------------------------------------------------


def device_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info.update(
            gpus=torch.cuda.device_count(),
            name=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            total_memory_bytes=torch.cuda.get_device_properties(0).total_memory,
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    else:
        info.update(gpus=0, cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count())
    return info


def plan(kind: str, gpus: int, quick: bool) -> list[tuple[str, Callable[[float], dict[str, Any]]]]:
    """The checks to run, in order, each taking its time limit in seconds."""
    checks: list[tuple[str, Callable[[float], dict[str, Any]]]] = []
    if not quick:  # W=1 is the multi-rank code on one rank; the quick run keeps W=2 only
        checks.append(("parity_w1", lambda t: run_parity(1, kind, t)))
    multi = gpus if kind == "cuda" else 2
    if multi > 1:
        checks.append(("parity_multi_rank", lambda t: run_parity(multi, kind, t)))
    if kind == "cuda":
        checks.append(("bench", lambda t: run_bench([], t)))
        checks.append(("bench_bf16", lambda t: run_bench(["--precision", "bf16-mixed"], t)))
        checks.append(("bench_medium", lambda t: run_bench(["--model", "medium", "--steps", "12"], t)))
    else:
        steps = "2" if quick else "4"
        tiny = f"--model tiny --world-size 2 --seq-len 32 --warmup 1 --steps {steps} --batch-size 2".split()
        checks.append(("bench", lambda t: run_bench(tiny, t)))
    checks.append(("optimizer_host_syncs", lambda t: run_optimizer_syncs(kind, t)))
    checks.append(("triton_kernels", lambda t: run_triton(kind, t)))
    return checks


def derived(results: dict[str, Any]) -> None:
    """Lift the per-parity sub-results into their own named checks (bf16, streams)."""
    for source in ("parity_multi_rank", "parity_w1"):
        figures = results.get(source, {})
        if figures.get("status") == "passed":
            results["bf16_mixed"] = {"status": "passed", "from": source, **figures["bf16_mixed"]}
            results["comm_streams"] = {"status": "passed", "from": source, **figures["comm_streams"]}
            if not figures["comm_streams"]["enabled"]:
                results["comm_streams"]["note"] = (
                    "streams are CUDA only; off CUDA one stream and Work.wait() (no record_stream either way)"
                )
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="gpu_check.json", help="where to write every figure")
    parser.add_argument(
        "--budget", type=float, default=450.0, help="seconds for all checks together (each check gets what is left)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="fallback only: W=2 parity only, fewer bench steps (the test suite's run)"
    )
    parser.add_argument("--cpu", action="store_true", help="run the CPU fallback even where CUDA is available")
    args = parser.parse_args(argv)
    kind = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    info = device_info()
    report: dict[str, Any] = {
        "mode": "cuda" if kind == "cuda" else "cpu-fallback",
        "note": f"CUDA/NCCL on {info.get('gpus')} GPU(s)"
        if kind == "cuda"
        else "no CUDA device: the same checks ran on CPU/gloo, small; no GPU figures",
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": info,
        "checks": {},
    }
    deadline = time.monotonic() + args.budget
    for name, check in plan(kind, info.get("gpus", 0), args.quick):
        left = deadline - time.monotonic()
        if left < 10:
            report["checks"][name] = {"status": "skipped", "reason": "the time budget was spent"}
            continue
        started = time.perf_counter()
        try:
            result = check(left)
            status = result.pop("status", "passed")
            report["checks"][name] = {"status": status, **result}
        except BaseException as error:  # recorded, and the run goes on to the next check
            report["checks"][name] = {"status": "failed", "error": f"{type(error).__name__}: {error}"[-4000:]}
        report["checks"][name]["seconds"] = round(time.perf_counter() - started, 2)
        print(f"{name}: {report['checks'][name]['status']} ({report['checks'][name]['seconds']} s)", flush=True)
        Path(args.json).write_text(json.dumps(report, indent=2))  # partial results survive a kill
    derived(report["checks"])
    report["ok"] = all(c["status"] != "failed" for c in report["checks"].values())
    Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"{'all checks passed' if report['ok'] else 'SOME CHECKS FAILED'} ({report['mode']}); wrote {args.json}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
