"""The forecast's veScale/FSDP2 step-time ratio against the bench's measured one, at W=2 and 4.

    python -m vescale_plugins.bench.forecast_accuracy [--world-sizes 2,4] [--runs 3] [--steps 16]
        [--out docs/forecast_calibration.json]
    python -m vescale_plugins.bench.forecast_accuracy --replay docs/forecast_calibration.json [more.json]

(or ``vescale-forecast-accuracy``). It lives in the bench, which it runs, so that the forecast
imports nothing of the bench (the bench imports the forecast's model for ``scale``).

For each world size W (about 30 min each with --runs 2 on the shared 2-core machine at load 10-40):

1. calibrate this machine on W gloo processes (``vescale_plugins.forecast --calibrate FILE
   --calibrate-ranks W``: the ring's
   latency and bandwidth fitted to an all-gather/reduce-scatter sweep, FSDP2's gloo
   collectives over veScale-FSDP's in-place ones, the copy rate per process) and measure the
   bench model's own compute rate: W unsharded processes at once (the cores shared as the
   bench's ranks share them), forward and backward, its FLOPs over the time, no engine and
   no communication involved (the forecast runs at MFU 1 of that rate);
2. run ``python -m vescale_plugins.bench --world-size W --steps S`` ``--runs`` times (both
   engines interleaved, each run's median of paired veScale/FSDP2 step ratios);
3. calibrate again (the machine is shared and its load drifts; the forecast takes the means
   of the two calibrations);
4. forecast the bench configuration with those constants and compare: the measured ratio is
   the median of the runs' paired-ratio medians.

Everything measured is kept in the output JSON, so ``--replay`` recomputes the forecast
side from it with the current model (no measurement): that is how a change to the model is
checked against the same measurements.
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
from collections.abc import Sequence
from typing import Any

import torch

from vescale_plugins.bench.compare import add_arguments as add_bench_arguments
from vescale_plugins.bench.compare import bench_settings
from vescale_plugins.bench.engines import BenchSettings, build_model
from vescale_plugins.bench.llama import LlamaConfig
from vescale_plugins.bench.report import summarize
from vescale_plugins.bench.runner import launch, settings_dict
from vescale_plugins.forecast.calibrate import calibrate
from vescale_plugins.forecast.compute import training_flops_per_token
from vescale_plugins.forecast.forecast import forecast_world_size
from vescale_plugins.forecast.hardware import load_hardware
from vescale_plugins.forecast.model import spec_from_modules
from vescale_plugins.forecast.settings import ForecastSettings
from vescale_plugins.tools.launch import launch_ranks

TOLERANCE = 0.10  # the accepted error: forecast ratio within 10 % of the measured one
BENCH_TIMEOUT_S = 3600.0
# Calibrated fields the forecast uses (means of the calibrations before and after the bench).
CALIBRATED_FIELDS = (
    "intra_node_latency_s",
    "intra_node_bandwidth",
    "memory_bandwidth",
    "fsdp2_all_gather_factor",
    "fsdp2_reduce_scatter_factor",
)


def bench_spec(settings: BenchSettings):
    """The bench model's FSDP units in forward order, as its engines wrap them."""
    model = build_model(settings, torch.device("meta"))
    return spec_from_modules("bench-small", model.fsdp_units(), settings.config.to_dict())


def settings_from_json(d: dict[str, Any]) -> BenchSettings:
    """The bench's ``settings`` (its JSON) back as :class:`BenchSettings`."""
    return BenchSettings(**{**d, "config": LlamaConfig(**d["config"])})


