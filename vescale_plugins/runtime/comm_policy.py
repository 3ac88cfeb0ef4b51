"""``QuantizedComm``: which of a unit's collectives move block-quantized values (ZeRO++'s qwZ
and qgZ over RaggedShard blocks), beside FSDP2's ``MixedPrecisionPolicy``.

Off by default (``fully_shard(comm_policy=None)``): every collective exact, as FSDP2's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuantizedComm", "check_comm_policy", "check_quantizable_param"]

_FORMATS = ("int8",)


@dataclass(frozen=True)
class QuantizedComm:
    """Quantize a unit's collectives in blocks of the planner's layout.

    Args:
        weights: ``"int8"``: the parameters' all-gather moves int8 codes and one fp32 scale
            per block (symmetric, ``scale = amax / 127``), dequantized into the unsharded
            parameters in the compute dtype (``MixedPrecisionPolicy.param_dtype``). The
            sharded (master) parameters and the optimizer never see quantized values; each
            gathered element is within half a step (``scale / 2``) of its sharded value.
            ``None``: gathered exactly.
        grads: ``"int8"``: gradients are reduced through an all-to-all of int8 blocks, each
            rank summing every rank's dequantized blocks of its shard in fp32. ``None``:
            reduce-scattered exactly.
        block: elements per quantization block, about (rows longer than ``block`` are cut
            into equal runs of at most ``block`` elements, shorter rows grouped whole: see
            :func:`vescale_plugins.dbuffer.planning.quantization_block`). The planner keeps
            every block on one rank, so blocks are the same at every world size; bytes per
            element are about ``1 + 4 / block``.

    Parameters that are not floating point are always gathered exactly.
    """

    weights: str | None = "int8"
    grads: str | None = None
    block: int = 256

    def __post_init__(self) -> None:
        for field in ("weights", "grads"):
            value = getattr(self, field)
            if value is not None and value not in _FORMATS:
                raise ValueError(
                    f"QuantizedComm({field}={value!r}): supported formats are {_FORMATS} or None (exact); "
                    "fp8 (e4m3) is not implemented yet"
                )
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 2:
            raise ValueError(f"QuantizedComm(block={self.block!r}): give an int >= 2 (elements per block, e.g. 256)")

    @property
    def quant_block(self) -> int | None:
        """The block the planner and the buffers are asked for, or None when nothing is quantized."""
        return self.block if (self.weights or self.grads) else None


def check_quantizable_param(
    policy: QuantizedComm, fqn: str, param: torch.Tensor, *, parallel: bool, own_mesh: bool, extension: bool
) -> None:
    """Refuse, naming the parameter, what the quantized collectives do not handle yet
    (raised on every rank during set-up's agreement, before any collective of the unit)."""
    if policy.quant_block is None or not param.dtype.is_floating_point:
        return
    what = None
    if extension:
        what = "defines FSDP2 all-gather extensions (fsdp_pre_all_gather), which gather their own inputs"
    elif parallel:
        what = "is a tensor- or expert-parallel DTensor"
    elif own_mesh:
        what = "is placed on its own mesh by shard_placement_fn"
    if what is not None:
        raise ValueError(
            f"parameter {fqn!r} {what}: comm_policy=QuantizedComm(...) quantizes plain data-parallel parameters "
            "only; shard this module with comm_policy=None, or put the parameter in a unit of its own without it"
        )


def check_comm_policy(policy: object, offload: bool) -> None:
    """``fully_shard``'s ``comm_policy`` argument (given): a :class:`QuantizedComm`, and not
    with CPU offload (whose sharded parameters live in host memory) when it quantizes."""
    if not isinstance(policy, QuantizedComm):
        raise TypeError(f"comm_policy must be None or a QuantizedComm(...), got {type(policy).__name__}")
    if offload and policy.quant_block is not None:
        raise NotImplementedError(
            "comm_policy=QuantizedComm(...) with offload_policy=CPUOffloadPolicy(): quantized collectives of "
            "offloaded parameters are not implemented; drop one of the two for this unit"
        )
