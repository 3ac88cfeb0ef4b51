"""One ``bench host`` configuration in this process: the host work of a training step, per phase,
for the same model unsharded, under FSDP2 and under ours, steps interleaved.

The models are small enough that their compute is negligible (``MODELS``), so what a step costs
the host is the engines' work plus the model's own ops; the unsharded model (plain tensors, the
same optimizer and clipping) is that floor, and *an engine's own* work is what it costs above
it. Each phase (forward with the loss, backward, ``clip_grad_norm_``, the optimizer step,
``zero_grad``) is measured on this thread:

- CPU ms: ``time.thread_time_ns``, intra-op threads off (every op runs here), in steps with
  nothing else attached; page faults (minor + major, ``RUSAGE_THREAD``) in the same steps;
- Python calls: ``sys.setprofile``'s ``call`` events, in separate steps;
- ATen ops and DTensor dispatches: the ops a dispatch mode sees (those the step issues itself,
  none inside another op's dispatch) and those of them with a DTensor operand, separate steps.

With ``--engines`` Megatron-FSDP 1 and 2 (``megatron-fsdp``, ``megatron-fsdp-v2``) take their
steps too, built as the bench builds them (:mod:`vescale_plugins.bench.megatron_engine`), each
phase under the CPU stand-ins (:mod:`vescale_plugins.bench.megatron_cpu`), whose own calls are
counted with the rest: fp32 on gloo only (their mixed precision casts the model itself; the fake
process group has no collectives for their set-up's checks).

Rank 0 prints the result as one JSON line; other ranks (gloo, W > 1) take the same steps.
World sizes past the machine's run as rank 0 of torch's fake process group. On CUDA (the GPU
check's ``host`` part, W=1 over NCCL) each timed step also records its wall time (the device
synchronised at its end) and, in one more step, the kernels it launched (the profiler's).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from vescale_plugins.bench.llama import Llama, LlamaConfig
from vescale_plugins.bench.megatron_cpu import cpu_stand_ins
from vescale_plugins.bench.megatron_engine import MEGATRON_ENGINES

__all__ = ["MODELS", "PHASES", "ENGINES", "PEERS", "HostConfig", "measure"]

PHASES = ("forward", "backward", "clip", "step", "zero_grad")
ENGINES = ("unsharded", "fsdp2", "vescale")
PEERS = MEGATRON_ENGINES  # where they run: fp32 on gloo (module docstring)


class ParamStack(nn.Module):
    """``units`` blocks of ``per_unit // 2`` square Linear layers each (weights and biases:
    ``per_unit`` parameters a unit): host work against the number of parameters per unit."""

    def __init__(self, units: int, per_unit: int, dim: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(*(nn.Linear(dim, dim) for _ in range(per_unit // 2))) for _ in range(units)
        )
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def fsdp_units(self) -> list[list[nn.Module]]:
        return [[layer] for layer in self.layers]


def _llama(layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=1009,
        hidden_size=64,
        intermediate_size=171,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )


@dataclass(frozen=True)
class HostModel:
    """A model of negligible compute and how its step is fed."""

    description: str
    build: Callable[[], nn.Module]
    units: Callable[[nn.Module], list[list[nn.Module]]]
    inputs: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _llama_model(layers: int) -> HostModel:
    config = _llama(layers)
    return HostModel(
        description=f"the bench's Llama, hidden 64, {layers + 2} units",
        build=config.build,
        units=lambda model: [modules for _, modules in cast(Llama, model).fsdp_units()],
        inputs=lambda g: config.batches(g, 1, 2, 16)[0],
        loss=config.loss,
    )


def _stack_model(units: int, per_unit: int) -> HostModel:
    return HostModel(
        description=f"{units} units of {per_unit} parameters (Linear 16x16)",
        build=lambda: ParamStack(units, per_unit),
        units=lambda model: cast(ParamStack, model).fsdp_units(),
        inputs=lambda g: (torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)),
        loss=lambda out, target: (out.float() - target).pow(2).mean(),
    )


MODELS: dict[str, Callable[[], HostModel]] = {
    "llama-tiny": lambda: _llama_model(5),  # 7 units, 48 parameters
    "llama-wide": lambda: _llama_model(12),  # 14 units, 111 parameters
    "stack-10": lambda: _stack_model(4, 10),
    "stack-100": lambda: _stack_model(4, 100),
}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.dtensor_ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        if any(issubclass(t, DTensor) for t in types):
            self.dtensor_ops += 1
        return func(*args, **(kwargs or {}))


class _Meter:
    """What :func:`measure` records of each (engine, phase): a list per metric, one per step."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, str], dict[str, list[float]]] = {}

    def add(self, engine: str, phase: str, metric: str, value: float) -> None:
        self.samples.setdefault((engine, phase), {}).setdefault(metric, []).append(value)

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (engine, phase), metrics in self.samples.items():
            out.setdefault(engine, {})[phase] = {m: statistics.median(v) for m, v in metrics.items()}
        return out


