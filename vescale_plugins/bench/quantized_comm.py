"""``--comm int8[,int8-grads]``: veScale-FSDP with quantized collectives beside its exact run
and FSDP2, in one process per rank, steps interleaved.

Per engine: step time (median of the slowest rank's), the loss after every step (its mean
over ranks), and for veScale-FSDP's runs the bytes each rank's all-gathers and gradient
reductions move per step, read from the run record's collective log. ``int8``: weights
gathered as int8 blocks; ``int8-grads``: gradients reduced as int8 blocks too
(:class:`vescale_plugins.QuantizedComm`).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from vescale_plugins.bench.engines import COMM_POLICIES, BenchSettings, batches, build_engine
from vescale_plugins.tools.launch import launch_ranks, report_progress
from vescale_plugins.tools.outputs import pyplot, write_results

__all__ = ["comm_list", "run", "run_rank"]


def comm_list(text: str) -> tuple[str, ...]:
    """``--comm``: a comma-separated list of quantized runs (``int8``, ``int8-grads``)."""
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in COMM_POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown --comm {unknown[0] if unknown else text!r}: choose from {', '.join(COMM_POLICIES)}"
        )
    return names


def _record(engine: Any, data: list, device: torch.device) -> dict[str, float]:
    """Bytes per step of each collective kind, from the run record of a few more steps."""
    from vescale_plugins.observe.record import record_run

    with record_run(engine.model, engine.optimizer) as record:
        for tokens, targets in data:
            engine.step(tokens.to(device), targets.to(device))
            record.mark_step()
    summary = record.to_dict()["communication"]["summary"]
    return {kind: summary[kind]["bytes_per_step"] for kind in ("all_gather", "reduce_scatter")}


def run_rank(settings: BenchSettings, comms: tuple[str, ...], warmup: int, steps: int) -> dict[str, Any]:
    """Every engine's step times, losses and (veScale-FSDP's) bytes per step on this rank."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = settings.mesh(device.type, dist.get_world_size())
    data = batches(settings, dist.get_rank(), warmup + steps)
    engines = {"fsdp2": build_engine("fsdp2", settings, mesh, device)}
    engines["vescale"] = build_engine("vescale", settings, mesh, device)
    for comm in comms:
        engines[f"vescale-{comm}"] = build_engine("vescale", dataclasses.replace(settings, comm=comm), mesh, device)
    names = tuple(engines)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[float]] = {name: [] for name in names}
    for i, (tokens, targets) in enumerate(data):
        for name in names if i % 2 == 0 else tuple(reversed(names)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = engines[name].step(tokens.to(device), targets.to(device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                seconds[name].append(time.perf_counter() - start)
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses[name].append(total.item() / dist.get_world_size())
            report_progress(name)
    traffic = {name: _record(engines[name], data[:2], device) for name in names if name != "fsdp2"}
    return {"seconds": seconds, "losses": losses, "bytes_per_step": traffic}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per engine: the median step (slowest rank per step), final loss and its differences
    from the exact run and FSDP2, bytes per step and their ratios to the exact run."""
    first = results[0]
    names = list(first["seconds"])
    engines: dict[str, Any] = {}
    for name in names:
        steps = [max(r["seconds"][name][i] for r in results) for i in range(len(first["seconds"][name]))]
        engines[name] = {
            "step_ms": statistics.median(steps) * 1e3,
            "final_loss": first["losses"][name][-1],
            "losses": first["losses"][name],
            "bytes_per_step": first["bytes_per_step"].get(name),
        }
    exact, fsdp2 = engines["vescale"], engines["fsdp2"]
    for e in engines.values():
        e["step_time_vs_exact"] = e["step_ms"] / exact["step_ms"]
        e["loss_vs_exact"] = e["final_loss"] / exact["final_loss"] - 1
        e["loss_vs_fsdp2"] = e["final_loss"] / fsdp2["final_loss"] - 1
        if e["bytes_per_step"] is not None:
            e["bytes_vs_exact"] = {
                kind: value / exact["bytes_per_step"][kind] if exact["bytes_per_step"][kind] else None
                for kind, value in e["bytes_per_step"].items()
            }
    return {"engines": engines}


def _table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="quantized collectives beside the exact run (bytes: per rank per step, run record)")
    for column in ("engine", "step ms", "vs exact", "all-gather MiB", "vs exact", "reduce MiB", "vs exact"):
        table.add_column(column, justify="right")
    table.add_column("final loss", justify="right")
    table.add_column("vs exact", justify="right")
    table.add_column("vs FSDP2", justify="right")
    for name, e in summary["engines"].items():
        traffic = e["bytes_per_step"] or {}
        ratios = e.get("bytes_vs_exact", {})

        def mib(kind: str, traffic: dict = traffic) -> str:
            return f"{traffic[kind] / 2**20:.2f}" if kind in traffic else "-"

        def ratio(kind: str, ratios: dict = ratios) -> str:
            return f"{ratios[kind]:.3f}" if ratios.get(kind) is not None else "-"

        table.add_row(
            name,
            f"{e['step_ms']:.1f}",
            f"{e['step_time_vs_exact']:.3f}",
            mib("all_gather"),
            ratio("all_gather"),
            mib("reduce_scatter"),
            ratio("reduce_scatter"),
            f"{e['final_loss']:.5f}",
            f"{e['loss_vs_exact']:+.3%}",
            f"{e['loss_vs_fsdp2']:+.3%}",
        )
    return table


def _plot(path: str, summary: dict[str, Any]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, e in summary["engines"].items():
        ax.plot(e["losses"], label=f"{name} (final {e['final_loss']:.4f})", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title("loss curves: quantized collectives against exact and FSDP2")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace, settings: BenchSettings, world: int) -> int:
    """The quantized runs beside the exact one; table, JSON and loss plot."""
    from rich.console import Console
    from rich.progress import Progress

    console = Console(width=max(Console().width, 150))  # the table's eleven columns
    if settings.frontend != "plain":
        raise SystemExit("--comm runs with --frontend plain (the front ends pass comm_policy through; see docs)")
    if "deepspeed" in settings.engines:
        raise SystemExit("--comm runs with --engines fsdp2,vescale")
    engines = 2 + len(args.comm)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"{engines} engines on {world} ranks", total=engines * (args.warmup + args.steps))
        try:
            results = launch_ranks(
                run_rank,
                world,
                settings,
                args.comm,
                args.warmup,
                args.steps,
                timeout_s=args.timeout,
                on_progress=lambda _: progress.update(task, advance=1),
            )
        except RuntimeError as error:
            console.print(f"[red]benchmark failed:[/red] {error}")
            return 1
    summary = summarize(results)
    console.print(_table(summary))
    record = {"settings": dataclasses.asdict(settings) | {"config": settings.config.to_dict()}, "summary": summary}
    write_results(console.print, record, args.json, args.plot, lambda path: _plot(path, summary))
    return 0
