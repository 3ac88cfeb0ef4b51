"""``host``: the host work of a training step, ours against FSDP2's and the unsharded model's.

    python -m vescale_plugins.bench host [--configs 1:fp32 2:fp32 2:bf16 1024:fp32 ...]
        [--models llama-tiny llama-wide stack-10 stack-100] [--optimizer adamw|fused|flat]
        [--peers megatron-fsdp,megatron-fsdp-v2]

Each configuration (world size and dtype) runs in fresh processes (``host_run``): W=1 and W=2
on gloo, larger W as rank 0 of torch's fake process group. In each, the same model unsharded
(the floor no engine can go under: what the model's own ops cost the host), under FSDP2 and
under ours take interleaved steps; per phase (forward, backward, ``clip_grad_norm_``, the
optimizer step, ``zero_grad``) it records main-thread CPU ms, Python calls, ATen ops, DTensor
dispatches and page faults. Prints a table per model, the ratios the README quotes, and writes
JSON and a plot. glibc's heap is kept (as scale's: a caching allocator's behaviour), so page
faults count what an engine touches anew, not what glibc returns to the kernel. ``--peers``
adds Megatron-FSDP 1 and 2 where they run (fp32 on gloo: version 2 at W <= 2, version 1 at W=1,
:func:`peers_that_run`), with a table of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

import torch

from vescale_plugins.bench.host_run import MODELS, PEERS, PHASES
from vescale_plugins.bench.scale import _KEEP_HEAP
from vescale_plugins.tools.outputs import pyplot, write_results

__all__ = ["add_arguments", "run", "summarise"]

_DEFAULT_CONFIGS = ["1:fp32", "1:bf16", "2:fp32", "2:bf16", "8:fp32", "1024:fp32", "1024:bf16"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--configs", nargs="+", default=_DEFAULT_CONFIGS, help="WORLD:DTYPE (fp32, bf16); W > 2 on the fake group"
    )
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["llama-tiny", "llama-wide"])
    parser.add_argument("--optimizer", choices=["adamw", "fused", "flat"], default="adamw")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: W=1 only, over NCCL")
    parser.add_argument(
        "--peers",
        type=_peer_list,
        default=(),
        metavar="NAMES",
        help=f"comma-separated, from {', '.join(PEERS)}: also measured where they run (fp32 on gloo, W <= 2; version 1 W=1)",
    )
    parser.add_argument("--steps", type=int, default=7, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default="bench_host.json")
    parser.add_argument("--plot", default="bench_host.png", help="'' for none")


def _peer_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer {unknown[0]!r}: choose from {', '.join(PEERS)}")
    return names


def peers_that_run(peers: tuple[str, ...], world: int, dtype: str, device: str) -> tuple[str, ...]:
    """The ``peers`` that run in this configuration: fp32 on gloo (host_run's docstring), and
    Megatron-FSDP 1 at W=1 only: at W=2 torch's ``clip_grad_norm_`` over its gradients stops on
    a gloo collective mismatch (its step without clipping runs)."""
    if dtype != "fp32" or device != "cpu":
        return ()
    return tuple(peer for peer in peers if world == 1 or (world == 2 and peer != "megatron-fsdp"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(
    world: int,
    model: str,
    dtype: str,
    optimizer: str,
    steps: int,
    warmup: int,
    timeout: float,
    device: str = "cpu",
    peers: tuple[str, ...] = (),
) -> dict:
    """One configuration: ``world`` gloo (NCCL on ``cuda``) processes for W <= 2, else one on
    the fake group; ``peers`` measured too."""
    fake = world > 2
    ranks = 1 if fake else world
    env = {**os.environ, **_KEEP_HEAP, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    command = [sys.executable, "-m", "vescale_plugins.bench.host_run", str(world), model, dtype, optimizer]
    command += [str(steps), str(warmup), "fake" if fake else "gloo", device, ",".join(peers)]
    processes = [
        subprocess.Popen(
            command, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in range(ranks)
    ]
    outputs = []
    try:
        for p in processes:
            outputs.append(p.communicate(timeout=timeout))
    finally:
        for p in processes:
            p.kill()
    failed = [(r, err) for r, (p, (_, err)) in enumerate(zip(processes, outputs)) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"bench host {model} W={world} {dtype}: rank {failed[0][0]} failed:\n{failed[0][1][-4000:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def summarise(result: dict) -> dict[str, float]:
    """The ratios the issue's targets are stated in, from one configuration's result."""
    engines = result["engines"]

    def total(engine: str, metric: str, phases: tuple[str, ...] = PHASES) -> float:
        return sum(engines[engine][p][metric] for p in phases)

    def own(engine: str, metric: str, phases: tuple[str, ...] = PHASES) -> float:
        return total(engine, metric, phases) - total("unsharded", metric, phases)

    forward_backward = ("forward", "backward")
    ratios = {
        "cpu_ms_ours": total("vescale", "cpu_ms"),
        "cpu_ms_fsdp2": total("fsdp2", "cpu_ms"),
        "cpu_ms_unsharded": total("unsharded", "cpu_ms"),
        "cpu_ratio": total("vescale", "cpu_ms") / total("fsdp2", "cpu_ms"),
        "own_cpu_ratio": own("vescale", "cpu_ms") / own("fsdp2", "cpu_ms"),
        "own_fb_calls_ratio": own("vescale", "python_calls", forward_backward)
        / own("fsdp2", "python_calls", forward_backward),
        "own_calls_ours": own("vescale", "python_calls"),
        "own_calls_fsdp2": own("fsdp2", "python_calls"),
        "own_ops_ours": own("vescale", "aten_ops"),
        "own_ops_fsdp2": own("fsdp2", "aten_ops"),
        "page_faults_ours": total("vescale", "page_faults"),
        "page_faults_fsdp2": total("fsdp2", "page_faults"),
    }
    for phase in ("clip", "step"):
        ratios[f"{phase}_cpu_ratio"] = engines["vescale"][phase]["cpu_ms"] / engines["fsdp2"][phase]["cpu_ms"]
    for peer in (name for name in PEERS if name in engines):
        ratios[f"cpu_ms_{peer}"] = total(peer, "cpu_ms")
        ratios[f"cpu_ratio_vs_{peer}"] = total("vescale", "cpu_ms") / total(peer, "cpu_ms")
        ratios[f"own_cpu_ratio_vs_{peer}"] = own("vescale", "cpu_ms") / own(peer, "cpu_ms")
        ratios[f"own_calls_{peer}"] = own(peer, "python_calls")
        ratios[f"own_ops_{peer}"] = own(peer, "aten_ops")
        ratios[f"dtensor_ops_{peer}"] = total(peer, "dtensor_ops")
    return ratios


def _table(results: list[dict]) -> str:
    header = (
        "| model | W | dtype | CPU ms/step unsharded / FSDP2 / ours | ours/FSDP2 | own CPU ours/FSDP2 "
        "| own Python calls fwd+bwd ours/FSDP2 | clip ours/FSDP2 | step ours/FSDP2 | page faults FSDP2 / ours |"
    )
    lines = [header, "|" + "---|" * 10]
    for r in results:
        s = r["summary"]
        lines.append(
            f"| {r['model']} ({r['parameters']} params, {r['units']} units) | {r['world_size']} | {r['dtype']} "
            f"| {s['cpu_ms_unsharded']:.1f} / {s['cpu_ms_fsdp2']:.1f} / {s['cpu_ms_ours']:.1f} | {s['cpu_ratio']:.2f} "
            f"| {s['own_cpu_ratio']:.2f} | {s['own_fb_calls_ratio']:.2f} | {s['clip_cpu_ratio']:.2f} "
            f"| {s['step_cpu_ratio']:.2f} | {s['page_faults_fsdp2']:.0f} / {s['page_faults_ours']:.0f} |"
        )
    return "\n".join(lines)


def _peer_table(results: list[dict]) -> str:
    """Each peer beside ours where it ran: CPU per step, its own work above the unsharded
    model, Python calls and ATen ops of its own, DTensor dispatches."""
    lines = [
        "| model | W | peer | CPU ms/step peer / ours | ours/peer | own CPU ours/peer "
        "| own Python calls peer / ours | own ATen ops peer / ours |",
        "|" + "---|" * 8,
    ]
    for r in results:
        s = r["summary"]
        for peer in (name for name in PEERS if f"cpu_ms_{name}" in s):
            lines.append(
                f"| {r['model']} | {r['world_size']} | {peer} | {s[f'cpu_ms_{peer}']:.1f} / {s['cpu_ms_ours']:.1f} "
                f"| {s[f'cpu_ratio_vs_{peer}']:.2f} | {s[f'own_cpu_ratio_vs_{peer}']:.2f} "
                f"| {s[f'own_calls_{peer}']:.0f} / {s['own_calls_ours']:.0f} "
                f"| {s[f'own_ops_{peer}']:.0f} / {s['own_ops_ours']:.0f} |"
            )
    return "\n".join(lines) if len(lines) > 2 else ""


def _plot(results: list[dict], path: str) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(1, len(PHASES), figsize=(4 * len(PHASES), 3.5), sharey=False)
    labels = [f"{r['model']}\nW={r['world_size']} {r['dtype']}" for r in results]
    for axis, phase in zip(axes, PHASES):
        for offset, engine in enumerate(("unsharded", "fsdp2", "vescale")):
            values = [r["engines"][engine][phase]["cpu_ms"] for r in results]
            axis.bar([i + 0.27 * (offset - 1) for i in range(len(results))], values, width=0.27, label=engine)
        axis.set_title(phase)
        axis.set_xticks(range(len(results)), labels, rotation=90, fontsize=6)
        axis.set_ylabel("main-thread CPU ms")
    axes[0].legend(fontsize=7)
    figure.suptitle(f"host work per step, torch {torch.__version__}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    results = []
    for model in args.models:
        for config in args.configs:
            world, dtype = config.split(":")
            peers = peers_that_run(args.peers, int(world), dtype, args.device)
            result = measure(
                int(world), model, dtype, args.optimizer, args.steps, args.warmup, args.timeout, args.device, peers
            )
            result["summary"] = summarise(result)
            results.append(result)
            print(f"  {model} W={world} {dtype}: ours/FSDP2 {result['summary']['cpu_ratio']:.2f}", flush=True)
    print(f"\nbench host on torch {torch.__version__}, optimizer {args.optimizer} (foreach unless named), clipping 1.0")
    print(_table(results))
    peer_table = _peer_table(results)
    if peer_table:
        print(f"\nthe peers where they run (fp32, gloo):\n{peer_table}")
    record = {"torch": torch.__version__, "optimizer": args.optimizer, "results": results}
    write_results(print, record, args.json, args.plot, lambda path: _plot(results, path))
    return 0
