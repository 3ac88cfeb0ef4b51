"""One engine at one world size on torch's fake process group, in this process (``bench scale``).

This process plays rank 0 of a W-rank job: collectives move no data, so what is measured is
the engine's own work per rank. The model is built on the meta device, sharded, and
materialised on the CPU with ``to_empty`` (only the local shards exist). Measured:

- set-up: thread CPU time of each ``fully_shard`` call;
- padding: the share of the per-rank sharded storage (the same on every rank for both
  engines) that holds no parameter, and the sharded bytes per rank;
- per training step (AdamW): aten ops by name and collectives (a dispatch mode counts them),
  the ops under each profiler region (``vescale::*``, ``FSDP::*``), and *host time*: the
  step's thread CPU time with the time inside each aten op replaced by the host cost of a
  trivial op (calibrated here). On a GPU an op costs the host its dispatch and launch whatever
  its size; on the CPU it also does the op's work, which this takes out, with the fake
  collectives' time. Intra-op threads are off so every op runs on this thread;
- peak RSS of the process;
- (ours) the per-rank buffer bytes as sharded, beside the forecast's figures for the model.

The caller runs this module (``python -m``, one process per engine and W) with glibc's heap
kept, as a GPU's caching allocator keeps memory (``MALLOC_MMAP_MAX_=0``, no trim): freeing a
large CPU tensor otherwise unmaps it, which costs milliseconds of CPU per buffer, a cost no
GPU run has. It prints the result as one JSON line.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from vescale_plugins.bench.llama import PRESETS, DecoderLayer, LlamaConfig, RMSNorm
from vescale_plugins.forecast.memory import BUFFER_FIGURES, executed_buffer_memory, forecast_memory
from vescale_plugins.forecast.model import spec_from_modules
from vescale_plugins.tools.model_catalog import CATALOG

__all__ = ["STEP_MODELS", "measure"]

# Llama-3-8B's block shapes (the bench's decoder layer with them), bf16.
LLAMA3_8B = LlamaConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8,
)


class Blocks(nn.Module):
    """``layers`` decoder blocks and a final norm (the root's own parameter), on hidden states."""

    def __init__(self, config: LlamaConfig, layers: int) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(layers))
        self.norm = RMSNorm(config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(x.shape[1], self.config.head_dim, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x, ones, torch.zeros_like(ones))
        return self.norm(x)


# Models that train a step here: name -> (config, blocks); batch 1 x 8 tokens. The tiny one
# is the CI's.
STEP_MODELS = {"llama3-8b-block": (LLAMA3_8B, 2), "tiny-block": (PRESETS["tiny"], 2)}
TOKENS = 8


def _catalog_model(name: str) -> tuple[nn.Module, list[nn.Module]]:
    """A catalogue model's units as modules of meta parameters with its shapes (no forward)."""
    root = nn.Module()
    units = []
    for unit in CATALOG[name].units:
        for copy in range(unit.count):
            module = nn.Module()
            for param_name, shape in unit.params:
                *path, leaf = param_name.split(".")
                owner = module
                for part in path:
                    if not hasattr(owner, part):
                        owner.add_module(part, nn.Module())
                    owner = getattr(owner, part)
                owner.register_parameter(leaf, nn.Parameter(torch.empty(shape, device="meta", dtype=torch.bfloat16)))
            root.add_module(f"{unit.name.replace('.', '_')}_{copy}", module)
            units.append(module)
    return root, units


def _fully_shard(engine: str) -> Any:
    if engine == "vescale":
        from vescale_plugins import fully_shard

        return fully_shard
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    return torch_fully_shard


class _OpClock(TorchDispatchMode):
    """Counts aten ops by name and the thread CPU time spent inside them."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.inside_ns = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        start = time.thread_time_ns()
        out = func(*args, **(kwargs or {}))
        self.inside_ns += time.thread_time_ns() - start
        self.counts[func._schema.name] += 1
        return out


def _calibrate(n: int = 20000) -> tuple[float, float]:
    """(host cost of a trivial op, the op clock's own cost per op), in ns, on this thread."""
    x = torch.zeros(1)

    def loop() -> None:
        for _ in range(n):
            x.add_(1)

    def empty() -> None:
        for _ in range(n):
            pass

    best = {}
    for name, fn in (("empty", empty), ("bare", loop)):
        times = []
        for _ in range(3):
            start = time.thread_time_ns()
            fn()
            times.append(time.thread_time_ns() - start)
        best[name] = min(times)
    overheads = []
    for _ in range(3):
        clock = _OpClock()
        start = time.thread_time_ns()
        with clock:
            loop()
        overheads.append(time.thread_time_ns() - start - clock.inside_ns)
    op_ns = (best["bare"] - best["empty"]) / n
    return op_ns, (min(overheads) - best["empty"]) / n


def _is_collective(op: str) -> bool:
    return op.startswith(("c10d::", "_c10d_functional::"))


def _ops_by_region(step: Any) -> dict[str, int]:
    """Ops of one step (those the dispatch mode counts: none inside another op) under each
    engine's innermost profiler region, FSDP2's per-unit regions added up."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    regions: Counter[str] = Counter()
    for event in prof.events():
        if not _is_op(event.name):
            continue
        region, parent = "(outside)", event.cpu_parent
        while parent is not None:
            if _is_op(parent.name):
                break  # nested in an op: not one the step issues itself
            if region == "(outside)" and parent.name.startswith(("vescale::", "FSDP::")):
                region = parent.name.split(" (")[0]
            parent = parent.cpu_parent
        else:
            regions[region] += 1
    return dict(regions)


def _is_op(name: str) -> bool:
    return name.startswith("aten::") or _is_collective(name)


def _sharded_bytes(model: nn.Module) -> int:
    """Bytes of the parameters' local storage on this rank (each storage once)."""
    storages = {}
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _memory_vs_forecast(model: nn.Module, units: list[nn.Module], world_size: int, name: str) -> dict[str, Any]:
    """Per-rank buffer bytes as sharded here, and the forecast's figures for the same model
    (bf16 throughout, as built here): they must be equal."""
    spec = spec_from_modules(name, [(f"unit{i}", [u]) for i, u in enumerate(units)] + [("root", [model])], {})
    forecast = forecast_memory(spec, world_size, "bf16", "adamw", (0, 0))["vescale"]
    executed = executed_buffer_memory(model, world_size)
    expected = {key: getattr(forecast, key) for key in BUFFER_FIGURES}
    return {"executed": executed, "forecast": expected, "equal": executed == expected}


def measure(engine: str, world_size: int, model_name: str, steps: int = 3, warmup: int = 2) -> dict[str, Any]:
    """Everything the module docstring lists, for ``engine`` at ``world_size``."""
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        return _measure(engine, world_size, model_name, steps, warmup)
    finally:
        dist.destroy_process_group()


def _measure(engine: str, world_size: int, model_name: str, steps: int, warmup: int) -> dict[str, Any]:
    fully_shard = _fully_shard(engine)
    mesh = init_device_mesh("cpu", (world_size,))
    trains = model_name in STEP_MODELS
    with torch.device("meta"):
        if trains:
            config, layers = STEP_MODELS[model_name]
            blocks = Blocks(config, layers).to(torch.bfloat16)
            model: nn.Module = blocks
            units = [*blocks.layers]
        else:
            model, units = _catalog_model(model_name)
    numel = sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        fully_shard(nn.Linear(8, 8), mesh=mesh)  # first-call costs (imports, caches) out of the timing
    setup_ns = []
    for module in [*units, model]:
        start = time.thread_time_ns()
        fully_shard(module, mesh=mesh)
        setup_ns.append(time.thread_time_ns() - start)
    result: dict[str, Any] = {
        "engine": engine,
        "world_size": world_size,
        "model": model_name,
        "units": len(setup_ns),
        "parameters": numel,
        "setup_ms_per_unit": sum(setup_ns[:-1]) / max(1, len(setup_ns) - 1) / 1e6,
        "setup_ms_total": sum(setup_ns) / 1e6,
    }
    if engine == "vescale":
        result["memory_vs_forecast"] = _memory_vs_forecast(model, units, world_size, model_name)
    if not trains:
        return result
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).normal_(std=0.02)
    sharded = _sharded_bytes(model)
    element = 2  # bf16
    result["sharded_bytes_per_rank"] = sharded
    result["padding"] = 1 - numel * element / (world_size * sharded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(1, TOKENS, config.hidden_size, dtype=torch.bfloat16)

    def step() -> None:
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(warmup):
        step()
    op_ns, clock_ns = _calibrate()
    host_ms, counts = [], Counter[str]()
    for _ in range(steps):
        clock = _OpClock()
        start = time.thread_time_ns()
        with clock:
            step()
        total = time.thread_time_ns() - start
        ops = sum(clock.counts.values())
        host_ms.append((total - clock.inside_ns - ops * clock_ns + ops * op_ns) / 1e6)
        counts = clock.counts
    result.update(
        host_ms_per_step=min(host_ms),
        host_ms_steps=host_ms,
        op_host_ns=op_ns,
        op_clock_ns=clock_ns,
        ops_per_step=sum(counts.values()),
        collectives_per_step=sum(n for op, n in counts.items() if _is_collective(op)),
        ops_by_name=dict(counts.most_common()),
        ops_by_region=_ops_by_region(step),
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    return result


if __name__ == "__main__":
    engine, world, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    print(json.dumps(measure(engine, world, name, *map(int, sys.argv[4:]))))
