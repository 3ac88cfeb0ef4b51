"""``python -m vescale_plugins.tools.gpu_check``'s CPU fallback end to end: every check runs on gloo and lands in the JSON.

The CUDA path itself needs a GPU; what runs here is the same driver, the same parity bodies
(veScale-FSDP vs the unsharded model and vs FSDP2, fp32 and bf16-mixed), the stream counters
and the benchmark, on CPU.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    assert report["mode"] == "cpu-fallback" and "no CUDA" in report["note"] and report["ok"] is True
    checks = report["checks"]
    assert {
        "parity_multi_rank",
        "bench",
        "triton_kernels",
        "bf16_mixed",
        "comm_streams",
        "optimizer_host_syncs",
    } <= set(checks)
    assert checks["optimizer_host_syncs"]["status"] == "passed"
    parity = checks["parity_multi_rank"]
    assert parity["status"] == "passed" and parity["world_size"] == 2
    assert parity["fp32"]["max_param_diff_vs_unsharded"] <= 1e-4 and parity["fp32"]["max_param_diff_vs_fsdp2"] <= 1e-4
    assert (
        checks["bf16_mixed"]["max_param_diff_vs_fsdp2"] <= 2e-2
        and checks["bf16_mixed"]["grad_dtype"] == "torch.float32"
    )
    # Off CUDA: one stream, nothing recorded, and never a record_stream.
    assert checks["comm_streams"].items() >= {"enabled": False, "events_recorded": 0, "record_stream_calls": 0}.items()
    bench = checks["bench"]
    assert bench["status"] == "passed" and bench["environment"]["backend"] == "gloo"
    for name in ("fsdp2", "vescale"):
        assert bench["engines"][name]["peak_bytes"] > 0 and bench["engines"][name]["page_faults_per_step"] >= 0
    assert checks["triton_kernels"]["status"] in ("skipped", "passed")
    if checks["triton_kernels"]["status"] == "skipped":
        assert checks["triton_kernels"]["reason"]
