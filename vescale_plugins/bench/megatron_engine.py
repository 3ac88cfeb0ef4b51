"""Megatron-FSDP as two more engines: the same model, data, seed, optimizer and units as the others.

``megatron-fsdp`` is version 1, ``megatron_fsdp.fully_shard`` (a ``MegatronFSDP`` wrapper
over the model, ZeRO-3: ``zero_dp_strategy="optim_grads_params"``); ``megatron-fsdp-v2`` is
the experimental per-module ``megatron_fsdp.experimental.fully_shard`` of the same package,
with every buffer ``Flat`` (parameters, gradients and optimizer state sharded). Both take the
units the others do, as each version can express them:

- version 1 chooses units by class (``fsdp_unit_modules``): the classes of the model's units'
  modules (the Llama: ``Embedding``, ``DecoderLayer``, ``RMSNorm``, ``Linear``; a class nested
  in a unit already found is skipped, so ``lm_head`` and the final norm become units of their own);
- version 2 shards one module at a time, bottom-up: every module of every unit, then the root.

Version 1's ``fully_shard`` takes a zero-gradient optimizer step at set-up (weight decay
applied once, AdamW's step count 1), which no other engine takes; here that step runs with a
learning rate of 0 and the step counts are put back to 0, so it changes nothing and every
engine starts from the same state (:func:`_neutral_setup_step`). On a CPU the engines run under
the stand-ins of :mod:`vescale_plugins.bench.megatron_cpu`; version 1 also reduces without
``PREMUL_SUM`` (``gradient_reduce_div_fusion=False``: it scales, then sums), which gloo lacks.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from vescale_plugins.bench.megatron_cpu import cpu_stand_ins

__all__ = [
    "MEGATRON_ENGINES",
    "build",
    "counted_collectives",
    "full_parameters",
    "padding_bytes",
    "sharded_state_bytes",
    "unit_classes",
]

MEGATRON_ENGINES = ("megatron-fsdp", "megatron-fsdp-v2")


def unit_classes(units: Sequence[Sequence[nn.Module]]) -> list[type[nn.Module]]:
    """Version 1's ``fsdp_unit_modules``: the classes of the units' modules."""
    return list(dict.fromkeys(type(module) for modules in units for module in modules))


@contextlib.contextmanager
def _neutral_setup_step(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Version 1's set-up step made a no-op: learning rate 0 while it runs (AdamW's decay
    ``p *= 1 - lr * wd`` and its update ``lr * m / ...`` are then exact no-ops), then each
    parameter's step count back to 0, so the first training step is every engine's first.

    ``fully_shard`` rebuilds the parameter groups from the optimizer's defaults (one group, as
    the bench's), so the defaults' rate is the one to restore."""
    rate = optimizer.defaults["lr"]
    optimizer.defaults["lr"] = 0.0
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    try:
        yield
    finally:
        optimizer.defaults["lr"] = rate
        for group in optimizer.param_groups:
            group["lr"] = rate
    for state in optimizer.state.values():
        if "step" in state:
            state["step"].zero_()


def _build_v1(
    model: nn.Module, units: Sequence[Sequence[nn.Module]], optimizer: torch.optim.Optimizer, device: torch.device
) -> tuple[Any, Any]:
    from megatron_fsdp import fully_shard

    # Version 1 wants a (data-parallel, tensor-parallel) mesh; a tensor-parallel size of 1.
    mesh = init_device_mesh(device.type, (dist.get_world_size(), 1), mesh_dim_names=("fsdp", "tp"))
    with _neutral_setup_step(optimizer):
        wrapped, optimizer = fully_shard(
            model,
            optimizer,
            device_mesh=mesh,
            dp_shard_dim="fsdp",
            tp_dim="tp",
            fsdp_unit_modules=unit_classes(units),
            zero_dp_strategy="optim_grads_params",
            device=device,
        )
    if device.type == "cpu":
        wrapped.ddp_config.gradient_reduce_div_fusion = False  # gloo has no PREMUL_SUM: scale, then sum
    return wrapped, optimizer


def _build_v2(
    model: nn.Module,
    units: Sequence[Sequence[nn.Module]],
    optimizer_for: Callable[[nn.Module], torch.optim.Optimizer],
) -> tuple[Any, Any]:
    from megatron_fsdp.experimental import Flat, Placements, fully_shard, fully_shard_optimizer

    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    placements = Placements(dp_axes=[0], parameter=[Flat()], gradient=[Flat()], optimizer=[Flat()])
    for modules in units:
        for module in modules:
            fully_shard(module, mesh, placements)
    fully_shard(model, mesh, placements)
    optimizer = optimizer_for(model)
    fully_shard_optimizer(optimizer)
    return model, optimizer


def _quiet_known_warnings() -> None:
    """Warnings that would repeat at every run (or step) and say nothing about the comparison."""
    # Its fallback when neither Transformer Engine nor Apex is installed (the CPU's case).
    warnings.filterwarnings("ignore", "Transformer Engine and Apex are not installed", UserWarning)
    # The collectives torch 2.13 renamed, called at every step.
    warnings.filterwarnings(
        "ignore", r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning
    )
    # Version 2's backward hooks on a unit whose inputs need no gradient (the embedding's).
    warnings.filterwarnings("ignore", "Full backward hook is firing when gradients are computed", UserWarning)
    # Version 1 compares its device with cuda:<current_device()>, which on a CPU is the stand-in's name.
    logging.getLogger("megatron_fsdp.megatron_fsdp").setLevel(logging.ERROR)


