"""``muon``: distributed Muon against FSDP2's full_tensor() workaround.

Both engines train the same Llama-style model from the same seed on the same batches, with
one Muon optimizer each (hidden matrices under Muon, the rest under AdamW,
``muon_param_groups``):

- ``vescale``: ``vescale_plugins.fully_shard`` + ``vescale_plugins.optim.Muon``: each matrix
  goes to its root rank (two bfloat16 all-to-alls per bucket), is orthogonalised there once,
  and comes back as the ranks' shards.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` + the common workaround: every rank
  ``full_tensor()``s every matrix's update (an all-gather), runs Newton–Schulz on all of
  them, and keeps its own rows.

Steps alternate between the engines (A B, then B A); each step is timed between barriers,
the optimizer step separately, and a step's time is the slowest rank's. Figures per step and
rank: bytes the optimizer sends to other ranks, and Newton–Schulz flops. Prints a table per
world size and writes JSON.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from vescale_plugins import fully_shard
from vescale_plugins.bench.arguments import count
from vescale_plugins.bench.engines import ENGINES, BenchSettings, _shard_plain, batches, build_model, parameter_names
from vescale_plugins.bench.llama import PRESETS
from vescale_plugins.bench.report import environment, parity_line
from vescale_plugins.optim import Muon, muon_param_groups
from vescale_plugins.optim.muon import adjust_lr
from vescale_plugins.optim.newton_schulz import newton_schulz_for
from vescale_plugins.optim.root_assignment import newton_schulz_flops
from vescale_plugins.tools.launch import launch_ranks, report_progress

if TYPE_CHECKING:
    from rich.text import JustifyMethod
from vescale_plugins.tools.outputs import write_results

__all__ = ["add_arguments", "run"]

MUON_LR, ADAMW_LR = 0.02, 1e-3


class FullTensorMuon(Muon):
    """The FSDP2 workaround: every rank gathers every matrix and orthogonalises all of them.

    Same math as :class:`Muon` (momentum on the local rows, Newton–Schulz in bfloat16 on the
    full matrix, decoupled weight decay); the update is gathered in the gradient's dtype,
    as ``full_tensor()`` of the Nesterov update gives it.
    """

    @staticmethod
    def _check_sharding(p: DTensor, name: str) -> None:
        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"{name}: the workaround expects FSDP2's Shard(0), got {p.placements}")

    def _build_plan(self) -> None:
        self._plan_key, self._slot_of, self._plan = self._muon_params_key(), {}, None

    def _muon_local_step(self, group: dict, pending: dict) -> None:
        lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
        world, rank = dist.get_world_size(), dist.get_rank()
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            grad, buf, param = p.grad._local_tensor, state["momentum_buffer"]._local_tensor, p._local_tensor
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if group["nesterov"] else buf
            full = DTensor.from_local(
                update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            ).full_tensor()
            orthogonal = newton_schulz_for(full.device)(full, group["ns_coefficients"], group["ns_steps"], group["eps"])
            rows_per_rank = math.ceil(p.shape[0] / world)  # torch.chunk, as FSDP2 shards dim 0
            start = min(rank * rows_per_rank, p.shape[0])
            mine = orthogonal[start : start + param.shape[0]]
            param.mul_(1 - lr * weight_decay)
            param.add_(mine, alpha=-adjust_lr(lr, group["adjust_lr_fn"], p.shape))


def _muon_shapes(optimizer: Muon) -> list[tuple[int, int]]:
    return [tuple(p.shape) for g in optimizer.param_groups if g["algorithm"] == "muon" for p in g["params"]]


def _traffic_and_flops(name: str, optimizer: Muon, world: int, rank: int) -> dict[str, int]:
    """Bytes this rank's optimizer step sends to other ranks, and its Newton–Schulz flops."""
    shapes = _muon_shapes(optimizer)
    if name == "vescale":
        plan = optimizer.exchange_plan
        assert plan is not None  # veScale-FSDP shards the model's matrices
        return {
            "optimizer_bytes_sent": plan.bytes_sent(rank),
            "ns_flops": plan.ns_flops_per_rank[rank],
            "buckets": len(plan.buckets),
        }
    # full_tensor(): an all-gather of the fp32 update, padded rows (torch.chunk); each rank's
    # chunk reaches the W - 1 others.
    sent = sum((world - 1) * math.ceil(m / world) * n * 4 for m, n in shapes)
    return {"optimizer_bytes_sent": sent, "ns_flops": sum(newton_schulz_flops(s) for s in shapes), "buckets": 0}