def _time_unsharded(settings: BenchSettings, repeats: int) -> float:
    """Median seconds of this process's unsharded forward + backward (after one untimed)."""
    model = build_model(settings, torch.device("cpu"))
    assert isinstance(settings.config, LlamaConfig)  # the forecast's bench model is the decoder
    tokens = torch.randint(0, settings.config.vocab_size, (settings.batch_size, settings.seq_len + 1))
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        settings.config.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def unsharded_compute_s(settings: BenchSettings, world: int, repeats: int = 5) -> float:
    """Median seconds of one unsharded forward + backward of the bench model, on ``world``
    processes at once with the bench's threads per rank (they share nothing but the cores)."""
    return statistics.median(launch_ranks(_time_unsharded, world, settings, repeats, timeout_s=900, backend="gloo"))


def _calibration(world: int, settings: BenchSettings) -> dict[str, Any]:
    path = os.path.join(tempfile.mkdtemp(), "cpu.json")
    load = os.getloadavg()[0]
    figures = calibrate(path, ranks=world)
    figures.pop("measured")
    return {
        "hardware": figures,
        "unsharded_compute_s": unsharded_compute_s(settings, world),
        "load_average": [load, os.getloadavg()[0]],
    }


def bench_arguments(world: int, steps: int) -> argparse.Namespace:
    """The bench's defaults (``python -m vescale_plugins.bench``) at ``world`` ranks and ``steps`` steps."""
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(["--world-size", str(world), "--steps", str(steps)])


def _bench_run(world: int, steps: int) -> dict[str, Any]:
    """One run of the bench's comparison; its settings and the figures compared."""
    args = bench_arguments(world, steps)
    settings, _ = bench_settings(args)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    results = launch(settings, world, args.warmup, args.steps, BENCH_TIMEOUT_S, lambda _: None)
    summary = summarize(results, tokens_per_step=world * settings.batch_size * settings.seq_len)
    return {
        "command": f"python -m vescale_plugins.bench --world-size {world} --steps {steps}",
        "wall_s": time.perf_counter() - start,
        "load_average": [load, os.getloadavg()[0]],
        "settings": settings_dict(settings),
        "paired_ratio": summary["ratios"]["step_time_paired"],
        "ratio_of_medians": summary["ratios"]["step_time"],
        "step_s": {e: summary["engines"][e]["step_ms"]["median"] / 1e3 for e in ("vescale", "fsdp2")},
        "copy_s": {e: summary["engines"][e]["copy_ms_per_step"] / 1e3 for e in ("vescale", "fsdp2")},
    }


def measure(world: int, runs: int, steps: int, settings: BenchSettings) -> dict[str, Any]:
    """Calibrate, run the bench ``runs`` times, calibrate again (see the module docstring)."""
    before = _calibration(world, settings)
    benches = [_bench_run(world, steps) for _ in range(runs)]
    after = _calibration(world, settings)
    return {"world_size": world, "calibrations": [before, after], "bench_runs": benches}


