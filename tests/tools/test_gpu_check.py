"""``python -m vescale_plugins.tools.gpu_check``: its driver, and its CPU fallback end to end.

The CUDA path itself needs a GPU. What runs here: the driver's isolation of its parts (a
part that raises or overruns its budget is recorded and the next one runs; a module that is
not built yet is a skip with its reason), how the probe's verdict sets the ranks, and the
CPU fallback's whole run: the same parity bodies (veScale-FSDP vs the unsharded model and
vs FSDP2, fp32 and bf16-mixed), the stream counters and the benchmark, on CPU/gloo, with
every CUDA-only part skipped with its reason.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.gpu_check_parts import case_noted_then_died
from vescale_plugins.tools import gpu_check
from vescale_plugins.tools.gpu_parts import cuda_graph
from vescale_plugins.tools.gpu_parts.context import PartContext

ROOT = Path(__file__).resolve().parents[2]
STATUSES = {"passed", "skipped", "failed"}


def _check_outputs(out: Path, report: dict, names: list[str]) -> None:
    """One JSON record and one summary line per part, in plan order, and the closing line."""
    assert list(report["checks"])[: len(names)] == names
    records = [json.loads(line) for line in (out / "parts.jsonl").read_text().splitlines()]
    assert [r["part"] for r in records] == names
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == names
    assert "wrote" in lines[-1]
    for name in names:
        figures = report["checks"][name]
        assert figures["status"] in STATUSES, (name, figures)
        assert figures["seconds"] >= 0, (name, figures)
        if figures["status"] == "skipped":
            assert figures["reason"], name


@pytest.mark.distributed  # each part runs in a process of its own
@pytest.mark.timeout(300)
def test_a_failing_or_overrunning_part_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    Part = gpu_check.Part
    plan = [
        Part("raises", "tests.support.gpu_check_parts:raises", 60),
        Part("overruns", "tests.support.gpu_check_parts:overruns", 2),
        Part("not_built", ".no_such_part:run", 60),
        Part("cuda_only", "tests.support.gpu_check_parts:passes", 60, "CUDA only: a reason"),
        Part("skips", "tests.support.gpu_check_parts:skips", 60),
        Part("passes", "tests.support.gpu_check_parts:passes", 60),
    ]
    monkeypatch.setattr(gpu_check, "PLAN", plan)
    monkeypatch.setattr(gpu_check, "_CPU_BUDGET_FACTOR", 1)
    assert gpu_check.main(["--cpu", "--out", str(tmp_path), "--budget", "200"]) == 1  # a part failed
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    _check_outputs(tmp_path, report, [p.name for p in plan])
    checks = report["checks"]
    assert checks["raises"]["status"] == "failed"
    assert "this part fails" in checks["raises"]["error"]
    assert checks["overruns"]["status"] == "failed"
    assert "overran its budget of 2 s" in checks["overruns"]["error"]
    assert checks["not_built"]["status"] == "skipped"
    assert "not built yet" in checks["not_built"]["reason"]
    assert checks["cuda_only"].items() >= {"status": "skipped", "reason": "CUDA only: a reason"}.items()
    assert "budget_s" not in checks["cuda_only"]  # skipped before any process started
    assert checks["skips"]["status"] == "skipped"
    assert checks["skips"]["reason"] == "its subject is absent"
    assert checks["passes"]["status"] == "passed"
    assert checks["passes"]["summary"] == "ran with world 1"
    assert report["ok"] is False


def test_the_probe_sets_how_the_multi_rank_parts_get_their_ranks():
    ctx = PartContext("cuda", 1, world=1, ranks_on_one_gpu=False, world_note="", timeout_s=0)
    shared = gpu_check._ranks_after_probe(ctx, {"status": "passed"})
    assert (shared.world, shared.ranks_on_one_gpu, shared.speed_claim) == (2, True, False)
    refused = gpu_check._ranks_after_probe(ctx, {"status": "failed", "error": "ncclInvalidUsage: duplicate GPU\n..."})
    assert refused.world == 1
    assert "NCCL refused" in refused.world_note
    assert "duplicate GPU" in refused.world_note
    eight = gpu_check._ranks_after_probe(PartContext("cuda", 8, 1, False, "", 0), {"status": "passed"})
    assert (eight.world, eight.ranks_on_one_gpu, eight.speed_claim) == (8, False, True)
    cpu = gpu_check._ranks_after_probe(PartContext("cpu", 0, 1, False, "", 0), {"status": "skipped"})
    assert (cpu.world, cpu.speed_claim) == (2, False)


@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_gpu_check_cpu_fallback_writes_every_check(tmp_path):
    out = tmp_path / "gpu_check.json"
    command = [
        sys.executable,
        "-m",
        "vescale_plugins.tools.gpu_check",
        "--cpu",
        "--quick",
        "--json",
        str(out),
        "--budget",
        "800",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu-fallback"
    assert "no CUDA" in report["note"]
    assert report["ok"] is True
    checks = report["checks"]
    assert {
        "parity_multi_rank",
        "bench",
        "triton_kernels",
        "bf16_mixed",
        "comm_streams",
        "optimizer_host_syncs",
    } <= set(checks)
    _check_outputs(tmp_path, report, [p.name for p in gpu_check.PLAN])
    # The CUDA-only parts are skipped with their reasons; the ranks are two gloo processes.
    for part in gpu_check.PLAN:
        if part.cuda_only:
            assert checks[part.name]["status"] == "skipped", part.name
    assert report["ranks"] == {"world_size": 2, "ranks_on_one_gpu": False, "world_note": "two gloo ranks on CPU"}
    assert checks["optimizer_host_syncs"]["status"] == "passed"
    assert set(checks["optimizer_host_syncs"]["optimizers"]) == {"flat AdamW", "AdamW8bit", "Muon"}
    # The CUDA-graph part's dry run: every case's code runs, "replay" (an eager call) matches.
    graphs = checks["cuda_graph"]
    assert graphs["status"] == "passed"
    assert set(graphs["cases"]) == {cuda_graph._name(*case) for case in cuda_graph.CASES}
    for name, case in graphs["cases"].items():
        assert case["capture"] == "dry run ok (no capture off CUDA)", name
        assert case["replay_equals_eager"] is True, name
    parity = checks["parity_multi_rank"]
    assert parity["status"] == "passed"
    assert parity["world_size"] == 2
    assert parity["fp32"]["max_param_diff_vs_unsharded"] <= 1e-4
    assert parity["fp32"]["max_param_diff_vs_fsdp2"] <= 1e-4
    assert checks["bf16_mixed"]["max_param_diff_vs_fsdp2"] <= 2e-2
    assert checks["bf16_mixed"]["grad_dtype"] == "torch.float32"
    # Off CUDA: one stream, nothing recorded, and never a record_stream.
    assert checks["comm_streams"].items() >= {"enabled": False, "events_recorded": 0, "record_stream_calls": 0}.items()
    bench = checks["bench"]
    assert bench["status"] == "passed"
    assert bench["environment"]["backend"] == "gloo"
    assert bench["speed_claim"] is False
    for name in ("fsdp2", "vescale"):
        assert bench["engines"][name]["peak_bytes"] > 0
        assert bench["engines"][name]["page_faults_per_step"] >= 0
    assert checks["triton_kernels"]["status"] in ("skipped", "passed")
    if checks["triton_kernels"]["status"] == "skipped":
        assert checks["triton_kernels"]["reason"]


def test_cuda_graph_reports_any_rank_s_failed_capture_and_the_worst_difference():
    ok = {"capture": "captured ok", "loss_diff": 0.0, "max_grad_diff": 1e-7, "replay_equals_eager": True}
    failed = {"capture": "failed: RuntimeError: operation not permitted when stream is capturing"}
    assert cuda_graph._verdict([ok, failed])["capture"] == failed["capture"]
    worse = {**ok, "max_grad_diff": 3e-3, "replay_equals_eager": False}
    verdict = cuda_graph._verdict([ok, worse])
    assert verdict["max_grad_diff"] == 3e-3
    assert verdict["replay_equals_eager"] is False
    summary = cuda_graph._summary({"a": verdict, "b": cuda_graph._verdict([failed, failed])})
    assert (
        summary
        == "a: captured ok, replay != eager; b: failed: RuntimeError: operation not permitted when stream is capturing"
    )


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_cuda_graph_case_whose_ranks_die_keeps_what_they_noted():
    ctx = PartContext("cpu", 0, world=2, ranks_on_one_gpu=False, world_note="", timeout_s=150)
    cases = cuda_graph.each_case_in_its_ranks(ctx, case_noted_then_died, [("vescale", True, False)])
    case = cases["vescale reshard_after_forward=True"]
    assert case["capture"] == "captured ok"
    assert "did not finish" in case["ranks_failed"]
    assert "(ranks failed: RankFailure" in cuda_graph._summary(cases)
