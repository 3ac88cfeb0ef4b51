"""The forecast's step-time ratio against the bench's measured one, on this machine.

Run ``python scripts/forecast_calibration.py [--world-sizes 2,4] [--steps 12]`` (a few
minutes on 2 cores). It

1. calibrates this machine before and after the bench (``--calibrate``: the ring's latency
   and bandwidth from a gloo all-gather/reduce-scatter sweep on 2 processes, FSDP2's gloo
   collectives over veScale-FSDP's in-place ones, the copy rate) and takes the means: the
   machine is shared and its load drifts;
2. measures the compute rate of the bench's default model the same way: W unsharded
   processes at once (sharing the cores as the ranks do), forward and backward, its FLOPs
   over the time (no engine, no communication involved); the forecast runs at MFU 1 of it;
3. runs the bench (both engines side by side, as ``python -m vescale_plugins.bench``),
   forecasts the same configuration and prints both veScale/FSDP2 step-time ratios.

With more ranks than cores, each rank gets ``cores / W`` of the calibrated copy rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from typing import Any  # noqa: E402

from vescale_plugins.bench.engines import BenchSettings, _loss, build_model  # noqa: E402
from vescale_plugins.bench.llama import PRESETS  # noqa: E402
from vescale_plugins.bench.runner import launch  # noqa: E402
from vescale_plugins.forecast import ForecastSettings, forecast_world_size, load_hardware, spec_from_modules  # noqa: E402
from vescale_plugins.forecast.calibrate import calibrate  # noqa: E402
from vescale_plugins.forecast.compute import training_flops_per_token  # noqa: E402


def bench_spec(settings: BenchSettings):
    model = build_model(settings, torch.device("meta"))
    units = [("embed_tokens", [model.embed_tokens])] + [(f"layers.{i}", [layer]) for i, layer in enumerate(model.layers)] + [("norm+lm_head", [model.norm, model.lm_head])]
    return spec_from_modules("bench-small", units, settings.config.to_dict())


def _time_unsharded(settings: BenchSettings, threads: int, repeats: int, out: Any) -> None:
    torch.set_num_threads(threads)
    model = build_model(settings, torch.device("cpu"))
    tokens = torch.randint(0, settings.config.vocab_size, (settings.batch_size, settings.seq_len + 1))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        _loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    out.put(statistics.median(times[1:]))


def unsharded_compute_s(settings: BenchSettings, world: int, repeats: int = 5) -> float:
    """Median seconds of one unsharded forward + backward of the bench model, on ``world``
    processes at once (the cores shared as the bench's ranks share them)."""
    context = mp.get_context("spawn")
    out = context.Queue()
    threads = max(1, (os.cpu_count() or 1) // world)
    processes = [context.Process(target=_time_unsharded, args=(settings, threads, repeats, out)) for _ in range(world)]
    for p in processes:
        p.start()
    seconds = [out.get(timeout=900) for _ in processes]
    for p in processes:
        p.join()
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    settings = BenchSettings(PRESETS["small"], batch_size=4, seq_len=128, mixed_precision=False, reshard_after_forward=None, block_rows=None, frontend="plain", seed=0)
    cores = os.cpu_count() or 1
    spec = bench_spec(settings)
    tokens = settings.batch_size * settings.seq_len
    for world in [int(w) for w in args.world_sizes.split(",")]:
        # Calibrate and time the compute before and after the bench (the machine is shared:
        # its load drifts); the forecast takes the means.
        path = os.path.join(tempfile.mkdtemp(), "cpu.json")
        before = calibrate(path), unsharded_compute_s(settings, world)
        results = launch(settings, world, 2, args.steps, 1800.0, lambda _: None)
        after = calibrate(path), unsharded_compute_s(settings, world)
        measured = {e: statistics.median(s for r in results for s in r["seconds"][e]) for e in ("vescale", "fsdp2")}
        calibrated = {k: (before[0][k] + after[0][k]) / 2 for k in ("intra_node_latency_s", "intra_node_bandwidth", "memory_bandwidth", "fsdp2_all_gather_factor", "fsdp2_reduce_scatter_factor")}
        compute_s = (before[1] + after[1]) / 2
        # The compute rate is the bench model's own, measured unsharded: FLOPs over seconds, MFU 1.
        rate = training_flops_per_token(spec, settings.seq_len, False) * tokens / compute_s
        share = min(1.0, cores / world)
        hardware = dataclasses.replace(
            load_hardware("h100", path), peak_flops_fp32=rate, inter_node_latency_s=calibrated["intra_node_latency_s"],
            inter_node_bandwidth=calibrated["intra_node_bandwidth"], **calibrated,
        )
        hardware = dataclasses.replace(hardware, memory_bandwidth=hardware.memory_bandwidth * share)
        mfu = 1.0
        entry = forecast_world_size(spec, hardware, world, ForecastSettings(precision="fp32", tokens_per_gpu=tokens, seq_len=settings.seq_len, mfu=mfu, activation_checkpointing=False))
        steps = {e: entry["engines"][e]["step"] for e in ("vescale", "fsdp2")}
        print(json.dumps({
            "world_size": world,
            "calibrated": calibrated, "compute_rate_flops": rate, "unsharded_compute_s": [before[1], after[1]],
            "measured_step_s": measured, "measured_ratio": measured["vescale"] / measured["fsdp2"],
            "forecast_step": steps, "forecast_ratio": entry["ratios"]["step_time"],
        }, indent=1))


if __name__ == "__main__":
    main()
