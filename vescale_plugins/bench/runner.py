"""Run the comparison on W processes and collect every rank's measurements.

Each rank builds the engines on the same model, data and seed, warms them up, then steps
them alternately (A B C, C B A, ...) so machine noise hits all alike, timing each step between
barriers. Peak memory is measured per engine in a fresh process-local tracker around
building and a steady-state step. Progress events stream to the parent for the bar.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from vescale_plugins.bench.engines import (
    PEER_ENGINES,
    BenchSettings,
    Engine,
    UnitChoice,
    batches,
    build_engine,
    copy_ms,
    full_parameters,
    padding_and_traffic,
    parameter_names,
    sharded_state_bytes,
    vescale_unit_groups,
    vescale_units,
)
from vescale_plugins.observe.allocations import AllocationTracker
from vescale_plugins.tools.launch import launch_ranks, report_progress


def _device() -> torch.device:
    """The launcher's GPU for this rank under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


# On CPU the tracker can only over-count (a free the profiler did not see; which ones varies
# from run to run, see vescale_plugins.observe.allocations), so the smallest of a few
# measurements is the figure.
CPU_MEMORY_REPEATS = 3


def _measure_memory(
    name: str, settings: BenchSettings, mesh: Any, device: torch.device, data: list, units: list[UnitChoice] | None
) -> dict[str, int]:
    """Peak live tensor bytes of one engine (``peak_bytes``): build, one warm step, one
    measured step.

    CUDA: the allocator's own statistics, above what was allocated before the build
    (``peak_bytes`` = ``cuda_max_allocated_bytes``; ``cuda_max_reserved_bytes``: the caching
    allocator's peak reservation, fragmentation included; ``cuda_alloc_retries``: the times
    it freed its cache to satisfy an allocation, each a device sync). CPU: the smallest of
    ``CPU_MEMORY_REPEATS`` allocation-tracker measurements.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base, base_reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        base_retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        engine = build_engine(name, settings, mesh, device, units)
        for tokens, targets in data[:2]:
            engine.step(tokens.to(device), targets.to(device))
        torch.cuda.synchronize(device)
        allocated = torch.cuda.max_memory_allocated(device) - base
        reserved = torch.cuda.max_memory_reserved(device) - base_reserved
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0) - base_retries
        del engine
        return {
            "peak_bytes": allocated,
            "cuda_max_allocated_bytes": allocated,
            "cuda_max_reserved_bytes": reserved,
            "cuda_alloc_retries": retries,
        }
    peaks = []
    for _ in range(CPU_MEMORY_REPEATS):
        with AllocationTracker() as tracker:
            engine = build_engine(name, settings, mesh, device, units)
            engine.step(*data[0])
            with tracker.region("step"):
                engine.step(*data[1])
        del engine
        peaks.append(tracker.region_memory("step").peak_bytes)
    return {"peak_bytes": min(peaks)}


def _record_vescale(engine: Any, data: list, device: torch.device) -> dict[str, Any]:
    """The run record of a few more veScale-FSDP steps (sharding, memory, every collective)."""
    from vescale_plugins.observe.record import record_run

    with record_run(engine.model, engine.optimizer) as record:
        for tokens, targets in data:
            engine.step(tokens.to(device), targets.to(device))
            record.mark_step()
    return {"record": record.to_dict(), "summary": record.summary()}


def _max_param_diff(engine: Engine, reference: dict[str, Any]) -> float:
    """The largest difference of any parameter from FSDP2's (``reference``: its DTensors by name)."""
    return max((p - reference[name].full_tensor()).abs().max().item() for name, p in full_parameters(engine))


def run_rank(settings: BenchSettings, warmup: int, steps: int, record_steps: int = 0) -> dict[str, Any]:
    """Everything one rank measures; returns plain data. Reports each step as progress."""
    device = _device()
    mesh = settings.mesh(device.type, dist.get_world_size())
    data = batches(settings, dist.get_rank(), warmup + steps)
    # A front end's own wrap policy chooses veScale-FSDP's units (and their resharding), and
    # FSDP2 gets the same, so veScale-FSDP is built first there. Plain: FSDP2 first, so
    # veScale-FSDP's planner time does not include the process's first DTensor set-up.
    if settings.frontend == "plain":
        units, fsdp2 = None, build_engine("fsdp2", settings, mesh, device)
        vescale = build_engine("vescale", settings, mesh, device)
    else:
        vescale = build_engine("vescale", settings, mesh, device)
        units = vescale_units(vescale.model)
        fsdp2 = build_engine("fsdp2", settings, mesh, device, units)
    engines = {"fsdp2": fsdp2, "vescale": vescale}
    for name in settings.engines:
        if name in PEER_ENGINES:
            engines[name] = build_engine(name, settings, mesh, device)
    names = tuple(engines)
    for tokens, targets in data[:warmup]:
        for engine in engines.values():
            engine.step(tokens.to(device), targets.to(device))
            report_progress("warmup")
    seconds: dict[str, list[float]] = {name: [] for name in names}
    # Minor page faults of this process during each step: first touches of memory the C
    # allocator mapped afresh (memory handed back to the OS and taken again).
    page_faults: dict[str, list[int]] = {name: [] for name in names}
    losses: dict[str, float] = {}
    step_losses: dict[str, list[float]] = {name: [] for name in names}
    for i, (tokens, targets) in enumerate(data[warmup:]):
        order = names if i % 2 == 0 else tuple(reversed(names))
        for name in order:
            _synchronize(device)
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            loss = engines[name].step(tokens.to(device), targets.to(device))
            _synchronize(device)
            seconds[name].append(time.perf_counter() - start)
            page_faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
            losses[name] = loss.item()
            step_losses[name].append(losses[name])
            report_progress(name)
    reference = parameter_names(fsdp2.model)
    diffs = {name: _max_param_diff(engine, reference) for name, engine in engines.items() if name != "fsdp2"}
    result: dict[str, Any] = {
        "seconds": seconds,
        "page_faults": page_faults,
        "loss": losses,
        "step_losses": step_losses,
        "max_param_diff": diffs["vescale"],
        "max_param_diff_vs_fsdp2": diffs,
        "engines": {},
        "units": vescale_unit_groups(vescale.model),
    }
    tokens, targets = data[-1]
    for name, engine in engines.items():
        result["engines"][name] = {
            "copy_ms_per_step": copy_ms(engine, tokens.to(device), targets.to(device)),
            "sharded_state_bytes": sharded_state_bytes(engine),
            "planner_seconds": engine.planner_seconds,
            **padding_and_traffic(engine, settings, (tokens.to(device), targets.to(device))),
        }
    if record_steps:
        result["record"] = _record_vescale(engines["vescale"], data[:record_steps], device)
    del engines, reference
    for name in names:
        result["engines"][name].update(
            _measure_memory(name, settings, mesh, device, data, units if name == "fsdp2" else None)
        )
        report_progress("memory")
    return result


def launch(
    settings: BenchSettings,
    world: int,
    warmup: int,
    steps: int,
    timeout_s: float,
    on_progress: Callable[[str], None],
    record_steps: int = 0,
) -> list[dict[str, Any]]:
    """Run every rank; return their results, or raise ``RankFailure`` with a failing rank's traceback."""
    return launch_ranks(
        run_rank, world, settings, warmup, steps, record_steps, timeout_s=timeout_s, on_progress=on_progress
    )


def settings_dict(settings: BenchSettings) -> dict[str, Any]:
    d = asdict(settings)
    d["config"] = settings.config.to_dict()
    return d
