"""DeepSpeed ZeRO-3, the third engine: the same model, data, seed and optimizer as the others.

The settings are the ones a careful user would choose for this model, not DeepSpeed's
defaults (whose 5e8-element reduce bucket alone is 1.9 GiB per rank): buckets sized to the
largest unit, so ZeRO-3 gathers and reduces about a unit at a time as FSDP does; on FSDP2's
schedule (parameters freed after forward, ``reshard_after_forward`` not false), parameters are
freed once used (``stage3_max_reuse_distance=0``, which only takes effect with a
``stage3_max_live_parameters`` cap: two units, the one in use and the prefetched one); the
persistence threshold keeps the 1-D parameters (norms) whole on every rank, sparing their
latency-bound gathers as DeepSpeed intends, and partitions every matrix as FSDP shards them
(DeepSpeed's default of 1e5 elements would keep this model's key and value projections whole
too); no offload; torch's AdamW, as for the others
(``zero_allow_untested_optimizer``). :func:`zero3_config` is the whole config, and the bench
prints it.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from vescale_plugins.bench.linear_stack import LinearStack
from vescale_plugins.bench.llama import Llama

__all__ = ["build", "full_parameters", "padding_and_traffic", "sharded_state_bytes", "zero3_config"]


def _largest_unit(model: Llama | LinearStack) -> int:
    """Elements of the model's largest unit (``fsdp_units``), the size of a bucket."""
    return max(sum(p.numel() for m in modules for p in m.parameters()) for _, modules in model.fsdp_units())


def zero3_config(
    model: Llama | LinearStack, batch_size: int, mixed_precision: bool, free_after_forward: bool
) -> dict[str, Any]:
    """The ZeRO-3 config the bench runs (see the module docstring for why each setting)."""
    unit = _largest_unit(model)
    vectors = max((p.numel() for p in model.parameters() if p.dim() < 2), default=0)
    zero: dict[str, Any] = {
        "stage": 3,
        "reduce_bucket_size": unit,
        "stage3_prefetch_bucket_size": unit,
        "stage3_param_persistence_threshold": vectors,  # parameters of at most this many elements stay whole
    }
    if free_after_forward:
        zero.update(stage3_max_live_parameters=2 * unit, stage3_max_reuse_distance=0)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
    }
    if mixed_precision:  # bf16 parameters and gathers, fp32 master weights and reduction (FSDP2's policy here)
        config.update(bf16={"enabled": True}, communication_data_type="fp32")
    return config


def build(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]) -> tuple[Any, Any]:
    """``deepspeed.initialize`` on the process group the launcher made: the engine (the
    model, wrapped) and its ZeRO-3 optimizer."""
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # what DeepSpeed's own launcher would set
    # DeepSpeed calls the collectives torch 2.13 renamed, warning at every step: noise in the bench's output.
    warnings.filterwarnings(
        "ignore", r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated", FutureWarning
    )
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, dist_init_required=False
    )
    return engine, ds_optimizer


def full_parameters(engine: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter's fp32 master value, whole, one at a time (collectives: every rank
    iterates alike)."""
    from deepspeed.utils import safe_get_full_fp32_param

    for name, p in engine.module.named_parameters():
        yield name, safe_get_full_fp32_param(p)


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def sharded_state_bytes(engine: Any) -> int:
    """Parameters, gradients, master weights and optimizer state this rank holds."""
    optimizer = engine.optimizer
    params = _bytes(p.ds_tensor for p in engine.module.parameters())
    master = _bytes(optimizer.fp32_partitioned_groups_flat)
    grads = _bytes([optimizer.grad_partitions_flat_buffer])
    state = _bytes(v for s in optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    return params + master + grads + state


def padding_and_traffic(engine: Any, mixed_precision: bool, free_after_forward: bool) -> dict[str, int]:
    """Padding per rank (fp32), and the all-gather / reduce bytes of a step, as for the others.

    Each partitioned parameter is padded to a multiple of the ranks on its own; gathered for
    forward and, when freed after it, again for backward; every gradient is reduced.
    """
    world = dist.get_world_size()
    params = list(engine.module.parameters())
    padded = [math.ceil(p.ds_numel / world) * world for p in params]
    partitioned = [(n, p) for n, p in zip(padded, params) if not p.ds_persist]
    padding = sum(n - p.ds_numel for n, p in partitioned) // world
    gathered = sum(n for n, _ in partitioned)
    return {
        "padding_bytes": padding * 4,
        "all_gather_bytes_per_step": gathered * (2 if mixed_precision else 4) * (2 if free_after_forward else 1),
        "reduce_scatter_bytes_per_step": sum(padded) * 4,
    }
