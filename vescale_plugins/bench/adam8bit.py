"""``adam8bit``: 8-bit and flat fp32 AdamW, veScale-FSDP + ours against FSDP2 + the peers.

    python -m vescale_plugins.bench adam8bit [--optimizer adamw8bit|adamw|adamw8bit-dtensor|both]
        [--world-size 2] [--model small] [--batch-size 4] [--seq-len 128] [--steps 10]
        [--quality-steps 200]

Pairs, each built on the same model, data and seed, stepped alternately (A B A B ...):

* ``adamw8bit``: veScale-FSDP (``block_size_fn=tile_rows(32)``) + ``vescale_plugins.optim.AdamW8bit``
  against FSDP2 + ``torchao.optim.AdamW8bit`` (block 256 of the flattened local shard),
  stepping FSDP2's local shards (:class:`OnLocalShards`: given the DTensors it fails, which
  ``adamw8bit-dtensor`` shows).
* ``adamw``: veScale-FSDP + ``vescale_plugins.optim.AdamW`` (flat, fused) against FSDP2 +
  ``torch.optim.AdamW(foreach=True)``.

Per engine: optimizer-step time (median over ``--steps`` of the slowest rank's
``optimizer.step()``), peak live tensor bytes of a steady-state training step (allocator
events, smallest of 3; ``vescale_plugins.observe.allocations``), and optimizer state bytes per rank. With
``--quality-steps N`` every optimizer also trains N steps on a learnable synthetic sequence
task (a fixed random token permutation followed 90% of the time) from the same seed and
data; the final loss is the mean of the last 10 steps (``--steps 0``: quality only). Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from vescale_plugins import fully_shard
from vescale_plugins.bench.arguments import count
from vescale_plugins.bench.engines import BenchModel, BenchSettings, _units, batches, build_model
from vescale_plugins.bench.llama import PRESETS, LlamaConfig
from vescale_plugins.observe.allocations import AllocationTracker
from vescale_plugins.optim import AdamW, AdamW8bit, tile_rows
from vescale_plugins.tools.launch import launch_ranks
from vescale_plugins.tools.outputs import write_json

__all__ = ["ENGINES", "add_arguments", "run", "state_bytes"]

LR, WEIGHT_DECAY = 1e-3, 0.1
QUALITY_LR = 3e-3


def _shard(model: BenchModel, vescale: bool, mesh: Any) -> None:
    for unit in _units(model):
        if vescale:
            fully_shard(unit, mesh=mesh, block_size_fn=tile_rows(32))
        else:
            torch_fully_shard(unit, mesh=mesh)


def _torchao_adamw8bit(params: Any, lr: float) -> torch.optim.Optimizer:
    from torchao.optim import AdamW8bit as TorchaoAdamW8bit

    return TorchaoAdamW8bit(params, lr=lr, weight_decay=WEIGHT_DECAY)


class StepOptimizer(Protocol):
    """What the bench asks of an optimizer: a ``torch.optim.Optimizer`` or :class:`OnLocalShards`."""

    state: Any
    param_groups: list[dict[str, Any]]

    def step(self) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


class OnLocalShards:
    """Steps an optimizer on each DTensor parameter's local shard, as a plain tensor.

    torchao 0.18's ``AdamW8bit`` steps each parameter with ``torch.compile(fullgraph=True,
    dynamic=False)``; given FSDP2's DTensor parameters it fails at its first step under torch
    2.13 when shards are uneven across ranks (a size assertion, or ``'Tensor' object has no
    attribute 'codes'`` where a rank holds both 8-bit and fp32-fallback shards: a graph compiled
    for one DTensor appears to be reused for another whose local tensor differs; see
    meta-pytorch/torchtune#1978 for the same class of failure). torchao
    quantizes the flattened local shard anyway, so stepping the shards themselves (as its
    maintainers suggest: unwrap ``_local_tensor``) keeps its blocks, its fp32 fallback rule
    and its state bytes; only its state is plain tensors rather than DTensors (no DCP resharding, unused here).
    """

    def __init__(self, params: Any, make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self.params = list(params)
        self.shards = [getattr(p, "_local_tensor", p) for p in self.params]
        self.inner = make(self.shards)
        self.state, self.param_groups = self.inner.state, self.inner.param_groups

    def step(self) -> None:
        for p, shard in zip(self.params, self.shards):
            if getattr(p, "_local_tensor", p) is not shard:
                raise RuntimeError(
                    "FSDP2 replaced a parameter's local shard: the wrapped optimizer's state would be lost"
                )
            if shard is not p:
                shard.grad = None if p.grad is None else getattr(p.grad, "_local_tensor", p.grad)
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, shard in zip(self.params, self.shards):
            p.grad = shard.grad = None


# name -> (veScale-FSDP?, optimizer factory)
ENGINES: dict[str, tuple[bool, Callable[[Any, float], StepOptimizer]]] = {
    "veScale + AdamW8bit": (True, lambda ps, lr: AdamW8bit(ps, lr=lr, weight_decay=WEIGHT_DECAY)),
    "FSDP2 + torchao AdamW8bit": (
        False,
        lambda ps, lr: OnLocalShards(ps, lambda shards: _torchao_adamw8bit(shards, lr)),
    ),
    "FSDP2 + torchao AdamW8bit on DTensors": (False, _torchao_adamw8bit),
    "veScale + flat AdamW": (True, lambda ps, lr: AdamW(ps, lr=lr, weight_decay=WEIGHT_DECAY)),
    "FSDP2 + AdamW(foreach)": (
        False,
        lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=WEIGHT_DECAY, foreach=True),
    ),
}
PAIRS = {
    "adamw8bit": ("veScale + AdamW8bit", "FSDP2 + torchao AdamW8bit"),
    "adamw": ("veScale + flat AdamW", "FSDP2 + AdamW(foreach)"),
    # torchao given FSDP2's DTensor parameters directly: reports its failure (OnLocalShards).
    "adamw8bit-dtensor": ("veScale + AdamW8bit", "FSDP2 + torchao AdamW8bit on DTensors"),
}


def state_bytes(optimizer: StepOptimizer) -> int:
    """Optimizer state bytes this rank holds (local shards; torchao's codes and scales)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            # A DTensor's local shard, or torchao's quantized tensor (its codes and scales).
            local: Any = getattr(value, "_local_tensor", value)
            parts = [local.codes, local.scale] if hasattr(local, "codes") else [local]
            total += sum(p.numel() * p.element_size() for p in parts)
    return total


def _build(name: str, settings: BenchSettings, mesh: Any, lr: float = LR) -> tuple[BenchModel, StepOptimizer]:
    vescale, make_optimizer = ENGINES[name]
    model = build_model(settings, torch.device("cpu"))
    _shard(model, vescale, mesh)
    return model, make_optimizer(model.parameters(), lr)


def _forward_backward(model: BenchModel, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = model.config.loss(model(tokens), targets)
    loss.backward()
    return loss.detach()


class PeerFailed(RuntimeError):
    """An optimizer step raised on some rank (every rank raises this together)."""


def _agreed_step(optimizer: StepOptimizer) -> None:
    """``optimizer.step()``; if it raises on any rank, every rank raises :class:`PeerFailed`
    (a rank that went on alone would hang in the next collective)."""
    error = ""
    try:
        optimizer.step()
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    failed = torch.tensor([1.0 if error else 0.0])
    dist.all_reduce(failed)
    if failed.item():
        errors: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        raise PeerFailed("; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))


def _timed_step(optimizer: StepOptimizer) -> float:
    dist.barrier()
    start = time.perf_counter()
    _agreed_step(optimizer)
    seconds = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=True)
    return seconds


def _peak_bytes(name: str, settings: BenchSettings, mesh: Any, data: list, repeats: int) -> int:
    peaks = []
    for _ in range(repeats):  # the tracker can only over-count on CPU: keep the smallest
        with AllocationTracker() as tracker:
            model, optimizer = _build(name, settings, mesh)
            _forward_backward(model, *data[0])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with tracker.region("step"):
                _forward_backward(model, *data[min(1, len(data) - 1)])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        del model, optimizer
        peaks.append(tracker.region_memory("step").peak_bytes)
    return min(peaks)


def learnable_batches(settings: BenchSettings, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences where each token is followed by ``perm[token]`` 90% of the time (else a
    uniform token): a task the model can learn, so optimizers' losses separate."""
    assert isinstance(settings.config, LlamaConfig)  # this bench trains the decoder (PRESETS)
    vocab = settings.config.vocab_size
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(settings.seed))
    g = torch.Generator().manual_seed(settings.seed * 1000 + rank + 17)
    seqs = torch.empty(count, settings.batch_size, settings.seq_len + 1, dtype=torch.long)
    seqs[..., 0] = torch.randint(0, vocab, (count, settings.batch_size), generator=g)
    for i in range(1, settings.seq_len + 1):
        follow = torch.rand(count, settings.batch_size, generator=g) < 0.9
        seqs[..., i] = torch.where(
            follow, perm[seqs[..., i - 1]], torch.randint(0, vocab, (count, settings.batch_size), generator=g)
        )
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def _quality_engines(pairs: list[str]) -> list[str]:
    """fp32 flat AdamW (the baseline) first, then every engine of the selected pairs."""
    names = ["veScale + flat AdamW"]
    for pair in pairs:
        names += [name for name in PAIRS[pair] if name not in names]
    return names


def run_rank(
    settings: BenchSettings, pairs: list[str], warmup: int, steps: int, quality_steps: int, memory_repeats: int = 3
) -> dict[str, Any]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    data = batches(settings, dist.get_rank(), warmup + steps)
    result: dict[str, Any] = {}
    for pair in pairs if steps else []:
        names = PAIRS[pair]
        built = {name: _build(name, settings, mesh) for name in names}
        seconds: dict[str, list[float]] = {name: [] for name in names}
        failures: dict[str, str] = {}
        for index, (tokens, targets) in enumerate(data):
            order = names if index % 2 == 0 else names[::-1]
            for name in order:
                if name in failures:
                    continue
                model, optimizer = built[name]
                _forward_backward(model, tokens, targets)
                try:
                    elapsed = _timed_step(optimizer)
                except PeerFailed as exc:
                    failures[name] = f"failed at step {index}: {exc}"
                    continue
                if index >= warmup:
                    seconds[name].append(elapsed)
        for name, failure in failures.items():
            result[name] = {"failed": failure}
        for name in [n for n in names if n not in failures]:
            slowest = torch.tensor(seconds[name], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            result[name] = {
                "optimizer_step_s": statistics.median(slowest.tolist()),
                "state_bytes": state_bytes(built[name][1]),
                "parameter_elements": sum(getattr(p, "_local_tensor", p).numel() for p in built[name][0].parameters()),
            }
        del built
        for name in [n for n in names if n not in failures]:
            result[name]["peak_bytes"] = _peak_bytes(name, settings, mesh, data, memory_repeats)
    if quality_steps:
        quality_data = learnable_batches(settings, dist.get_rank(), quality_steps)
        for name in _quality_engines(pairs):
            model, optimizer = _build(name, settings, mesh, lr=QUALITY_LR)
            losses = []
            try:
                for tokens, targets in quality_data:
                    losses.append(_forward_backward(model, tokens, targets))
                    _agreed_step(optimizer)
                    optimizer.zero_grad(set_to_none=True)
            except PeerFailed as exc:
                result.setdefault(name, {})["quality_failed"] = f"failed at step {len(losses) - 1}: {exc}"
                del model, optimizer
                continue
            del model, optimizer
            mean_loss = torch.stack(losses).double()
            dist.all_reduce(mean_loss)
            mean_loss /= world
            result.setdefault(name, {})["quality_final_loss"] = mean_loss[-10:].mean().item()
            result[name]["quality_first_loss"] = mean_loss[0].item()
    return result


def _seeded_rank(
    settings: BenchSettings, pairs: list[str], warmup: int, steps: int, quality_steps: int, memory_repeats: int
) -> dict[str, Any]:
    torch.manual_seed(settings.seed)
    return run_rank(settings, pairs, warmup, steps, quality_steps, memory_repeats)


def _merge(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's figures, with memory and state bytes the largest rank's (times are already the
    slowest rank's)."""
    merged = {name: dict(figures) for name, figures in ranks[0].items()}
    for name, figures in merged.items():
        for key in ("peak_bytes", "state_bytes", "parameter_elements"):
            if key in figures:
                figures[key] = max(r[name][key] for r in ranks if key in r.get(name, {}))
    return merged


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a is not None and b else "-"


def render(results: dict[str, Any], pairs: list[str]) -> str:
    lines = []
    for pair in pairs:
        ours, peer = PAIRS[pair]
        o, p = results.get(ours, {}), results.get(peer, {})
        if not any(key in figures for figures in (o, p) for key in ("failed", "optimizer_step_s")):
            continue  # quality only
        failed = [f"{name}: {results[name]['failed']}" for name in (ours, peer) if "failed" in results[name]]
        if failed:
            lines += [f"{pair}: " + " | ".join(failed)]
            for name in (ours, peer):
                if "failed" not in results[name]:
                    figures = results[name]
                    lines.append(
                        f"  {name}: optimizer step {figures['optimizer_step_s'] * 1e3:.3f} ms, peak {figures['peak_bytes'] / 2**20:.3f} MiB, state {figures['state_bytes'] / 2**20:.3f} MiB ({figures['state_bytes'] / figures['parameter_elements']:.3f} bytes per element)"
                    )
            lines.append("")
            continue
        lines.append(f"{'figure':<34} {peer:>26} {ours:>22} {'ours / peer':>12}")
        rows = [
            ("optimizer step, median (ms)", o["optimizer_step_s"] * 1e3, p["optimizer_step_s"] * 1e3),
            ("peak tensor memory (MiB)", o["peak_bytes"] / 2**20, p["peak_bytes"] / 2**20),
            ("optimizer state per rank (MiB)", o["state_bytes"] / 2**20, p["state_bytes"] / 2**20),
            (
                "state bytes per parameter element",
                o["state_bytes"] / o["parameter_elements"],
                p["state_bytes"] / p["parameter_elements"],
            ),
        ]
        for label, ov, pv in rows:
            lines.append(f"{label:<34} {pv:>26.3f} {ov:>22.3f} {_ratio(ov, pv):>12}")
        lines.append("")
    if "quality_final_loss" in results.get("veScale + flat AdamW", {}):
        base = results["veScale + flat AdamW"]["quality_final_loss"]
        lines.append("quality (learnable synthetic task, final loss = mean of the last 10 steps):")
        for name in _quality_engines(pairs):
            if "quality_final_loss" not in results.get(name, {}):
                lines.append(f"  {name:<28} {results.get(name, {}).get('quality_failed', 'not run')}")
                continue
            loss = results[name]["quality_final_loss"]
            lines.append(
                f"  {name:<28} first {results[name]['quality_first_loss']:.4f}  final {loss:.4f}  vs fp32 AdamW {loss / base - 1:+.2%}"
            )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--optimizer", choices=[*PAIRS, "both"], default="both", help="both: adamw8bit and adamw")
    parser.add_argument("--world-size", type=count(1), default=2)
    parser.add_argument("--model", choices=sorted(PRESETS), default="small")
    parser.add_argument("--batch-size", type=count(1), default=4)
    parser.add_argument("--seq-len", type=count(1), default=128)
    parser.add_argument("--warmup", type=count(0), default=2)
    parser.add_argument("--steps", type=count(0), default=10, help="timed optimizer steps per engine")
    parser.add_argument(
        "--quality-steps",
        type=count(0),
        default=0,
        help="also train this many steps per optimizer and compare final losses",
    )
    parser.add_argument(
        "--memory-repeats", type=count(1), default=3, help="peak-memory measurements per engine (the smallest is kept)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before every rank is stopped")
    parser.add_argument("--json", default="", help="write every figure here")


def run(args: argparse.Namespace) -> int:
    settings = BenchSettings(PRESETS[args.model], args.batch_size, args.seq_len, False, None, None, "plain", args.seed)
    pairs = ["adamw8bit", "adamw"] if args.optimizer == "both" else [args.optimizer]
    ranks = launch_ranks(
        _seeded_rank,
        args.world_size,
        settings,
        pairs,
        args.warmup,
        args.steps,
        args.quality_steps,
        args.memory_repeats,
        timeout_s=args.timeout,
        backend="gloo",
        threads=1,
    )
    results = _merge(ranks)
    print(f"W={args.world_size} gloo ranks on CPU, model {args.model}, batch {args.batch_size} x {args.seq_len}")
    print(render(results, pairs))
    if args.json:
        write_json(args.json, {"arguments": vars(args), "results": results})
    return 0
