"""One training step, torch FSDP2 vs veScale-FSDP, alternating in one run on gloo (CPU).

    python -m vescale_plugins.bench.step_compare [--world-size 2] [--layers 8] [--dim 1024]
        [--batch 16] [--warmup 5] [--steps 30] [--reshard-after-forward none|true|false]
        [--memory-repeats 3] [--malloc default|keep] [--threads 1] [--profile-steps 3]
        [--top-ops N] [--timeout 900] [--json PATH]

Every rank builds the same ``nn.Sequential`` of ``layers`` x (Linear(dim, dim), ReLU) from
one seed, shards one copy with ``torch.distributed.fsdp.fully_shard`` and one with
``vescale_plugins.fully_shard`` (each Linear a unit, then the root), and trains both with
AdamW on the same per-rank batches. Four phases, in this order:

1. memory, per engine: build, train ``MEMORY_WARMUP_STEPS`` steps, then count one step's
   peak live tensor bytes with :class:`~vescale_plugins.observe.allocations.AllocationTracker`
   (allocator events, so in-place storage resizes count; the engine is built inside the
   tracker, so parameters and optimizer state count too); the rank with the highest peak,
   smallest of ``memory_repeats`` repeats;
2. time: fresh copies of both, ``warmup`` steps each, then ``steps`` steps each alternating
   FSDP2, veScale, FSDP2, ...; each step is timed on every rank from a barrier to its end,
   and a step's time (and minor page-fault count) is the slowest rank's;
3. profile (unless ``--profile-steps 0``): a few more steps per engine under
   ``torch.profiler``, to split off the copies inside each engine's collective scopes, gloo's
   own copies, and the cost of moving gradients into the flat gradient buffer;
4. parity: last loss of both and the largest difference between their parameters.

A step is forward, backward, ``optimizer.step()`` and ``optimizer.zero_grad()``. The time
ratio is of medians; the median of per-pair ratios (each veScale step over the FSDP2 step
just before it) is printed too, being less sensitive to other load on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.profiler import ProfilerActivity, record_function

from vescale_plugins import fully_shard as vescale_fully_shard
from vescale_plugins.observe.allocations import AllocationTracker, RegionMemory
from vescale_plugins.observe.quiet_profiler import profile
from vescale_plugins.dbuffer.buffer import GRADIENT_RELEASE_REGION
from vescale_plugins.dbuffer.collectives import POINT_TO_POINT_SCOPE

ENGINES = ("fsdp2", "vescale")
SHARD_FNS: dict[str, Callable[..., Any]] = {"fsdp2": torch_fully_shard, "vescale": vescale_fully_shard}
# Goals of veScale vs FSDP2 on this benchmark (ratios veScale / FSDP2).
TIME_RATIO_TARGET = 0.90
MEMORY_RATIO_TARGET = 1.0
# Steps before the one whose memory is counted: the first builds optimizer state, the second
# shows whether anything still grows.
MEMORY_WARMUP_STEPS = 2
# Distinct batches per rank, cycled through (both engines see the same sequence).
BATCH_POOL = 4
# Profiler scopes of each engine's collectives (the engine's code around the backend call).
COLLECTIVE_SCOPES = {
    "fsdp2": ("FSDP::all_gather", "FSDP::post_backward_reduce"),
    "vescale": ("vescale::all_gather", "vescale::reduce_scatter"),
}
# Scopes of the collective itself: the backend's (gloo's own staging copies live there), and
# the point-to-point collectives veScale uses on gloo (their own chunk's local write).
BACKEND_SCOPES = ("c10d::", "gloo:", POINT_TO_POINT_SCOPE)
COPY_OPS = frozenset({
    "aten::copy_", "aten::_foreach_copy_", "aten::split_with_sizes_copy", "aten::_chunk_cat",
    "aten::cat", "aten::clone", "fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat",
})
ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
# ``--malloc keep``: glibc serves blocks up to 32 MiB (its largest mmap threshold) from the
# heap and never trims it, so freed memory stays mapped and steady-state steps do not
# page-fault. Read by glibc at process start, hence passed to the spawned ranks.
KEEP_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40)}
STEP_SCOPE = "bench::step"
MIB = 2**20
# Per-rank (input, target) pairs, each ``batch`` x ``dim``.
Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Config:
    """What to run. Sizes are elements/rows, times seconds."""

    world_size: int = 2
    layers: int = 8
    dim: int = 1024
    batch: int = 16
    warmup: int = 5
    steps: int = 30
    reshard_after_forward: bool | None = None
    threads: int = 1
    seed: int = 0
    lr: float = 1e-3
    memory_repeats: int = 3
    malloc: str = "default"
    profile_steps: int = 3
    top_ops: int = 0
    timeout_s: float = 900.0
    json_path: str | None = None


# -- model, data, step ----------------------------------------------------------------------


@dataclass
class Engine:
    """One sharded copy of the model and its optimizer; ``steps_done`` picks the next batch."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    steps_done: int = 0
    last_loss: torch.Tensor | None = None


