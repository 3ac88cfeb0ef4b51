"""The CUDA/NCCL path end to end, in one run that fits a short device loan.

    python -m vescale_plugins.tools.gpu_check [--out DIR] [--budget 450]
    (or ``vescale-gpu-check``, or scripts/gpu_check.sh [DIR] with a hard stop)

The check is a list of parts (:data:`PLAN`; what each measures is in its module under
:mod:`vescale_plugins.tools.gpu_parts` and in docs/gpu_check.md). Each part runs in a process
of its own (a CUDA error is sticky for a process) under its own time budget, cut to what is
left of the whole budget; a part that fails, raises or overruns is recorded and the next one
runs. Each writes its JSON (a line of ``DIR/parts.jsonl``) and one line of
``DIR/summary.txt``; ``DIR/gpu_check.json`` holds them all, rewritten after each part, so a
killed run keeps what it finished (three files: the device tool returns at most eight).

Without CUDA the same driver runs its CPU fallback (gloo ranks, small; the suite runs it):
the parts that need CUDA are skipped with the reason, as are the parts whose module does not
exist yet (features still being built). Exit status 0 when no part failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vescale_plugins.tools.gpu_parts.context import PartContext
from vescale_plugins.tools.launch import exit_when_orphaned

__all__ = ["PLAN", "Part", "main"]

_PARTS = "vescale_plugins.tools.gpu_parts"


@dataclass(frozen=True)
class Part:
    """One part of the check: ``target`` (``"module:function"`` under gpu_parts) is called
    with a :class:`PartContext` and returns the part's figures; ``budget_s`` bounds it;
    ``cuda_only``: why it is skipped without CUDA (None: the fallback runs it too)."""

    name: str
    target: str
    budget_s: float
    cuda_only: str | None = None


_NO_STREAMS = "CUDA only: off CUDA there is one stream, collectives are waited on the host"
PLAN = [
    # Its verdict sets how the multi-rank parts below get their ranks (gpu_parts/context.py).
    Part("multi_rank_nccl", ".probe:run", 45, "NCCL only: the CPU fallback's ranks are gloo processes"),
    Part("parity_w1", ".parity:run_w1", 45),
    Part("parity_multi_rank", ".parity:run_multi_rank", 60),
    Part("fake_pg_w2", ".parity:run_fake_pg_w2", 40, "CUDA only: the CPU fallback has real gloo ranks"),
    Part(
        "gradient_dtypes",
        ".gradient_dtypes:run",
        60,
        "CUDA only: gloo has no PREMUL_SUM for FSDP2 (tests/runtime/test_gradient_dtypes.py covers gloo)",
    ),
    Part("race_provocation", ".parity:run_race_provocation", 60, _NO_STREAMS),
    Part("optimizer_host_syncs", ".optimizers:run", 60),
    Part(
        "triton_kernels",
        ".triton_adam:run",
        60,
        "no CUDA: the test suite runs the kernel under TRITON_INTERPRET=1 (tests/optim/kernels)",
    ),
    Part("rs_wait", ".rs_wait:run", 60, _NO_STREAMS),
    # Before the benches: what a short loan must answer first. Off CUDA a dry run (no capture).
    Part("cuda_graph", ".cuda_graph:run", 90),
    Part("host", ".host:run", 90, "CUDA only: the CPU has make bench-host itself"),
    Part("bench", ".bench:run_default", 100),
    # Items built on other branches: each is skipped, with the reason, until its module exists.
    Part("hsdp_allreduce_stream", ".hsdp_allreduce_stream:run", 45, _NO_STREAMS),
    Part("cuda_event_timing", ".cuda_event_timing:run", 45, "CUDA only: events time the GPU's streams"),
    Part("meta_init", ".meta_init:run", 45),
    Part(
        "quantized_collectives",
        ".quantized_collectives:run",
        60,
        "no CUDA: the test suite runs the Triton kernels under TRITON_INTERPRET=1 (tests/dbuffer)",
    ),
    Part("bench_bf16", ".bench:run_bf16", 70, "CUDA only (the fallback's bench is the tiny fp32 one)"),
    Part("bench_medium", ".bench:run_medium", 90, "CUDA only (the fallback's bench is the tiny fp32 one)"),
]
# The budgets are an H200's; the CPU fallback runs on a CI machine's few shared cores.
_CPU_BUDGET_FACTOR = 5
# The suite's quick fallback: W=1 is the multi-rank code on one rank, so only W=2 runs.
_NOT_IN_QUICK = {"parity_w1": "--quick: W=1 is the multi-rank code on one rank; parity_multi_rank runs W=2"}


def _split(target: str) -> tuple[str, str]:
    """``(module, function)``; a module starting with "." is one of gpu_parts."""
    module, function = target.split(":")
    return (_PARTS + module if module.startswith(".") else module), function


def run_part_here(target: str, ctx: PartContext) -> dict[str, Any]:
    """Call the part in this process (what the part's own process does)."""
    module, function = _split(target)
    return getattr(importlib.import_module(module), function)(ctx)


def _run_part(part: Part, ctx: PartContext) -> dict[str, Any]:
    """The part in a process of its own, killed with its ranks at ``ctx.timeout_s``: a
    failure when that is the part's own budget, a skip when what was left of the whole was less."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "vescale_plugins.tools.gpu_check", "--run-part", part.target]
        command += ["--context", ctx.to_json(), "--result", str(result), "--driver-pid", str(os.getpid())]
        child = subprocess.Popen(command, env=_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            output, _ = child.communicate(timeout=ctx.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the part and every rank it started
            output, _ = child.communicate()
            if ctx.timeout_s < part.budget_s:
                reason = f"the whole budget ran out {ctx.timeout_s:.0f} s into it (its own: {part.budget_s:.0f} s)"
                return {"status": "skipped", "reason": reason, "log": output[-3000:]}
            return {"status": "failed", "error": f"overran its budget of {part.budget_s:.0f} s", "log": output[-3000:]}
        if not result.exists():
            return {"status": "failed", "error": f"its process exited {child.returncode}", "log": output[-3000:]}
        return json.loads(result.read_text())


def _child(target: str, context: str, result: str, driver_pid: int) -> int:
    # Its own session (so a budget kill takes its ranks too), hence no hangup from the driver's
    # end: it ends itself, and its ranks with it, when the driver is gone (the hard stop).
    exit_when_orphaned(driver_pid)
    try:
        figures = run_part_here(target, PartContext.from_json(context))
    except BaseException as error:  # recorded as the part's failure
        text = "".join(traceback.format_exception(error))
        figures = {"status": "failed", "error": f"{type(error).__name__}: {error}"[-2000:], "traceback": text[-4000:]}
    Path(result).write_text(json.dumps(figures, default=str))
    return 0


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _skip_reason(part: Part, kind: str, quick: bool) -> str | None:
    module, _ = _split(part.target)
    if importlib.util.find_spec(module) is None:
        return f"not built yet: {module.replace('.', '/')}.py (run(ctx) -> dict) does not exist in this checkout"
    if kind != "cuda" and part.cuda_only:
        return part.cuda_only
    if quick and part.name in _NOT_IN_QUICK:
        return _NOT_IN_QUICK[part.name]
    return None


def _ranks_after_probe(ctx: PartContext, probe: dict[str, Any]) -> PartContext:
    """How the multi-rank parts run, from the GPU count and the probe's verdict."""
    if ctx.kind != "cuda":
        return dataclasses.replace(ctx, world=2, world_note="two gloo ranks on CPU")
    if ctx.gpus > 1:
        return dataclasses.replace(ctx, world=ctx.gpus, world_note="one rank per GPU")
    if probe.get("status") == "passed":
        note = "2 ranks on one GPU (a distinct NCCL_HOSTID each, sockets over loopback): no speed claim"
        return dataclasses.replace(ctx, world=2, ranks_on_one_gpu=True, world_note=note)
    why = (probe.get("error") or probe.get("reason") or "").splitlines()[:1]
    note = f"NCCL refused 2 ranks on one GPU ({why[0] if why else 'see multi_rank_nccl'}): W=1, fake_pg_w2 runs W=2"
    return dataclasses.replace(ctx, world=1, world_note=note)


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


def summary_line(name: str, figures: dict[str, Any]) -> str:
    """``name: status (seconds s)``, then the part's own summary, reason or error."""
    detail = figures.get("summary") or figures.get("reason") or figures.get("error") or ""
    detail = str(detail).splitlines()[0] if detail else ""
    return f"{name}: {figures['status']} ({figures.get('seconds', 0)} s){' - ' + detail if detail else ''}"


def derived(results: dict[str, Any]) -> None:
    """Lift the parity parts' sub-results into their own named checks (bf16, streams)."""
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
    parser.add_argument(
        "--out", help="folder for gpu_check.json, parts.jsonl, summary.txt (default: --json's folder, or gpu_check_out)"
    )
    parser.add_argument("--json", help="where to write the whole report (default OUT/gpu_check.json)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all parts together")
    parser.add_argument("--quick", action="store_true", help="fallback only: W=2 parity only, fewer bench steps")
    parser.add_argument("--cpu", action="store_true", help="run the CPU fallback even where CUDA is available")
    parser.add_argument("--run-part", help=argparse.SUPPRESS)  # a part's own process
    parser.add_argument("--context", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--driver-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_part:
        return _child(args.run_part, args.context, args.result, args.driver_pid)
    out = Path(args.out) if args.out else Path(args.json).parent if args.json else Path("gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    report_path = Path(args.json) if args.json else out / "gpu_check.json"
    parts_path, summary_path = out / "parts.jsonl", out / "summary.txt"
    for path in (parts_path, summary_path):
        path.write_text("")
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
    gpus = info["gpus"] if kind == "cuda" else 0
    ctx = PartContext(kind, gpus, world=1, ranks_on_one_gpu=False, world_note="not decided yet", timeout_s=0, quick=args.quick)  # fmt: skip
    deadline = time.monotonic() + args.budget
    for part in PLAN:
        started = time.perf_counter()
        reason = _skip_reason(part, kind, args.quick)
        left = deadline - time.monotonic()
        if reason is None and left < 10:
            reason = "the time budget was spent"
        if reason is not None:
            figures: dict[str, Any] = {"status": "skipped", "reason": reason}
        else:
            if kind != "cuda":
                part = dataclasses.replace(part, budget_s=part.budget_s * _CPU_BUDGET_FACTOR)
            figures = _run_part(part, dataclasses.replace(ctx, timeout_s=min(part.budget_s, left)))
            figures["status"] = figures.get("status", "passed")
            figures = {"status": figures.pop("status"), "budget_s": part.budget_s, **figures}
        figures["seconds"] = round(time.perf_counter() - started, 2)
        if part.name == "multi_rank_nccl":
            ctx = _ranks_after_probe(ctx, figures)
            report["ranks"] = ctx.figures()
        report["checks"][part.name] = figures
        line = summary_line(part.name, figures)
        print(line, flush=True)
        with parts_path.open("a") as f:
            f.write(json.dumps({"part": part.name, **figures}, default=str) + "\n")
        with summary_path.open("a") as f:
            f.write(line + "\n")
        report_path.write_text(json.dumps(report, indent=2, default=str))  # partial results survive a kill
    derived(report["checks"])
    report["ok"] = all(c["status"] != "failed" for c in report["checks"].values())
    report_path.write_text(json.dumps(report, indent=2, default=str))
    last = f"{'all parts passed or skipped' if report['ok'] else 'SOME PARTS FAILED'} ({report['mode']}); wrote {report_path}"
    with summary_path.open("a") as f:
        f.write(last + "\n")
    print(last)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