def _faults() -> int:
    usage = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
    return usage.ru_minflt + usage.ru_majflt


@contextmanager
def _python_calls(counter: list[int]) -> Iterator[None]:
    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            counter[0] += 1

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


@dataclass
class _Trainer:
    """One engine's model, optimizer and step, phase by phase."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # Around each phase: Megatron-FSDP's CPU stand-ins, nothing for the others.
    around: Callable[[], AbstractContextManager[Any]] = nullcontext

    def phases(self, inputs: torch.Tensor, targets: torch.Tensor) -> Iterator[tuple[str, Callable[[], Any]]]:
        state: dict[str, Any] = {}
        params = list(self.model.parameters())

        def within(run: Callable[[], Any]) -> Callable[[], Any]:
            if self.around is nullcontext:
                return run

            def wrapped() -> Any:
                with self.around():
                    return run()

            return wrapped

        yield "forward", within(lambda: state.__setitem__("loss", self.loss(self.model(inputs), targets)))
        yield "backward", within(lambda: state["loss"].backward())
        yield "clip", within(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0))
        yield "step", within(self.optimizer.step)
        yield "zero_grad", within(lambda: self.optimizer.zero_grad(set_to_none=True))


def _optimizer(kind: str, engine: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "flat" and engine == "vescale":
        from vescale_plugins.optim import AdamW

        return AdamW(params, lr=1e-3)
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


def _build(engine: str, spec: HostModel, dtype: str, optimizer: str, mesh: Any, device: torch.device) -> _Trainer:
    torch.manual_seed(0)
    model = spec.build().to(device)
    if engine in MEGATRON_ENGINES:
        from vescale_plugins.bench import megatron_engine

        module, megatron_optimizer = megatron_engine.build(
            engine, model, spec.units(model), lambda m: _optimizer(optimizer, engine, list(m.parameters())), device
        )
        return _Trainer(engine, module, megatron_optimizer, spec.loss, lambda: cpu_stand_ins(device))
    if engine == "unsharded":
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        from vescale_plugins import fully_shard as vescale_fully_shard

        shard = torch_fully_shard if engine == "fsdp2" else vescale_fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if dtype == "bf16" else None)
        for modules in spec.units(model):
            shard(modules if len(modules) > 1 else modules[0], mesh=mesh, mp_policy=mp)
        shard(model, mesh=mesh, mp_policy=mp)
    return _Trainer(engine, model, _optimizer(optimizer, engine, list(model.parameters())), spec.loss)


@dataclass(frozen=True)
class HostConfig:
    """One configuration: ``world_size`` ranks (the fake group's rank 0 when ``fake``), the model
    by name, its dtype (fp32, bf16) and optimizer, the timed and warm-up steps, the device, and
    the ``peers`` measured after ``ENGINES``."""

    world_size: int
    model: str
    dtype: str
    optimizer: str
    steps: int
    warmup: int
    fake: bool
    device: str = "cpu"
    peers: tuple[str, ...] = ()


def measure(config: HostConfig) -> dict[str, Any] | None:
    """Every metric of the module docstring, per engine and phase; ``None`` off rank 0."""
    torch.set_num_threads(1)
    if config.fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=config.world_size)
    else:
        backend = "nccl" if config.device == "cuda" else "gloo"
        dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=config.world_size)
    try:
        return _measure(config, torch.device(config.device))
    finally:
        dist.destroy_process_group()


def _kernels_per_step(trainer: _Trainer, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """(CUDA) The kernels one step launches, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _, run in trainer.phases(inputs, targets):
            run()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _measure(config: HostConfig, device: torch.device) -> dict[str, Any] | None:
    spec = MODELS[config.model]()
    if device.type == "cuda":
        torch.cuda.set_device(0)
    mesh = init_device_mesh(device.type, (config.world_size,))
    engines = (*ENGINES, *config.peers)
    trainers = [_build(engine, spec, config.dtype, config.optimizer, mesh, device) for engine in engines]
    generator = torch.Generator().manual_seed(dist.get_rank())
    inputs, targets = (t.to(device) for t in spec.inputs(generator))
    meter = _Meter()
    on_cuda = device.type == "cuda"

    def one_step(trainer: _Trainer, record: str | None) -> None:
        for phase, run in trainer.phases(inputs, targets):
            if record == "time":
                faults, start = _faults(), time.thread_time_ns()
                run()
                meter.add(trainer.name, phase, "cpu_ms", (time.thread_time_ns() - start) / 1e6)
                meter.add(trainer.name, phase, "page_faults", _faults() - faults)
            elif record == "calls":
                calls = [0]
                with _python_calls(calls):
                    run()
                meter.add(trainer.name, phase, "python_calls", calls[0])
            elif record == "ops":
                with _OpCounter() as counter:
                    run()
                meter.add(trainer.name, phase, "aten_ops", counter.ops)
                meter.add(trainer.name, phase, "dtensor_ops", counter.dtensor_ops)
            else:
                run()
        if record == "time" and on_cuda:
            torch.cuda.synchronize()

    for _ in range(config.warmup):
        for trainer in trainers:
            one_step(trainer, None)
    wall_ms: dict[str, list[float]] = {t.name: [] for t in trainers}
    for record in ("calls", "ops", *["time"] * config.steps):
        for trainer in trainers:  # interleaved: the machine's drift falls on every engine alike
            start = time.perf_counter()
            one_step(trainer, record)
            if record == "time":
                wall_ms[trainer.name].append((time.perf_counter() - start) * 1e3)
    extra: dict[str, Any] = {"wall_ms_per_step": {name: statistics.median(v) for name, v in wall_ms.items()}}
    if on_cuda:
        extra["kernels_per_step"] = {t.name: _kernels_per_step(t, inputs, targets) for t in trainers}
    if dist.get_rank() != 0:
        return None
    return {
        "world_size": config.world_size,
        "process_group": "fake" if config.fake else "gloo",
        "model": config.model,
        "model_description": spec.description,
        "parameters": sum(1 for _ in trainers[0].model.parameters()),
        "units": len(spec.units(trainers[0].model)),
        "dtype": config.dtype,
        "optimizer": config.optimizer,
        "torch": torch.__version__,
        "steps": config.steps,
        "device": str(device),
        "engines": meter.summary(),
        **extra,
    }


if __name__ == "__main__":
    world, name, dtype_name, optimizer_name, n_steps, n_warmup, fake_pg = sys.argv[1:8]
    on = sys.argv[8] if len(sys.argv) > 8 else "cpu"
    with_peers = tuple(p for p in (sys.argv[9] if len(sys.argv) > 9 else "").split(",") if p)
    config = HostConfig(
        int(world), name, dtype_name, optimizer_name, int(n_steps), int(n_warmup), fake_pg == "fake", on, with_peers
    )
    result = measure(config)
    if result is not None:
        print(json.dumps(result))