def build_model(cfg: Config) -> nn.Sequential:
    """``layers`` x (Linear(dim, dim), ReLU), identical on every rank and for both engines."""
    torch.manual_seed(cfg.seed)
    blocks: list[nn.Module] = []
    for _ in range(cfg.layers):
        blocks += [nn.Linear(cfg.dim, cfg.dim), nn.ReLU()]
    return nn.Sequential(*blocks)


def make_engine(name: str, cfg: Config, mesh: DeviceMesh) -> Engine:
    """Shard a fresh model with engine ``name``: each Linear its own unit, then the root."""
    model = build_model(cfg)
    shard = SHARD_FNS[name]
    for block in model:
        if isinstance(block, nn.Linear):
            shard(block, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward)
    shard(model, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward)
    return Engine(name, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr))


def make_batches(cfg: Config, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``BATCH_POOL`` (input, target) pairs of ``batch`` x ``dim``, different on each rank."""
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + rank + 1)
    return [
        (torch.randn(cfg.batch, cfg.dim, generator=generator), torch.randn(cfg.batch, cfg.dim, generator=generator))
        for _ in range(BATCH_POOL)
    ]


def _no_region(name: str) -> ContextManager[None]:
    return contextlib.nullcontext()


def train_step(engine: Engine, batches: Batches, region: Callable[[str], ContextManager[None]] = _no_region) -> None:
    """Forward, backward, optimizer step and zero_grad on the engine's next batch."""
    x, target = batches[engine.steps_done % len(batches)]
    with region("forward"):
        loss = F.mse_loss(engine.model(x), target)
    with region("backward"):
        loss.backward()
    with region("optimizer"):
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    engine.steps_done += 1
    engine.last_loss = loss.detach()


# -- phases (run on every rank) ----------------------------------------------------------------


def measure_memory(name: str, cfg: Config, mesh: DeviceMesh, batches: Batches) -> RegionMemory:
    """Live tensor bytes around one steady-state step of engine ``name`` built inside the tracker."""
    with AllocationTracker() as tracker:
        engine = make_engine(name, cfg, mesh)
        for _ in range(MEMORY_WARMUP_STEPS):
            train_step(engine, batches)
        dist.barrier()
        with tracker.region("step"):
            train_step(engine, batches, tracker.region)
        del engine
    return tracker.region_memory("step")


def job_memory(name: str, cfg: Config, mesh: DeviceMesh, batches: Batches) -> RegionMemory:
    """The job's step memory: the rank with the highest peak, in the least inflated repeat.

    Frees the profiler misses (see ``bench.memory``) only ever add bytes, so the smallest of
    ``memory_repeats`` measurements is the exact one whenever any repeat was clean.
    """
    repeats = []
    for _ in range(cfg.memory_repeats):
        per_rank: list[RegionMemory | None] = [None] * cfg.world_size
        dist.all_gather_object(per_rank, measure_memory(name, cfg, mesh, batches))
        repeats.append(max(per_rank, key=lambda m: m.peak_bytes))  # type: ignore[union-attr]
    return min(repeats, key=lambda m: (m.peak_bytes, m.start_bytes))


@dataclass
class StepSamples:
    """Per engine, one entry per timed step: seconds, and minor page faults of the process.

    Both are the largest over ranks. Page faults count first touches of memory the C
    allocator mapped afresh (glibc gives blocks this large back to the kernel), a cost of
    allocating that depends on the process's heap history rather than on the engine alone.
    """

    seconds: dict[str, list[float]]
    page_faults: dict[str, list[float]]


def measure_times(engines: Sequence[Engine], cfg: Config, batches: Batches) -> StepSamples:
    """Time each engine's steps, alternating engines step by step."""
    for _ in range(cfg.warmup):
        for engine in engines:
            train_step(engine, batches)
    seconds: dict[str, list[float]] = {engine.name: [] for engine in engines}
    faults: dict[str, list[float]] = {engine.name: [] for engine in engines}
    for _ in range(cfg.steps):
        for engine in engines:
            dist.barrier()  # every rank starts the step together
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            train_step(engine, batches)
            seconds[engine.name].append(time.perf_counter() - start)
            faults[engine.name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
    return StepSamples(_largest_over_ranks(seconds), _largest_over_ranks(faults))


def _largest_over_ranks(samples: dict[str, list[float]]) -> dict[str, list[float]]:
    names = list(samples)
    table = torch.tensor([samples[name] for name in names], dtype=torch.float64)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return {name: table[i].tolist() for i, name in enumerate(names)}


@dataclass
class StepProfile:
    """Where a profiled step's time went, in ms per step (op durations include their children).

    Attributes:
        step_ms: the whole step.
        collective_ms: inside the engine's collective scopes (``COLLECTIVE_SCOPES``).
        engine_copy_ms_by_op: copy ops the engine runs inside those scopes, outside the backend.
        backend_copy_ms: copy ops of the collectives themselves: inside the backend's ops
            (gloo staging, any thread), the copy-out gloo's reduce-scatter does in ``wait()``,
            and the own-chunk writes of veScale's point-to-point collectives on gloo.
        grad_fill_ms: getting gradients into a flat buffer outside the collective scopes:
            ``zero_`` in backward, ``add_`` / ``copy_`` under AccumulateGrad, and veScale's
            copy of each unit's gradients into its buffer (``GRADIENT_RELEASE_REGION``).
        top_self_ms: the ops with the most self time, with it.
    """

    step_ms: float
    collective_ms: float
    engine_copy_ms_by_op: dict[str, float]
    backend_copy_ms: float
    grad_fill_ms: float
    top_self_ms: list[tuple[str, float]] = field(default_factory=list)

    @property
    def engine_copy_ms(self) -> float:
        return sum(self.engine_copy_ms_by_op.values())


def profile_steps(engine: Engine, batches: Batches, steps: int, top_ops: int) -> StepProfile:
    """Profile ``steps`` steps of ``engine`` and split their time by ``StepProfile``'s categories."""
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function(STEP_SCOPE):
                train_step(engine, batches)
    nodes = _walk(prof.profiler.kineto_results.experimental_event_tree())
    scopes = COLLECTIVE_SCOPES[engine.name]

    def in_scope(n: Any) -> bool:
        return n.name.startswith(scopes)

    def in_backend(n: Any) -> bool:
        return n.name.startswith(BACKEND_SCOPES)

    def is_copy(n: Any) -> bool:
        return n.name in COPY_OPS

    engine_copies: dict[str, float] = {}
    backend_copy_ns = grad_fill_ns = 0
    for n in nodes:
        if is_copy(n) and not _has_ancestor(n, is_copy):
            if _has_ancestor(n, in_backend) or _is_gloo_wait_copy(n):
                backend_copy_ns += n.duration_time_ns
            elif _has_ancestor(n, in_scope):
                engine_copies[n.name] = engine_copies.get(n.name, 0.0) + n.duration_time_ns / (1e6 * steps)
        if _is_grad_fill(n):
            grad_fill_ns += n.duration_time_ns
    collective_ns = sum(n.duration_time_ns for n in nodes if in_scope(n) and not _has_ancestor(n, in_scope))
    step_ns = sum(n.duration_time_ns for n in nodes if n.name == STEP_SCOPE)
    top = sorted(((e.key, e.self_cpu_time_total / 1e3 / steps) for e in prof.key_averages()), key=lambda kv: -kv[1])
    per_step = 1e6 * steps  # ns in total -> ms per step
    return StepProfile(
        step_ns / per_step, collective_ns / per_step, engine_copies, backend_copy_ns / per_step, grad_fill_ns / per_step, top[:top_ops]
    )


def _is_gloo_wait_copy(n: Any) -> bool:
    """Gloo's reduce-scatter ends in ``wait()`` on the caller's thread: it chunks its
    all-reduced buffer and copies this rank's chunk out (an ``aten::chunk`` then this copy)."""
    if n.parent is None:
        return False
    siblings = sorted(n.parent.children, key=lambda c: c.start_time_ns)
    i = next(k for k, c in enumerate(siblings) if c.id == n.id)
    return i >= 1 and siblings[i - 1].name == "aten::chunk"


def _is_grad_fill(n: Any) -> bool:
    if n.name in ("aten::copy_", "aten::zero_") and _has_ancestor(n, lambda a: a.name == GRADIENT_RELEASE_REGION):
        return True
    if n.name == "aten::zero_":
        return _has_ancestor(n, lambda a: a.name.startswith("autograd::engine::"))
    return n.name in ("aten::add_", "aten::copy_") and n.parent is not None and n.parent.name == ACCUMULATE_GRAD


def _walk(roots: Sequence[Any]) -> list[Any]:
    nodes, stack = [], list(roots)
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children)
    return nodes


def _has_ancestor(node: Any, predicate: Callable[[Any], bool]) -> bool:
    parent = node.parent
    while parent is not None:
        if predicate(parent):
            return True
        parent = parent.parent
    return False


def _profile_record(p: StepProfile) -> dict[str, Any]:
    return {**asdict(p), "engine_copy_ms": p.engine_copy_ms}


def max_param_difference(a: Engine, b: Engine) -> float:
    """Largest |a - b| over all parameters, compared as full tensors (a collective)."""
    worst = 0.0
    for (name_a, p), (name_b, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        if name_a != name_b:
            raise RuntimeError(f"the two models differ in structure: {name_a!r} vs {name_b!r}")
        worst = max(worst, (p.full_tensor() - q.full_tensor()).abs().max().item())
    return worst


def run_rank(cfg: Config) -> dict[str, Any]:
    """All phases on this rank; returns the JSON-able results (meaningful on rank 0)."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (cfg.world_size,))
    batches = make_batches(cfg, rank)

    memory = {name: asdict(job_memory(name, cfg, mesh, batches)) for name in ENGINES}

    engines = [make_engine(name, cfg, mesh) for name in ENGINES]
    samples = measure_times(engines, cfg, batches)
    profiles = {}
    if cfg.profile_steps:
        profiles = {e.name: _profile_record(profile_steps(e, batches, cfg.profile_steps, cfg.top_ops)) for e in engines}
    losses = {e.name: e.last_loss.item() for e in engines}  # type: ignore[union-attr]
    param_diff = max_param_difference(*engines)
    return summarize(cfg, samples, memory, profiles, losses, param_diff)


# -- results --------------------------------------------------------------------------------


def time_stats(seconds: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and IQR of step times, in ms."""
    ms = [s * 1e3 for s in seconds]
    q1, median, q3 = statistics.quantiles(ms, n=4) if len(ms) > 1 else (ms[0],) * 3
    return {"median_ms": median, "q1_ms": q1, "q3_ms": q3, "iqr_ms": q3 - q1, "min_ms": min(ms), "n": len(ms)}


def summarize(
    cfg: Config,
    samples: StepSamples,
    memory: dict[str, dict[str, Any]],
    profiles: dict[str, dict[str, Any]],
    losses: dict[str, float],
    param_diff: float,
) -> dict[str, Any]:
    times = samples.seconds
    stats = {name: time_stats(times[name]) for name in ENGINES}
    for name in ENGINES:
        stats[name]["page_faults_median"] = statistics.median(samples.page_faults[name])
    return {
        "config": asdict(cfg),
        "torch": torch.__version__,
        "time": stats,
        "time_samples_ms": {name: [s * 1e3 for s in times[name]] for name in ENGINES},
        "memory": memory,
        "ratios": {
            "time": stats["vescale"]["median_ms"] / stats["fsdp2"]["median_ms"],
            # Each veScale step over the FSDP2 step just before it: robust to slow drifts.
            "time_paired_median": statistics.median(v / f for f, v in zip(times["fsdp2"], times["vescale"])),
            "memory": memory["vescale"]["peak_bytes"] / memory["fsdp2"]["peak_bytes"],
        },
        "targets": {"time": TIME_RATIO_TARGET, "memory": MEMORY_RATIO_TARGET},
        "profile": profiles,
        "parity": {"loss": losses, "max_abs_param_diff": param_diff},
    }


def format_report(result: dict[str, Any]) -> str:
    """The human-readable table of a ``summarize`` result."""
    cfg, lines = result["config"], []
    lines.append(
        f"W={cfg['world_size']} layers={cfg['layers']} dim={cfg['dim']} batch={cfg['batch']} "
        f"steps={cfg['steps']} (warmup {cfg['warmup']}) reshard_after_forward={cfg['reshard_after_forward']} "
        f"threads/rank={cfg['threads']} malloc={cfg['malloc']} torch {result['torch']}"
    )
    lines.append(
        f"{'engine':<9}{'median ms':>11}{'IQR ms':>9}{'min ms':>9}{'faults':>8}{'peak MiB':>10}{'start MiB':>11}  peak by owner (MiB)"
    )
    for name in ENGINES:
        t, m = result["time"][name], result["memory"][name]
        owners = ", ".join(f"{k} {v / MIB:.2f}" for k, v in sorted(m["peak_by_owner"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"{name:<9}{t['median_ms']:>11.2f}{t['iqr_ms']:>9.2f}{t['min_ms']:>9.2f}{t['page_faults_median']:>8.0f}"
            f"{m['peak_bytes'] / MIB:>10.2f}{m['start_bytes'] / MIB:>11.2f}  {owners}"
        )
    r, goal = result["ratios"], result["targets"]
    lines.append(
        f"veScale/FSDP2: time {r['time']:.3f} (target <= {goal['time']:.2f}: {'met' if r['time'] <= goal['time'] else 'MISSED'}; "
        f"median of paired ratios {r['time_paired_median']:.3f}), "
        f"memory {r['memory']:.3f} (target < {goal['memory']:.2f}: {'met' if r['memory'] < goal['memory'] else 'MISSED'})"
    )
    parity = result["parity"]
    loss = parity["loss"]
    lines.append(
        f"parity: loss fsdp2 {loss['fsdp2']:.6f} vescale {loss['vescale']:.6f} "
        f"(|diff| {abs(loss['fsdp2'] - loss['vescale']):.2e}), max |param diff| {parity['max_abs_param_diff']:.2e}"
    )
    for name, p in result["profile"].items():
        share = 100 * p["engine_copy_ms"] / p["step_ms"]
        ops = ", ".join(f"{op} {ms:.2f}" for op, ms in sorted(p["engine_copy_ms_by_op"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"profiled {name}: step {p['step_ms']:.1f} ms, in its collective scopes {p['collective_ms']:.1f}; "
            f"engine copies there {p['engine_copy_ms']:.2f} ms ({share:.1f}% of the step){' = ' + ops if ops else ''}; "
            f"gradients into buffers (zero_/add_/copy_ under AccumulateGrad or in veScale's gradient copy) {p['grad_fill_ms']:.2f} ms; the collectives' own copies (gloo's staging; veScale's own-chunk writes) {p['backend_copy_ms']:.2f} ms"
        )
        for op, ms in p["top_self_ms"]:
            lines.append(f"    {op:<60}{ms:>9.2f} ms self")
    return "\n".join(lines)


# -- processes --------------------------------------------------------------------------------


def _exit_when_orphaned(parent_pid: int) -> None:
    # Daemon children die with a parent that exits, but not with one that is SIGKILLed.
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        time.sleep(1.0)


def _worker(rank: int, cfg: Config, port: int, parent_pid: int, results: Any) -> None:
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(cfg.threads)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.world_size, timeout=timeout)
    try:
        result = run_rank(cfg)
        if rank == 0:
            results.put(("ok", rank, result))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def launch(cfg: Config) -> dict[str, Any]:
    """Run every rank in its own process; return rank 0's results or raise on failure/timeout.

    The parent holds the rendezvous store on a port the kernel picks, so runs never collide.
    """
    context = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, cfg.world_size + 1, is_master=True, wait_for_workers=False)
    results = context.Queue()
    processes = [
        context.Process(target=_worker, args=(rank, cfg, store.port, os.getpid(), results), daemon=True, name=f"bench-rank{rank}")
        for rank in range(cfg.world_size)
    ]
    with _environment(KEEP_MALLOC_ENV if cfg.malloc == "keep" else {}):
        for p in processes:
            p.start()
    deadline = time.monotonic() + cfg.timeout_s
    try:
        status, rank, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
        if status != "ok":
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        for p in processes:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return payload
    except queue.Empty:
        raise TimeoutError(f"no result within {cfg.timeout_s:.0f} s") from None
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


@contextlib.contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the processes started inside, then restore them."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def parse_args(argv: Sequence[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Config()
    parser.add_argument("--world-size", type=int, default=default.world_size, help="gloo ranks (processes)")
    parser.add_argument("--layers", type=int, default=default.layers, help="Linear layers (one FSDP unit each)")
    parser.add_argument("--dim", type=int, default=default.dim, help="Linear in = out features")
    parser.add_argument("--batch", type=int, default=default.batch, help="rows per rank per step")
    parser.add_argument("--warmup", type=int, default=default.warmup, help="untimed steps per engine")
    parser.add_argument("--steps", type=int, default=default.steps, help="timed steps per engine")
    parser.add_argument(
        "--reshard-after-forward", choices=("none", "true", "false"), default="none",
        help="passed to both fully_shard calls (none: the engines' default, root keeps its params)",
    )
    parser.add_argument(
        "--memory-repeats", type=int, default=default.memory_repeats, help="memory measurements per engine (the smallest is kept)"
    )
    parser.add_argument(
        "--malloc", choices=("default", "keep"), default=default.malloc,
        help="keep: glibc keeps freed blocks mapped (no page faults in steady state); default: as the C library does",
    )
    parser.add_argument("--threads", type=int, default=default.threads, help="torch threads per rank")
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument(
        "--profile-steps", type=int, default=default.profile_steps, help="steps per engine under torch.profiler (0: none)"
    )
    parser.add_argument("--top-ops", type=int, default=default.top_ops, help="list the N ops with most self time per engine")
    parser.add_argument("--timeout", dest="timeout_s", type=float, default=default.timeout_s, help="seconds for the whole run")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    args = vars(parser.parse_args(argv))
    args["reshard_after_forward"] = {"none": None, "true": True, "false": False}[args["reshard_after_forward"]]
    if args["world_size"] < 2 or args["steps"] < 1 or args["memory_repeats"] < 1:
        parser.error("--world-size must be at least 2, --steps and --memory-repeats at least 1")
    return Config(**args)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    result = launch(cfg)
    print(format_report(result))
    if cfg.json_path:
        with open(cfg.json_path, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
