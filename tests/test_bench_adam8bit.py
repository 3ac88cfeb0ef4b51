"""``python -m vescale_plugins.bench.adam8bit`` runs end to end (tiny), and the 8-bit state is
about a quarter of fp32 AdamW's on the bench model (a byte count, not a timing)."""

from __future__ import annotations

import json

import torch

from vescale_plugins.bench import adam8bit
from vescale_plugins.bench.llama import PRESETS, Llama
from vescale_plugins.optim import AdamW, AdamW8bit


def test_cli_smoke(tmp_path, capsys):
    out = tmp_path / "result.json"
    adam8bit.main(["--optimizer", "adamw", "--model", "tiny", "--batch-size", "1", "--seq-len", "8", "--steps", "1", "--warmup", "1", "--quality-steps", "2", "--memory-repeats", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "optimizer step, median (ms)" in printed and "quality" in printed
    results = json.loads(out.read_text())["results"]
    for name in adam8bit.PAIRS["adamw"]:
        figures = results[name]
        assert figures["optimizer_step_s"] > 0 and figures["peak_bytes"] > 0
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
