"""torchtitan 0.3.0 on CPU with gloo, with its ``fully_shard`` swapped for an engine's.

The CPU adaptations, the only ones the torchtitan tests make (``torchtitan_on_cpu_with``,
``trainer_on_cpu``, ``same_initial_values``):
- torchtitan picks ``"cuda"`` as its device type when no accelerator is visible;
- its ``FlexAttention`` calls a ``torch.compile``'d ``flex_attention``, which (compiled or
  eager) has no CPU backward: SDPA with the block mask made dense stands in;
- gloo has no ``PREMUL_SUM``, which FSDP2 asks for even with torchtitan's divide factor of 1
  (``disable_fsdp_gradient_division``); ``set_force_sum_reduction_for_comms(True)`` next to
  it makes that the plain sum it amounts to;
- DTensor's random init depends on the layout on CPU: both engines start from the weights
  torchtitan's ``init_weights`` gives an unsharded copy.
The trainer (``torchtitan.trainer.Trainer``) needs two more:
- its metrics' device memory monitor reads CUDA's allocator statistics, which ``torch.cpu``
  does not have: a monitor that reports zeros stands in;
- after its first step it lowers every process group's timeout and barriers on the CUDA
  device (``set_pg_timeouts``): the gloo workers are shared by the tests and keep the
  launcher's timeout, so that call is skipped.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch
from torch.torch_version import TorchVersion

# Both torchtitan test modules' first mark.
NEEDS_TORCH_215 = pytest.mark.skipif(
    TorchVersion(torch.__version__) < "2.15",
    reason=f"torchtitan 0.3.0 needs torch>=2.15 (DataParallelMeshDims, set_timeout); this is {torch.__version__}",
)


@contextlib.contextmanager
def torchtitan_on_cpu_with(fully_shard) -> Iterator[None]:
    """torchtitan's modules patched for the CPU (see the module's docstring) and its
    ``fully_shard`` swapped for ``fully_shard``; restored after (the gloo workers live on)."""
    import torchtitan.distributed.fsdp as fsdp
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tt_utils
    from torchtitan.models.common.attention import FlexAttention

    disable_division = fsdp.disable_fsdp_gradient_division

    def disable_division_and_premul(model: torch.nn.Module) -> None:
        disable_division(model)  # a factor of 1: PREMUL_SUM(1.0) is SUM, which gloo has
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)

    with patched(
        [
            (tt_utils, "device_type", "cpu"),
            (tt_utils, "device_module", torch.cpu),
            (parallel_dims, "device_type", "cpu"),
            (FlexAttention, "_compiled_flex_attn", _dense_flex_attention),
            (fsdp, "disable_fsdp_gradient_division", disable_division_and_premul),
            (fsdp, "fully_shard", fully_shard),  # what apply_fsdp_to_decoder calls
        ]
    ):
        yield


@contextlib.contextmanager
def trainer_on_cpu() -> Iterator[None]:
    """What ``Trainer`` needs on CPU besides ``torchtitan_on_cpu_with`` (see the module's
    docstring); ``LOCAL_RANK``, which torchtitan's launcher sets, from the rank."""
    import torch.distributed as dist
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.utils as dist_utils

    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    with patched(
        [
            (metrics, "device_type", "cpu"),
            (metrics, "device_module", torch.cpu),
            (metrics, "build_device_memory_monitor", _CpuMemoryMonitor),
            (dist_utils, "device_type", "cpu"),
            (dist_utils, "device_module", torch.cpu),
            (dist_utils, "set_pg_timeouts", _keep_pg_timeouts),
        ]
    ):
        yield


class _CpuMemoryMonitor:
    """``DeviceMemoryMonitor``'s surface, reporting zeros: ``torch.cpu`` has no allocator stats."""

    device_name = "cpu"
    device_capacity_gib = 0.0

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0, 0.0, 0, 0.0, 0, 0)

    def reset_peak_stats(self) -> None:
        pass


def _keep_pg_timeouts(**_: object) -> None:
    """``set_pg_timeouts`` skipped: the shared gloo workers keep the launcher's timeout."""


@contextlib.contextmanager
def patched(patches: list[tuple[object, str, object]]) -> Iterator[None]:
    """Each ``(owner, name, value)`` set, the old values restored after."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _dense_flex_attention(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
    """``flex_attention`` for llama3's block-causal masks (no score_mod, no lse) as SDPA with
    the mask made dense: flex_attention has no CPU backward, compiled or eager."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    assert score_mod is None
    assert not return_aux.lse
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[-2], k.shape[-2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, AuxOutput()


def same_initial_values(model: torch.nn.Module, model_config) -> None:
    """Every parameter set to the value torchtitan's ``init_weights`` gives it in an unsharded
    copy of the model (seeded). A CPU adaptation: DTensor's random ops make a sharded
    parameter's values independent of its layout only on CUDA (the offset-based RNG tracker);
    on CPU each rank draws its local tensor from the same seed, so FSDP2's even shards and
    our ragged ones would start from different weights."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    with torch.device("meta"):
        reference = model_config.build()
    reference.to_empty(device="cpu")
    reference.init_weights(buffer_device=None)
    full = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        value = full[name.replace("_checkpoint_wrapped_module.", "")]
        p.copy_(distribute_tensor(value, p.device_mesh, p.placements))