def build(
    name: str,
    model: nn.Module,
    units: Sequence[Sequence[nn.Module]],
    optimizer_for: Callable[[nn.Module], torch.optim.Optimizer],
    device: torch.device,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Engine ``name`` (one of :data:`MEGATRON_ENGINES`) over ``model`` with these ``units``
    (module lists, inner first; the root is sharded last): the module to call and its optimizer
    (``optimizer_for(module)``, adapted by Megatron-FSDP)."""
    _quiet_known_warnings()
    with cpu_stand_ins(device):
        if name == "megatron-fsdp":
            return _build_v1(model, units, optimizer_for(model), device)
        return _build_v2(model, units, optimizer_for)


def _gather_rows(p: DTensor) -> torch.Tensor:
    """A parameter whole from its row shards: each rank's rows (uneven in both versions, which
    DTensor's ``full_tensor`` refuses, as does gloo Megatron's own gather), padded to the most rows,
    gathered, trimmed and joined in rank order."""
    group = p.device_mesh.get_group(0)
    local = p.to_local()
    rows: list[int] = [0] * dist.get_world_size(group)
    dist.all_gather_object(rows, local.shape[0], group=group)
    padded = local.new_zeros((max(rows), *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g[:n] for g, n in zip(gathered, rows)]).view(p.shape)


def full_parameters(name: str, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter whole, by its name in the user's model (collectives: every rank alike)."""
    inner: nn.Module = module.get_submodule("module") if name == "megatron-fsdp" else module
    for param_name, p in inner.named_parameters():
        yield param_name, _gather_rows(cast(DTensor, p))


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages among ``tensors`` (a buffer shared by two roles counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _v1_groups(module: Any) -> list[Any]:
    return list(module.param_and_grad_buffer.parameter_groups)


def _v2_groups(module: nn.Module) -> list[Any]:
    return [group for m in module.modules() for group in getattr(m, "_parameter_groups", ())]


def _persistent_buffers(name: str, module: nn.Module) -> list[torch.Tensor]:
    """The sharded buffers the engine keeps across steps: weights (model and main), gradients."""
    if name == "megatron-fsdp":
        roles = ("model_weight_buffer", "main_weight_buffer", "main_grad_buffer")
        return [b.data for g in _v1_groups(module) for b in (getattr(g, r, None) for r in roles) if b is not None]
    roles = ("main_weight", "model_weight", "main_grad")
    return [b.local_buffer for g in _v2_groups(module) for b in (getattr(g, r, None) for r in roles) if b is not None]


def sharded_state_bytes(name: str, module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters (model and main copies), gradients and optimizer state this rank holds."""
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    local = [getattr(v, "_local_tensor", v) for v in state]
    return _bytes(_persistent_buffers(name, module)) + sum(t.numel() * t.element_size() for t in local)


def padding_bytes(name: str, module: nn.Module) -> int:
    """Padding per rank in fp32 bytes: each buffer's padded size less its parameters' elements,
    over the ranks (version 1 pads each bucket; version 2 pads each tensor's rows to the least
    common multiple of its buffer's row sizes)."""
    world = dist.get_world_size()
    if name == "megatron-fsdp":
        padded = [
            (g.model_weight_buffer.bucket_index.size, sum(p.numel() for p in g.params)) for g in _v1_groups(module)
        ]
    else:
        padded = [
            (g.main_weight.layout.size, sum(s.numel() for s in g.main_weight.layout.tensor_shapes))
            for g in _v2_groups(module)
        ]
    return sum(size - used for size, used in padded) // world * 4


@contextlib.contextmanager
def counted_collectives() -> Iterator[dict[str, int]]:
    """Bytes Megatron-FSDP's collectives move while the block runs, as the bench counts them for
    the others: all-gather output, reduce-scatter input (an all-reduce counts as one of each)."""
    counts = {"all_gather_bytes_per_step": 0, "reduce_scatter_bytes_per_step": 0}
    originals = {n: getattr(dist, n) for n in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")}

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    # torch's own parameter names: Megatron-FSDP passes them as keywords.
    def all_gather_into_tensor(output_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counts["all_gather_bytes_per_step"] += nbytes(output_tensor)
        return originals["all_gather_into_tensor"](output_tensor, *args, **kwargs)

    def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counts["reduce_scatter_bytes_per_step"] += nbytes(input)
        return originals["reduce_scatter_tensor"](output, input, *args, **kwargs)

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counts["all_gather_bytes_per_step"] += nbytes(tensor)
        counts["reduce_scatter_bytes_per_step"] += nbytes(tensor)
        return originals["all_reduce"](tensor, *args, **kwargs)

    replacements = {
        "all_gather_into_tensor": all_gather_into_tensor,
        "reduce_scatter_tensor": reduce_scatter_tensor,
        "all_reduce": all_reduce,
    }
    for n, fn in replacements.items():
        setattr(dist, n, fn)
    try:
        yield counts
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
