"""Accelerate on the harness's gloo ranks, with the plugin sharding the test decoder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState
from torch.utils.data import DataLoader, TensorDataset

from accelerate_plugin import VeScaleFSDPPlugin
from tests.support.models import PER_RANK, batch

MAX_GRAD_NORM = 1.0  # below the decoder's gradient norms, so every step clips


@contextmanager
def accelerate_env(**env: str) -> Iterator[None]:
    """Accelerate's view of the harness's process group, and a clean Accelerate afterwards.

    Accelerate decides its state from environment variables; the harness already initialised
    the gloo group, so they only have to agree with it. Everything is restored on exit because
    the harness reuses worker processes across tests.
    """
    saved = dict(os.environ)
    world, rank = dist.get_world_size(), dist.get_rank()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        OMP_NUM_THREADS="1",
        **env,
    )
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        os.environ.clear()
        os.environ.update(saved)


def fsdp2_launch_env(wrap_cls: str, **more: str) -> dict[str, str]:
    """The variables ``accelerate launch`` with an FSDP2 config (``TRANSFORMER_BASED_WRAP``
    around the class named ``wrap_cls``) sets in each process, and ``more``."""
    return dict(
        ACCELERATE_USE_FSDP="true",
        FSDP_VERSION="2",
        FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP",
        FSDP_TRANSFORMER_CLS_TO_WRAP=wrap_cls,
        **more,
    )


def decoder_plugin(**kwargs: Any) -> VeScaleFSDPPlugin:
    """Units = the decoder's blocks (then the root), as ``shard_decoder`` makes them by hand."""
    return VeScaleFSDPPlugin(
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Block"], **kwargs
    )


def token_loader(micro_steps: int) -> DataLoader:
    """The harness's batches: Accelerate hands rank r, at micro-step k, ``local_batch(k)``."""
    world = dist.get_world_size()
    tokens, targets = zip(*(batch(k, world, PER_RANK) for k in range(micro_steps)))
    return DataLoader(TensorDataset(torch.cat(tokens), torch.cat(targets)), batch_size=PER_RANK)


def decaying_lr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9**step)
