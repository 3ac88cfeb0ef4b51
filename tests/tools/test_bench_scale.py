"""`bench scale` at a small W: both engines on the fake process group, every figure written."""

import json

import pytest

from vescale_plugins.bench.__main__ import main


@pytest.mark.distributed
def test_scale_mode_measures_both_engines(tmp_path):
    result, plot = tmp_path / "scale.json", tmp_path / "scale.png"
    argv = ["scale", "--world-sizes", "4", "--model", "tiny-block", "--steps", "1", "--warmup", "1"]
    assert main([*argv, "--json", str(result), "--plot", str(plot), "--timeout", "120"]) == 0
    runs = json.loads(result.read_text())["runs"]
    assert {r["engine"] for r in runs} == {"vescale", "fsdp2"}
    assert plot.stat().st_size > 0
    for run in runs:
        assert run["world_size"] == 4
        assert run["collectives_per_step"] > 0
        assert run["host_ms_per_step"] > 0
        assert 0 <= run["padding"] < 1
        assert run["sharded_bytes_per_rank"] > 0
        assert run["ops_by_region"]
        assert run["ops_by_name"]
