"""``python -m vescale_plugins.bench adam8bit`` runs end to end (tiny), and the 8-bit state is
about a quarter of fp32 AdamW's on the bench model (a byte count, not a timing)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from vescale_plugins.bench import adam8bit
from vescale_plugins.bench.__main__ import main
from vescale_plugins.bench.llama import PRESETS, Llama
from vescale_plugins.optim import AdamW, AdamW8bit


@pytest.mark.distributed
def test_cli_smoke(tmp_path, capsys):
    out = tmp_path / "result.json"
    main(
        [
            "adam8bit",
            "--optimizer",
            "adamw",
            "--model",
            "tiny",
            "--batch-size",
            "1",
            "--seq-len",
            "8",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--quality-steps",
            "2",
            "--memory-repeats",
            "1",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "optimizer step, median (ms)" in printed
    assert "quality" in printed
    results = json.loads(out.read_text())["results"]
    for name in adam8bit.PAIRS["adamw"]:
        figures = results[name]
        assert figures["optimizer_step_s"] > 0
        assert figures["peak_bytes"] > 0
        # fp32 AdamW: two fp32 moments per element, plus the step counters.
        assert 8.0 <= figures["state_bytes"] / figures["parameter_elements"] < 8.01
        assert figures["quality_final_loss"] > 0


def test_eight_bit_state_is_at_most_0_27_of_fp32_on_the_bench_model():
    model = Llama(PRESETS["tiny"])  # the default model's shapes, scaled down (same byte rule)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    eight, fp32 = AdamW8bit(model.parameters(), lr=0.0), AdamW(model.parameters(), lr=0.0)
    eight.step()
    fp32.step()
    ratio = adam8bit.state_bytes(eight) / adam8bit.state_bytes(fp32)
    assert ratio <= 0.27, ratio


def _local_shards_step_like_the_dtensors():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))  # 5 and 3 rows: uneven shards
        torch_fully_shard(model, mesh=mesh)
        models.append(model)
    initial = [p.to_local().clone() for p in models[0].parameters()]
    direct = torch.optim.AdamW(models[0].parameters(), lr=0.1, foreach=False)
    wrapped = adam8bit.OnLocalShards(
        models[1].parameters(), lambda shards: torch.optim.AdamW(shards, lr=0.1, foreach=False)
    )
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(3):
        for model, optimizer in ((models[0], direct), (models[1], wrapped)):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in models[1].parameters())
    for a, b, before in zip(models[0].parameters(), models[1].parameters(), initial):
        assert torch.equal(a.to_local(), b.to_local())
        assert before.numel() == 0 or not torch.equal(before, b.to_local())


@pytest.mark.parametrize("world", [2, 3])
def test_optimizer_on_local_shards_steps_fsdp2_parameters_as_on_the_dtensors(dist_run, world):
    """The torchao peer's wrapper: stepping FSDP2's local shards updates the model exactly as
    the same optimizer given the DTensor parameters does."""
    dist_run(_local_shards_step_like_the_dtensors, world, timeout=120)