def _build(name: str, settings: BenchSettings, mesh: Any, device: torch.device) -> tuple[torch.nn.Module, Muon]:
    model = build_model(settings, device)
    _shard_plain(model, settings, mesh, torch_fully_shard if name == "fsdp2" else fully_shard)
    groups = muon_param_groups(model, adamw_lr=ADAMW_LR)
    optimizer = (FullTensorMuon if name == "fsdp2" else Muon)(groups, lr=MUON_LR)
    return model, optimizer


def run_rank(settings: BenchSettings, warmup: int, steps: int) -> dict[str, Any]:
    """Both engines' steps on this rank (progress reported per step); returns plain data."""
    device = torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (world,))
    data = batches(settings, rank, warmup + steps)
    engines = {name: _build(name, settings, mesh, device) for name in ENGINES}

    def one_step(name: str, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
        model, optimizer = engines[name]
        dist.barrier()
        start = time.perf_counter()
        loss = settings.config.loss(model(tokens), targets)
        loss.backward()
        dist.barrier()
        before_step = time.perf_counter()
        optimizer.step()
        dist.barrier()
        end = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        return end - start, end - before_step, loss.item()

    for tokens, targets in data[:warmup]:
        for name in ENGINES:
            one_step(name, tokens, targets)
            report_progress("warmup")
    seconds: dict[str, dict[str, list[float]]] = {name: {"step": [], "optimizer": []} for name in ENGINES}
    losses: dict[str, float] = {}
    for i, (tokens, targets) in enumerate(data[warmup:]):
        for name in ENGINES if i % 2 == 0 else tuple(reversed(ENGINES)):
            whole, optimizer_s, losses[name] = one_step(name, tokens, targets)
            seconds[name]["step"].append(whole)
            seconds[name]["optimizer"].append(optimizer_s)
            report_progress(name)
    params = {name: parameter_names(engines[name][0]) for name in ENGINES}
    max_diff = max(
        (cast(DTensor, params["vescale"][k]).full_tensor() - cast(DTensor, params["fsdp2"][k]).full_tensor())
        .abs()
        .max()
        .item()
        for k in params["fsdp2"]
    )
    figures = {name: _traffic_and_flops(name, engines[name][1], world, rank) for name in ENGINES}
    return {
        "seconds": seconds,
        "loss": losses,
        "max_param_diff": max_diff,
        "figures": figures,
        "muon_matrices": len(_muon_shapes(engines["vescale"][1])),
    }


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the slowest rank's times (ms), the largest per-rank figures, and the ratios."""
    engines: dict[str, dict[str, Any]] = {}
    for name in ENGINES:
        entry: dict[str, Any] = {}
        for kind in ("step", "optimizer"):
            per_step = [
                max(r["seconds"][name][kind][i] for r in results) * 1e3
                for i in range(len(results[0]["seconds"][name][kind]))
            ]
            entry[f"{kind}_ms"] = {"median": statistics.median(per_step), "samples": per_step}
        for key in results[0]["figures"][name]:
            entry[key] = max(r["figures"][name][key] for r in results)
        engines[name] = entry
    v, f = engines["vescale"], engines["fsdp2"]

    def paired(kind: str) -> float:
        return statistics.median(a / b for a, b in zip(v[f"{kind}_ms"]["samples"], f[f"{kind}_ms"]["samples"]))

    return {
        "engines": engines,
        "muon_matrices": results[0]["muon_matrices"],
        "ratios": {
            "optimizer_step": v["optimizer_ms"]["median"] / f["optimizer_ms"]["median"],
            "optimizer_step_paired": paired("optimizer"),
            "whole_step": v["step_ms"]["median"] / f["step_ms"]["median"],
            "whole_step_paired": paired("step"),
            "optimizer_bytes_sent": v["optimizer_bytes_sent"] / f["optimizer_bytes_sent"],
            "ns_flops_per_rank": v["ns_flops"] / f["ns_flops"],
        },
        "parity": {
            "loss": {name: results[0]["loss"][name] for name in ENGINES},
            "max_param_diff": max(r["max_param_diff"] for r in results),
        },
    }


def render_table(summary: dict[str, Any], world: int) -> Any:
    from rich.table import Table

    e, r = summary["engines"], summary["ratios"]
    table = Table(
        title=f"Muon at W={world}: veScale-FSDP + distributed Muon vs FSDP2 + full_tensor() ({summary['muon_matrices']} matrices)"
    )
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("figure", "left"),
        ("FSDP2 + full_tensor", "right"),
        ("veScale-FSDP + Muon", "right"),
        ("veScale / FSDP2", "right"),
    )
    for column, justify in columns:
        table.add_column(column, justify=justify)

    def row(label: str, key: Callable[[dict], float], fmt: str, ratio: float | None) -> None:
        table.add_row(
            label, format(key(e["fsdp2"]), fmt), format(key(e["vescale"]), fmt), "" if ratio is None else f"{ratio:.3f}"
        )

    row("optimizer step, median (ms)", lambda x: x["optimizer_ms"]["median"], ".1f", r["optimizer_step"])
    table.add_row("optimizer step, median of paired ratios", "", "", f"{r['optimizer_step_paired']:.3f}")
    row("whole step, median (ms)", lambda x: x["step_ms"]["median"], ".1f", r["whole_step"])
    table.add_row("whole step, median of paired ratios", "", "", f"{r['whole_step_paired']:.3f}")
    row(
        "optimizer bytes sent per rank and step (MiB)",
        lambda x: x["optimizer_bytes_sent"] / 2**20,
        ".2f",
        r["optimizer_bytes_sent"],
    )
    row("Newton–Schulz GFLOP per rank and step (max)", lambda x: x["ns_flops"] / 1e9, ".2f", r["ns_flops_per_rank"])
    table.add_row("all-to-all buckets", "-", str(e["vescale"]["buckets"]), "")
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        choices=sorted(PRESETS),
        help="a preset (default tiny: Newton–Schulz runs in bfloat16, which is slow on CPUs without bf16 units)",
    )
    parser.add_argument("--world-sizes", type=count(1), nargs="+", default=[2, 4])
    parser.add_argument("--batch-size", type=count(1), default=4)
    parser.add_argument("--seq-len", type=count(1), default=128)
    parser.add_argument("--warmup", type=count(0), default=2)
    parser.add_argument("--steps", type=count(1), default=10, help="timed steps per engine (interleaved)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds per world size before every rank is stopped"
    )
    parser.add_argument("--json", default="bench_muon.json")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=max(Console().width, 110))  # the table's labels on one line
    settings = BenchSettings(PRESETS[args.model], args.batch_size, args.seq_len, False, None, None, "plain", args.seed)
    record: dict[str, Any] = {"settings": {**vars(args), "config": settings.config.to_dict()}, "runs": {}}
    for world in args.world_sizes:
        console.print(
            f"{args.model} on {world} gloo ranks: {args.warmup} warm-up + {args.steps} timed steps per engine"
        )
        try:
            results = launch_ranks(
                run_rank, world, settings, args.warmup, args.steps, timeout_s=args.timeout, backend="gloo"
            )
        except RuntimeError as error:
            console.print(f"[red]benchmark failed at W={world}, no ratios reported:[/red] {error}")
            return 1
        summary = summarize(results)
        console.print(render_table(summary, world))
        console.print(parity_line(summary))
        record["runs"][str(world)] = {"environment": environment(world), "summary": summary, "ranks": results}
    write_results(console.print, record, args.json)
    return 0
