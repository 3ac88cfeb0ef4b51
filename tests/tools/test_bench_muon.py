"""`python -m vescale_plugins.bench muon` end to end on a micro model: JSON, figures, parity."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


def test_muon_bench_cli_writes_figures_and_both_engines_train_the_same_weights(tmp_path):
    # "micro": 2 layers, hidden 32; Newton-Schulz in bf16 is slow on CPUs without bf16 units.
    result_json = tmp_path / "muon.json"
    command = [
        sys.executable,
        "-m",
        "vescale_plugins.bench",
        "muon",
        "--model",
        "micro",
        "--world-sizes",
        "2",
        "--batch-size",
        "1",
        "--seq-len",
        "16",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--json",
        str(result_json),
    ]
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "veScale / FSDP2" in completed.stdout
    summary = json.loads(result_json.read_text())["runs"]["2"]["summary"]
    vescale, fsdp2 = summary["engines"]["vescale"], summary["engines"]["fsdp2"]
    assert summary["muon_matrices"] == 14  # 2 layers x (q, k, v, o, gate, up, down)
    # Each matrix is orthogonalised once over the 2 ranks, not on both, and travels in bf16 both ways
    # instead of being gathered in fp32.
    assert 0.45 < summary["ratios"]["ns_flops_per_rank"] <= 0.6
    assert vescale["optimizer_bytes_sent"] < fsdp2["optimizer_bytes_sent"]
    assert vescale["buckets"] >= 7
    assert fsdp2["buckets"] == 0
    for engine in (vescale, fsdp2):
        assert engine["optimizer_ms"]["median"] > 0
        assert engine["step_ms"]["median"] >= engine["optimizer_ms"]["median"]
    assert summary["parity"]["max_param_diff"] < 1e-6