def compare(measured: dict[str, Any]) -> dict[str, Any]:
    """The forecast of the bench configuration with the measured constants, against the bench."""
    world = measured["world_size"]
    settings = settings_from_json(measured["bench_runs"][0]["settings"])
    spec = bench_spec(settings)
    calibrations = measured["calibrations"]
    constants = {k: statistics.mean(c["hardware"][k] for c in calibrations) for k in CALIBRATED_FIELDS}
    compute_s = statistics.mean(c["unsharded_compute_s"] for c in calibrations)
    tokens = settings.batch_size * settings.seq_len
    # The compute rate is the bench model's own, measured unsharded: FLOPs over seconds, MFU 1.
    rate = training_flops_per_token(spec, settings.seq_len, False) * tokens / compute_s
    hardware = dataclasses.replace(
        load_hardware("h100"),
        **constants,
        name=calibrations[0]["hardware"]["name"],
        peak_flops_fp32=rate,
        inter_node_latency_s=constants["intra_node_latency_s"],
        inter_node_bandwidth=constants["intra_node_bandwidth"],
        gpus_per_node=world,
        copy_efficiency=1.0,
        overlaps_communication=False,
    )
    precision = "bf16-mixed" if settings.mixed_precision else "fp32"
    entry = forecast_world_size(
        spec,
        hardware,
        world,
        ForecastSettings(
            precision=precision,
            tokens_per_gpu=tokens,
            seq_len=settings.seq_len,
            mfu=1.0,
            block_rows=settings.block_rows,
            activation_checkpointing=False,
        ),
    )
    steps = {e: entry["engines"][e]["step"] for e in ("vescale", "fsdp2")}
    runs = measured["bench_runs"]
    measured_ratio = statistics.median(r["paired_ratio"] for r in runs)
    forecast_ratio = entry["ratios"]["step_time"]
    error = forecast_ratio / measured_ratio - 1
    return {
        "world_size": world,
        "constants": constants | {"compute_rate_flops": rate, "unsharded_compute_s": compute_s},
        "measured_ratio": measured_ratio,
        "measured_paired_ratios": [r["paired_ratio"] for r in runs],
        "forecast_ratio": forecast_ratio,
        "relative_error": error,
        "within_tolerance": abs(error) <= TOLERANCE,
        "measured_step_s": {e: statistics.median(r["step_s"][e] for r in runs) for e in ("vescale", "fsdp2")},
        "measured_copy_s": {e: statistics.median(r["copy_s"][e] for r in runs) for e in ("vescale", "fsdp2")},
        "forecast_step": steps,
    }


def _print(row: dict[str, Any]) -> None:
    m, f = row["measured_step_s"], row["forecast_step"]
    print(
        f"W={row['world_size']}: veScale/FSDP2 step time measured {row['measured_ratio']:.3f} "
        f"(runs {', '.join(f'{r:.3f}' for r in row['measured_paired_ratios'])}), forecast {row['forecast_ratio']:.3f}: "
        f"{row['relative_error']:+.1%} ({'within' if row['within_tolerance'] else 'OUTSIDE'} {TOLERANCE:.0%})\n"
        f"     step s measured veScale {m['vescale']:.3f} FSDP2 {m['fsdp2']:.3f}; forecast veScale {f['vescale']['step_s']:.3f} "
        f"(compute {f['vescale']['compute_s']:.3f}, comm {f['vescale']['exposed_comm_s']:.3f}, copies {f['vescale']['copy_s']:.3f}, optimizer {f['vescale']['optimizer_s']:.3f}) "
        f"FSDP2 {f['fsdp2']['step_s']:.3f} (compute {f['fsdp2']['compute_s']:.3f}, comm {f['fsdp2']['exposed_comm_s']:.3f}, copies {f['fsdp2']['copy_s']:.3f}, optimizer {f['fsdp2']['optimizer_s']:.3f})\n"
        f"     FSDP2 copy-in/out measured {row['measured_copy_s']['fsdp2']:.3f} s per step"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vescale_plugins.bench.forecast_accuracy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--runs", type=int, default=3, help="bench runs per world size")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per engine per bench run")
    parser.add_argument("--out", default="docs/forecast_calibration.json")
    parser.add_argument(
        "--replay",
        nargs="+",
        default=None,
        metavar="JSON",
        help="recompute the forecast from these files' measurements (written to --out); measure nothing",
    )
    args = parser.parse_args(argv)
    if args.replay:
        measurements = []
        for path in args.replay:
            with open(path) as f:
                measurements += [w["measured"] for w in json.load(f)["world_sizes"]]
    else:
        measurements = []
        for world in (int(w) for w in args.world_sizes.split(",")):
            settings, _ = bench_settings(bench_arguments(world, args.steps))
            measurements.append(measure(world, args.runs, args.steps, settings))
    rows = []
    for measured in measurements:
        row = compare(measured)
        _print(row)
        rows.append(row | {"measured": measured})
    with open(args.out, "w") as f:
        json.dump(
            {"machine": f"{os.cpu_count()} CPUs, shared", "tolerance": TOLERANCE, "world_sizes": rows}, f, indent=1
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
