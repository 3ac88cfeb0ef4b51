"""`python -m vescale_plugins.bench` end to end on a tiny configuration: JSON, plot, parity."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(arguments: str, *extra: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m vescale_plugins.bench`` with ``arguments`` (split on spaces) and ``extra``, asserted to succeed."""
    command = [sys.executable, "-m", "vescale_plugins.bench", *arguments.split(), *extra]
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed


@pytest.mark.distributed
def test_bench_cli_writes_every_figure_and_parity_holds(tmp_path):
    result_json, plot, record = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "record.json"
    completed = run_bench(
        "--model tiny --world-size 2 --seq-len 32 --warmup 1 --steps 3",
        *("--json", str(result_json), "--plot", str(plot), "--record", str(record)),
    )
    assert "veScale / FSDP2" in completed.stdout
    assert "parity:" in completed.stdout

    data = json.loads(result_json.read_text())
    assert data["environment"]["world_size"] == 2
    assert data["environment"]["backend"] == "gloo"
    assert data["settings"]["config"]["vocab_size"] == 1009
    summary = data["summary"]
    for name in ("fsdp2", "vescale"):
        figures = summary["engines"][name]
        assert len(figures["step_ms"]["samples"]) == 3
        for key in (
            "tokens_per_s",
            "peak_bytes",
            "sharded_state_bytes",
            "padding_bytes",
            "all_gather_bytes_per_step",
            "reduce_scatter_bytes_per_step",
            "copy_ms_per_step",
        ):
            assert figures[key] >= 0, (name, key)
        assert figures["peak_bytes"] > 0
        assert figures["sharded_state_bytes"] > 0
    assert summary["engines"]["vescale"]["copy_ms_per_step"] == 0
    assert summary["engines"]["fsdp2"]["copy_ms_per_step"] > 0
    assert set(summary["ratios"]) >= {"step_time", "step_time_paired", "peak_memory", "sharded_state", "padding"}
    parity = summary["parity"]
    assert abs(parity["loss"]["fsdp2"] - parity["loss"]["vescale"]) < 1e-5
    assert parity["max_param_diff"] < 1e-5
    assert plot.stat().st_size > 1000
    ranks = json.loads(record.read_text())["ranks"]
    assert len(ranks) == 2
    assert ranks[0]["communication"]["summary"]["reduce_scatter"]["count"] > 0


@pytest.mark.distributed
@pytest.mark.parametrize("frontend", ["fabric", "accelerate"])
def test_bench_cli_through_lightning_fabric_and_accelerate(tmp_path, frontend):
    result_json = tmp_path / "bench.json"
    run_bench(
        "--model tiny --world-size 2 --seq-len 32 --warmup 1 --steps 2 --plot=",
        *("--frontend", frontend, "--json", str(result_json)),
    )
    data = json.loads(result_json.read_text())
    assert data["settings"]["frontend"] == frontend
    # The front end chose the units (each decoder layer, then the root); FSDP2 got the same
    # ones, so both move the same bytes per step (padding aside).
    assert data["ranks"][0]["units"] == [["layers.1"], ["layers.0"], [""]]
    engines = data["summary"]["engines"]
    gathered = [engines[name]["all_gather_bytes_per_step"] for name in ("fsdp2", "vescale")]
    assert abs(gathered[0] - gathered[1]) <= 0.01 * gathered[0], gathered
    parity = data["summary"]["parity"]
    assert abs(parity["loss"]["fsdp2"] - parity["loss"]["vescale"]) < 1e-5
    assert parity["max_param_diff"] < 1e-5


@pytest.mark.distributed
def test_bench_cli_hsdp_on_a_2x2_mesh(tmp_path):
    """``--hsdp 2`` at W=4: both engines on the same (replicate, shard) mesh, trained alike."""
    result_json = tmp_path / "bench.json"
    run_bench(
        "--model tiny --world-size 4 --hsdp 2 --seq-len 32 --warmup 1 --steps 2 --plot=",
        *("--json", str(result_json)),
        timeout=400,
    )
    data = json.loads(result_json.read_text())
    assert data["settings"]["replicate"] == 2
    assert data["environment"]["world_size"] == 4
    parity = data["summary"]["parity"]
    assert abs(parity["loss"]["fsdp2"] - parity["loss"]["vescale"]) < 1e-5
    assert parity["max_param_diff"] < 1e-5
    # sharded over the 2 ranks of a shard group, not 4: parameters, gradients and AdamW's two
    # moments (16 bytes per fp32 parameter) of half the model per rank
    from vescale_plugins.bench.llama import PRESETS, Llama

    half_model_bytes = 16 * sum(p.numel() for p in Llama(PRESETS["tiny"]).parameters()) / 2
    for name in ("fsdp2", "vescale"):
        assert data["summary"]["engines"][name]["sharded_state_bytes"] == pytest.approx(half_model_bytes, rel=1e-2)


@pytest.mark.parametrize(("text", "expected"), [("true", True), ("false", False), ("default", None), ("2", 2)])
def test_reshard_after_forward_takes_a_bool_or_a_number_of_ranks(text, expected):
    from vescale_plugins.bench.__main__ import parse_args

    assert parse_args(["--reshard-after-forward", text]).reshard_after_forward == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "4", "--hsdp", "3"], "--hsdp 3 must divide the world size (4)"),
        (["--world-size", "4", "--hsdp", "2", "--frontend", "fabric"], "--hsdp runs with --frontend plain"),
        (
            ["--world-size", "4", "--hsdp", "2", "--reshard-after-forward", "4"],
            "--reshard-after-forward 4 must divide the shard group's size (2)",
        ),
        (["--compile", "--frontend", "accelerate"], "--compile runs with --frontend plain"),
    ],
)
def test_bench_refuses_meshes_it_cannot_build(argv, message):
    from vescale_plugins.bench.__main__ import main

    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        main(argv)


@pytest.mark.distributed
def test_bench_cli_quantized_comm_rows_beside_the_exact_run(tmp_path):
    result_json = tmp_path / "comm.json"
    completed = run_bench(
        "--model tiny --world-size 2 --seq-len 32 --warmup 1 --steps 2 --precision bf16-mixed",
        *("--comm", "int8,int8-grads", "--json", str(result_json), "--plot", ""),
    )
    assert "quantized collectives beside the exact run" in completed.stdout
    engines = json.loads(result_json.read_text())["summary"]["engines"]
    assert list(engines) == ["fsdp2", "vescale", "vescale-int8", "vescale-int8-grads"]
    assert engines["vescale"]["bytes_vs_exact"] == {"all_gather": 1.0, "reduce_scatter": 1.0}
    # bf16 gathers against int8 codes with fp32 scales; fp32 reductions against int8 (here 1/4).
    assert engines["vescale-int8"]["bytes_vs_exact"]["all_gather"] <= 0.53
    assert engines["vescale-int8"]["bytes_vs_exact"]["reduce_scatter"] == 1.0
    assert engines["vescale-int8-grads"]["bytes_vs_exact"]["reduce_scatter"] <= 0.53 / 2
    for e in engines.values():
        assert abs(e["loss_vs_exact"]) < 0.01
