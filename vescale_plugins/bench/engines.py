"""The two engines under test, built the same way on the same model, data and seed.

``fsdp2`` is ``torch.distributed.fsdp.fully_shard``; ``vescale`` is ours, driven by a front
end: plain ``fully_shard`` calls, Lightning Fabric, or Accelerate. The model is a config's:
the Llama-style decoder (``llama``) or the Linear stack (``linear_stack``), each of which
builds its model, its batches and its loss, and names its units (``fsdp_units``). Sizes are
bytes per rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from vescale_plugins import QuantizedComm, fully_shard
from vescale_plugins.bench.linear_stack import LinearStack, LinearStackConfig
from vescale_plugins.bench.llama import Llama, LlamaConfig
from vescale_plugins.bench.megatron_engine import MEGATRON_ENGINES
from vescale_plugins.planner import clear_plan_cache
from vescale_plugins.runtime.state import groups_under

# ``--comm``: quantized collectives of veScale-FSDP (weights only, or weights and gradients).
COMM_POLICIES = {"int8": QuantizedComm(weights="int8"), "int8-grads": QuantizedComm(weights="int8", grads="int8")}
ENGINES = ("fsdp2", "vescale")  # the default comparison; the peers join it on request
# Megatron-FSDP 1 and 2 (bench/megatron_engine.py), DeepSpeed ZeRO-3 (bench/deepspeed_engine.py).
PEER_ENGINES = (*MEGATRON_ENGINES, "deepspeed")
ALL_ENGINES = (*ENGINES, *PEER_ENGINES)
FRONTENDS = ("plain", "fabric", "accelerate")


@dataclass(frozen=True)
class BenchSettings:
    """What one run compares (shared by both engines): the model, and per rank and step
    ``batch_size`` sequences of ``seq_len`` tokens (the Linear stack's are rows: ``seq_len`` 1)."""

    config: LlamaConfig | LinearStackConfig
    batch_size: int
    seq_len: int
    mixed_precision: bool
    reshard_after_forward: bool | int | None
    block_rows: int | None
    frontend: str
    seed: int
    replicate: int = 1  # HSDP: replicas (mesh dim 0); the ranks of each shard the rest
    engines: tuple[str, ...] = ENGINES  # which engines run, FSDP2 first (the reference)
    compile: bool = False  # each decoder layer compiled before it is sharded (see compile_layers)
    comm: str = "exact"  # veScale-FSDP's collectives: exact, or a COMM_POLICIES key (quantized)

    def mesh(self, device_type: str, world: int) -> DeviceMesh:
        """The mesh both engines shard over: 1-D, or (replicate, shard) for HSDP."""
        if self.replicate == 1:
            return init_device_mesh(device_type, (world,))
        return init_device_mesh(
            device_type, (self.replicate, world // self.replicate), mesh_dim_names=("replicate", "shard")
        )

    def mp_policy(self) -> MixedPrecisionPolicy:
        if self.mixed_precision:
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()


@dataclass
class Engine:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    planner_seconds: float = 0.0
    # FSDP2's units (root last), when they mirror a front end's; None: _units.
    units: list[UnitChoice] | None = None


# The models a bench builds: each names its FSDP units (``fsdp_units``) and its loss (``config.loss``).
BenchModel: TypeAlias = "Llama | LinearStack"


def build_model(settings: BenchSettings, device: torch.device) -> BenchModel:
    torch.manual_seed(settings.seed)
    return settings.config.build().to(device)


def compile_layers(model: nn.Module) -> None:
    """torchtitan's order: each decoder layer ``compile(fullgraph=True)``, then sharded."""
    for layer in model.get_submodule("layers").children():
        layer.compile(fullgraph=True)


def _units(model: BenchModel, groups: list[list[str]] | None = None) -> list[Any]:
    """The units to shard, the root last: ``groups`` of module names if given, else the
    model's own (``fsdp_units``), then the root."""
    if groups is not None:
        return [
            [model.get_submodule(name) for name in group] if len(group) > 1 else model.get_submodule(group[0])
            for group in groups
        ]
    return [modules if len(modules) > 1 else modules[0] for _, modules in model.fsdp_units()] + [model]


# One unit as a front end chose it: its module names (as in the user's model) and the
# ``reshard_after_forward`` it was given.
UnitChoice = tuple[list[str], bool | int | None]


def vescale_units(model: nn.Module) -> list[UnitChoice]:
    """Each veScale-FSDP unit of ``model``, inner units first."""
    names = {id(module): _strip_wrappers(name) for name, module in model.named_modules()}
    # Reversed pre-order: every unit after the units nested in it (the order fully_shard needs).
    return [
        ([names[id(m)] for m in unit.modules], unit.reshard_after_forward) for unit in reversed(groups_under([model]))
    ]


def vescale_unit_groups(model: nn.Module) -> list[list[str]]:
    """The module names of each veScale-FSDP unit, inner units first."""
    return [names for names, _ in vescale_units(model)]


def _shard_plain(
    model: BenchModel,
    settings: BenchSettings,
    mesh: DeviceMesh,
    shard: Callable[..., Any],
    choices: list[UnitChoice] | None = None,
) -> None:
    kwargs: dict[str, Any] = dict(
        mesh=mesh, mp_policy=settings.mp_policy(), reshard_after_forward=settings.reshard_after_forward
    )
    if shard is fully_shard and settings.comm != "exact":
        kwargs["comm_policy"] = COMM_POLICIES[settings.comm]
    if shard is fully_shard and settings.block_rows:
        rows = settings.block_rows
        kwargs["block_size_fn"] = lambda name, p: rows if p.dim() == 2 and p.shape[0] % rows == 0 else None
    if choices is None:
        for unit in _units(model):
            shard(unit, **kwargs)
        return
    for names, reshard_after_forward in choices:
        shard(_units(model, [names])[0], **{**kwargs, "reshard_after_forward": reshard_after_forward})


def _training_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    settings: BenchSettings,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``step(inputs, targets) -> loss``: forward, the loss, ``backward`` (a front end's own,
    or autograd's), the optimizer step and ``zero_grad``."""

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = settings.config.loss(model(inputs), targets)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)


def build_engine(
    name: str, settings: BenchSettings, mesh: DeviceMesh, device: torch.device, units: list[UnitChoice] | None = None
) -> Engine:
    """One engine, ready to step: the model, sharded by ``name`` through the front end.

    ``units`` (FSDP2 only): shard these modules as units, each with its
    ``reshard_after_forward``, so that FSDP2 gets what a front end chose for veScale-FSDP
    (see :func:`vescale_units`): Accelerate, for one, reshards the root after forward too.
    """
    model = build_model(settings, device)
    if name == "deepspeed":
        return _deepspeed_engine(model, settings)
    if name in MEGATRON_ENGINES:
        return _megatron_engine(name, model, settings, device)
    if settings.compile:
        compile_layers(model)
    if name == "fsdp2":
        _shard_plain(model, settings, mesh, torch_fully_shard, units)
        optimizer = _optimizer(model)
        return Engine(name, model, optimizer, _training_step(model, optimizer, settings), units=units)
    clear_plan_cache()
    start = time.perf_counter()
    if settings.frontend == "plain":
        _shard_plain(model, settings, mesh, fully_shard)
        optimizer = _optimizer(model)
        engine = Engine(name, model, optimizer, _training_step(model, optimizer, settings))
    elif settings.frontend == "fabric":
        engine = _fabric_engine(model, settings)
    else:
        engine = _accelerate_engine(model, settings)
    engine.planner_seconds = time.perf_counter() - start
    return engine


def free_after_forward(settings: BenchSettings) -> bool:
    """Whether parameters are freed between forward and backward (FSDP2's default schedule)."""
    return settings.reshard_after_forward is not False


def deepspeed_config(settings: BenchSettings) -> dict[str, Any]:
    """The ZeRO-3 config the ``deepspeed`` engine runs under ``settings``."""
    from vescale_plugins.bench import deepspeed_engine

    with torch.device("meta"):  # the config reads sizes only
        model = settings.config.build()
    return deepspeed_engine.zero3_config(
        model, settings.batch_size, settings.mixed_precision, free_after_forward(settings)
    )


def _deepspeed_engine(model: BenchModel, settings: BenchSettings) -> Engine:
    import deepspeed  # noqa: F401  (imported before the timer: set-up is timed, not the import)

    from vescale_plugins.bench import deepspeed_engine

    config = deepspeed_engine.zero3_config(
        model, settings.batch_size, settings.mixed_precision, free_after_forward(settings)
    )
    start = time.perf_counter()
    engine, optimizer = deepspeed_engine.build(model, _optimizer(model), config)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = settings.config.loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()  # the optimizer step and zero_grad
        return loss.detach()

    return Engine("deepspeed", engine, optimizer, step, planner_seconds=time.perf_counter() - start)


def _megatron_engine(name: str, model: BenchModel, settings: BenchSettings, device: torch.device) -> Engine:
    import megatron_fsdp  # noqa: F401  (imported before the timer: set-up is timed, not the import)

    from vescale_plugins.bench import megatron_engine
    from vescale_plugins.bench.megatron_cpu import cpu_stand_ins

    start = time.perf_counter()
    units = [modules for _, modules in model.fsdp_units()]
    module, optimizer = megatron_engine.build(name, model, units, _optimizer, device)
    seconds = time.perf_counter() - start
    training_step = _training_step(module, optimizer, settings)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with cpu_stand_ins(device):
            return training_step(inputs, targets)

    return Engine(name, module, optimizer, step, planner_seconds=seconds)


def full_parameters(engine: Engine) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter whole, by its name in the user's model, one at a time (collectives:
    every rank iterates alike)."""
    if engine.name in MEGATRON_ENGINES:
        from vescale_plugins.bench import megatron_engine

        yield from megatron_engine.full_parameters(engine.name, engine.model)
        return
    if engine.name == "deepspeed":
        from vescale_plugins.bench import deepspeed_engine

        yield from deepspeed_engine.full_parameters(engine.model)
        return
    for name, p in parameter_names(engine.model).items():
        yield name, cast(DTensor, p).full_tensor()


def _accelerator() -> str:
    """Where the front ends train: the launcher's GPUs under NCCL (as the plain engines), else the CPU."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _fabric_engine(model: nn.Module, settings: BenchSettings) -> Engine:
    from lightning.fabric import Fabric

    from lightning_strategy import VeScaleFSDPFabricStrategy

    strategy = VeScaleFSDPFabricStrategy(reshard_after_forward=settings.reshard_after_forward)
    fabric = Fabric(
        strategy=strategy,
        accelerator=_accelerator(),
        devices=dist.get_world_size(),
        precision="bf16-mixed" if settings.mixed_precision else "32-true",
    )
    fabric.launch()
    model = fabric.setup_module(model)
    # One optimizer in, one out: Fabric's wrapper, which forwards the Optimizer's methods.
    optimizer = cast(torch.optim.Optimizer, fabric.setup_optimizers(_optimizer(model)))
    return Engine("vescale", model, optimizer, _training_step(model, optimizer, settings, fabric.backward))


def _accelerate_engine(model: nn.Module, settings: BenchSettings) -> Engine:
    from accelerate import Accelerator

    from accelerate_plugin import VeScaleFSDPPlugin

    # As an Accelerate user would configure it: each decoder layer a unit (without a policy,
    # Accelerate shards only the root, for FSDP2 and for this plugin alike).
    plugin = VeScaleFSDPPlugin(
        reshard_after_forward=settings.reshard_after_forward is not False,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["DecoderLayer"],
    )
    accelerator = Accelerator(
        fsdp_plugin=plugin, mixed_precision="bf16" if settings.mixed_precision else "no", cpu=_accelerator() == "cpu"
    )
    model, optimizer = accelerator.prepare(model, _optimizer(model))
    return Engine("vescale", model, optimizer, _training_step(model, optimizer, settings, accelerator.backward))


def batches(settings: BenchSettings, rank: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (inputs, targets) batches for this rank, the same for both engines."""
    generator = torch.Generator().manual_seed(settings.seed * 1000 + rank)
    return settings.config.batches(generator, count, settings.batch_size, settings.seq_len)


# -- static figures of a sharded model (bytes per rank) -----------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def sharded_state_bytes(engine: Engine) -> int:
    """Parameters + gradients + optimizer state held by this rank (sharded); DeepSpeed's and
    Megatron-FSDP's main (master) weights too where they keep a copy."""
    if engine.name in MEGATRON_ENGINES:
        from vescale_plugins.bench import megatron_engine

        return megatron_engine.sharded_state_bytes(engine.name, engine.model, engine.optimizer)
    if engine.name == "deepspeed":
        from vescale_plugins.bench import deepspeed_engine

        return deepspeed_engine.sharded_state_bytes(engine.model)
    params = sum(_local(p).numel() * _local(p).element_size() for p in engine.model.parameters())
    state = sum(
        _local(v).numel() * _local(v).element_size()
        for s in engine.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    return 2 * params + state


def padding_and_traffic(
    engine: Engine, settings: BenchSettings, batch: tuple[torch.Tensor, torch.Tensor] | None = None
) -> dict[str, int]:
    """Padding bytes per rank (fp32 shards), and all-gather / reduce-scatter bytes per step.

    Megatron-FSDP's traffic is counted in one step on ``batch`` (its schedule, what it
    reshards and when, is its own), the others' from their units."""
    if engine.name in MEGATRON_ENGINES:
        from vescale_plugins.bench import megatron_engine

        if batch is None:
            raise ValueError(f"{engine.name}'s traffic is counted in a step: pass a batch")
        with megatron_engine.counted_collectives() as traffic:
            engine.step(*batch)
        return {"padding_bytes": megatron_engine.padding_bytes(engine.name, engine.model), **traffic}
    if engine.name == "deepspeed":
        from vescale_plugins.bench import deepspeed_engine

        return deepspeed_engine.padding_and_traffic(
            engine.model, settings.mixed_precision, free_after_forward(settings)
        )
    world = dist.get_world_size() // settings.replicate  # the shard group's ranks
    gather_itemsize = 2 if settings.mixed_precision else 4
    reduce_itemsize = 4
    if engine.name == "vescale":
        # Whatever units the front end chose (its own wrap policy), the root last.
        found = groups_under([engine.model])
        found.sort(key=lambda unit: unit.is_root)
        padding = sum(b.layout.padding for unit in found for b in unit.dbuffers) // world
        unit_elements = [sum(b.layout.buffer_size for b in unit.dbuffers) for unit in found]
        reshard = [unit.reshard_after_forward for unit in found]
    else:
        groups = [names for names, _ in engine.units] if engine.units is not None else None
        # FSDP2's engine holds the bench model itself (sharded in place).
        model = cast(BenchModel, engine.model)
        units = [u if isinstance(u, list) else [u] for u in _units(model, groups)]  # ..., the root last
        reshard = (
            [r for _, r in engine.units] if engine.units is not None else [settings.reshard_after_forward] * len(units)
        )
        padding, unit_elements = 0, []
        for group in units:
            params = [p for unit in group for name, p in unit.named_parameters() if not _in_child_unit(unit, name)]
            padded = sum(
                math.ceil(p.shape[0] / world) * world * (p.numel() // max(p.shape[0], 1)) if p.dim() else world
                for p in params
            )
            padding += (padded - sum(p.numel() for p in params)) // world
            unit_elements.append(padded)
    # A unit that reshards after forward is gathered for forward and again for backward;
    # reshard_after_forward=None reshards every unit but the root (FSDP2's default).
    resharded = [r if r is not None else i < len(reshard) - 1 for i, r in enumerate(reshard)]
    gathered = sum(n * (2 if again else 1) for n, again in zip(unit_elements, resharded)) * gather_itemsize
    reduced = sum(unit_elements) * reduce_itemsize
    # Collective buffer sizes (all-gather output, reduce-scatter input), summed over a step.
    return {
        "padding_bytes": padding * 4,
        "all_gather_bytes_per_step": gathered,
        "reduce_scatter_bytes_per_step": reduced,
    }


def _in_child_unit(unit: nn.Module, param_name: str) -> bool:
    """Whether ``unit.<param_name>`` lives in a nested unit (counted there, not here)."""
    module = unit
    for part in param_name.split(".")[:-1]:
        module = getattr(module, part)
        if module is not unit and (
            hasattr(module, "_get_fsdp_state") or getattr(module, "_vescale_fsdp_unit", None) is not None
        ):
            return True
    return False


# FSDP2's copy-in / copy-out ops; veScale-FSDP has none of them (tests/dbuffer/test_zero_copy.py).
_REORDERING_COPIES = ("aten::split_with_sizes_copy", "aten::_chunk_cat", "aten::cat")


def _inside(event: Any, predicate: Callable[[str], bool]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if predicate(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def copy_ms(engine: Engine, tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
    """CPU ms of one step spent in the copies that reorder data around the collectives.

    Counted: split/chunk-cat/cat and any copy inside a ``*copy_in*``/``*copy_out*`` region of
    the engine's collective path (FSDP2 labels them so). Not counted: casts, and what the
    backend does inside its own collective calls. ``None`` for the peers (DeepSpeed,
    Megatron-FSDP): their collective paths are not labelled in the profiler, so their copies
    cannot be told from the model's.
    """
    if engine.name in PEER_ENGINES:
        return None
    from torch.profiler import ProfilerActivity

    from vescale_plugins.observe.quiet_profiler import profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step(tokens, targets)
    total_us = 0.0
    for event in prof.events():
        in_library = _inside(event, lambda n: n.startswith(("FSDP::", "vescale::")))
        if not in_library or _inside(event, lambda n: n.startswith("c10d::")):
            continue
        reordering = event.name in _REORDERING_COPIES
        staged = (
            event.name == "aten::copy_"
            and _inside(event, lambda n: "copy_in" in n or "copy_out" in n)
            and not _inside(event, lambda n: n in _REORDERING_COPIES)
        )
        if reordering or staged:
            total_us += event.cpu_time_total
    return total_us / 1e3


_WRAPPER_PREFIXES = ("_forward_module.", "module.", "_orig_mod.")


def _strip_wrappers(name: str) -> str:
    """A parameter or module name as in the user's model (front-end wrappers' prefixes removed)."""
    while (name + ".").startswith(_WRAPPER_PREFIXES):
        name = name.split(".", 1)[1] if "." in name else ""
    return name


def parameter_names(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by their name in the user's model (front-end wrappers' prefixes removed)."""
    return {_strip_wrappers(name): param for name, param in model.named_parameters()}
