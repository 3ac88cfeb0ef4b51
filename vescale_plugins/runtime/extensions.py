"""FSDP2's all-gather extensions (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) on DBuffer.

A parameter whose sharded local tensor defines them (a tensor subclass such as torchao's
float8 weight, or a tensor given them as instance attributes) is all-gathered through them,
as FSDP2 does (``_fsdp_param.py``, ``_fsdp_collectives.py`` of torch 2.13): at each all-gather
``fsdp_pre_all_gather`` turns the local shard into its all-gather inputs, and once gathered
``fsdp_post_all_gather`` turns the gathered inputs into the unsharded parameter (at the first
all-gather it returns the parameter and the inner tensors to free at reshard; later it is
given the parameter as ``out=`` to refill).

On DBuffer the inputs of each kind live in a persistent :class:`~vescale_plugins.dbuffer.
input_buffers.InputBuffer` laid out from the parameter's DBuffer: the inputs are copied in
(one copy per all-gather, as the mixed-precision cast), gathered in place, and the gathered
inputs handed to ``fsdp_post_all_gather`` are views of the gathered buffer (no copy out).
Gradients are the parameter's own dtype and leave through the DBuffer's reduce-scatter as
any other gradient.

What FSDP2 lays out its own way is asked of the extension differently: FSDP2's shards are
even ``Shard(0)`` chunks, so an unevenly sharded parameter's inputs must be padded to the
chunk size; ours are the planner's rows, never padded, so every input must have the local
shard's rows as its dim 0 (float8 data, per-row or per-block scales do). An extension that
pads to FSDP2's chunk size is refused, on every rank, naming the parameter.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from vescale_plugins.dbuffer import DBuffer
from vescale_plugins.dbuffer.handles import GatherHandle
from vescale_plugins.dbuffer.input_buffers import InputBuffer
from vescale_plugins.dbuffer.planning import row_numel
from vescale_plugins.runtime.agreement import agree_across_ranks

__all__ = [
    "EXTENSION_HOOK",
    "ExtensionGather",
    "ExtensionParam",
    "check_extension_param",
    "defines_extension",
    "has_extension",
]

_PRE, _POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"
EXTENSION_HOOK = _PRE  # what has_extension asks for, for callers that ask it inline
_SIGNATURE = (
    "fsdp_pre_all_gather(self, mesh: DeviceMesh, outer_size: torch.Size, outer_stride: tuple[int, ...], "
    "module: nn.Module, mp_policy: MixedPrecisionPolicy)"
)


def has_extension(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a sharded local tensor) is all-gathered through its extension (FSDP2
    asks this of the local tensor at every all-gather, so instance attributes count)."""
    return hasattr(tensor, _PRE)


def defines_extension(param: torch.Tensor) -> bool:
    """Whether ``param``'s class defines the extension: its sharded local tensor is then an
    instance of that class (FSDP2's), not a view of a DBuffer."""
    return hasattr(type(param), _PRE) or hasattr(type(param), _POST)


def check_extension_param(
    fqn: str, param: torch.Tensor, shape: torch.Size, parallel: bool, own_mesh: bool, group_size: bool
) -> None:
    """What veScale-FSDP refuses of a parameter with an extension, before any collective.

    ``param``: the parameter or its sharded local tensor; ``shape``: the parameter's;
    ``parallel``: it is a TP/EP/SPMD DTensor; ``own_mesh``: ``shard_placement_fn`` gave it
    another mesh; ``group_size``: ``reshard_after_forward`` is an int.
    """
    pre, post = hasattr(param, _PRE), hasattr(param, _POST)
    if pre != post:
        raise ValueError(
            f"parameter {fqn!r}: both fsdp_pre_all_gather and fsdp_post_all_gather should be defined if "
            f"using all-gather extensions (its {type(param).__name__} defines only {_PRE if pre else _POST})"
        )
    if not pre:
        return
    arity = len(inspect.signature(getattr(param, _PRE)).parameters)
    if arity not in (1, 5):
        raise TypeError(
            f"parameter {fqn!r}: invalid fsdp_pre_all_gather{inspect.signature(getattr(param, _PRE))}; "
            f"expects {_SIGNATURE} (or the old fsdp_pre_all_gather(self, mesh))"
        )
    refused = (
        "is a tensor-parallel (DTensor) parameter"
        if parallel
        else "is placed on its own mesh by shard_placement_fn"
        if own_mesh
        else "is resharded to a group by reshard_after_forward=<int> (FSDP2 does not support it either)"
        if group_size
        else "has no rows to shard (0-dim or empty)"
        if len(shape) == 0 or shape.numel() == 0
        else None
    )
    if refused is not None:
        raise NotImplementedError(
            f"parameter {fqn!r} has FSDP2 all-gather extensions ({type(param).__name__}) and {refused}; "
            "vescale_plugins.fully_shard runs the extensions of plain data-parallel parameters only: "
            "keep this parameter a plain tensor or use torch.distributed.fsdp.fully_shard for this model"
        )


class ExtensionParam(Protocol):
    """What the extensions read of a managed parameter (``runtime.param.FSDPParam``): its
    name, slot, DBuffer, the mesh its unit was given, the modules holding it, its sharded
    face and unsharded face."""

    @property
    def fqn(self) -> str: ...

    @property
    def slot(self) -> int: ...

    @property
    def dbuffer(self) -> DBuffer: ...

    @property
    def unit_mesh(self) -> DeviceMesh: ...

    @property
    def owners(self) -> tuple[tuple[nn.Module, str], ...]: ...

    @property
    def sharded(self) -> Any: ...

    @property
    def unsharded(self) -> nn.Parameter | None: ...

    @property
    def unsharded_by_extension(self) -> bool: ...


@dataclass
class _Gathered:
    """One parameter's extension state between its pre- and post-all-gather (FSDP2's
    ``ExtensionsData``) and the inner tensors its post-all-gather asked to free at reshard."""

    metadata: Any = None
    trailing: tuple[tuple[int, ...], ...] = ()  # each input's shape after dim 0
    inner_to_free: list[torch.Tensor] = field(default_factory=list)


class ExtensionGather:
    """The extension all-gathers of one DBuffer's parameters (see the module docstring); made
    again when the parameters move to another DBuffer (``to_empty``, ``module.to``)."""

    def __init__(self, dbuffer: DBuffer) -> None:
        self.dbuffer = dbuffer
        self._signature: tuple | None = None
        # Each input buffer and the (slot, input index) it holds of each parameter.
        self.inputs: list[tuple[InputBuffer, list[tuple[int, int]]]] = []
        self._buffers_of: dict[int, list[InputBuffer]] = {}  # each slot's, in its inputs' order
        self.gathered: dict[int, _Gathered] = {}
        self.ran_on: set[int] = set()  # slots the last all-gather ran through their extension
        self.awaiting_post: set[int] = set()  # of those, the ones not yet post-all-gathered

    @property
    def is_unsharded(self) -> bool:
        return bool(self.inputs) and all(b.is_unsharded for b, _ in self.inputs)

    def all_gather(
        self, members: Sequence[ExtensionParam], mp_policy: MixedPrecisionPolicy, async_op: bool
    ) -> list[GatherHandle]:
        """Run each member's pre-all-gather, copy its inputs in and gather every input buffer."""
        first = self._signature is None
        inputs: dict[int, list[torch.Tensor]] = {}
        running: list[str] = [""]  # the parameter whose pre-all-gather runs (named if it fails)

        def pre_all_gathers() -> dict[int, list[torch.Tensor]]:
            for p in members:
                running[0] = p.fqn
                inputs[p.slot] = self._pre_all_gather(p, mp_policy)
            return inputs

        if first:
            # The inputs' layout is built once, from every rank's answer: an extension that fails
            # (any exception) or answers differently on some ranks fails the same way on all of
            # them, before the first all-gather.
            agree_across_ranks(
                pre_all_gathers,
                lambda _: self._signature_of(members, inputs),
                self.dbuffer.group,
                catch=(Exception,),
                explain=lambda error: (running[0], f"{type(error).__name__}: {error}"),
                remote_failure=_remote_extension_failure,
                mismatch=_extension_mismatch,
            )
        else:
            pre_all_gathers()
        signature = self._signature_of(members, inputs)
        if signature != self._signature:
            if not first:
                raise ValueError(
                    f"the all-gather inputs of {[p.fqn for p in members]} changed since the first all-gather "
                    "(another number, dtype or trailing shape): their buffers are laid out at the first one"
                )
            self._build(members, inputs)
            self._signature = signature
        with torch.no_grad():
            for buffer, pieces in self.inputs:
                for slot, index in pieces:
                    buffer.sharded_piece(slot).copy_(inputs[slot][index].reshape(-1))
        self.ran_on = {p.slot for p in members}
        self.awaiting_post = set(self.ran_on)
        return [buffer.all_gather(async_op=async_op) for buffer, _ in self.inputs]

    def _signature_of(self, members: Sequence[ExtensionParam], inputs: dict[int, list[torch.Tensor]]) -> tuple:
        """What every rank must agree on: each member's inputs' dtypes and trailing shapes."""
        return tuple(
            (p.fqn, tuple((str(t.dtype), self.gathered[p.slot].trailing[i]) for i, t in enumerate(inputs[p.slot])))
            for p in members
            if p.slot in inputs
        )

    def _pre_all_gather(self, fsdp_param: ExtensionParam, mp_policy: MixedPrecisionPolicy) -> list[torch.Tensor]:
        dbuffer = fsdp_param.dbuffer
        local = fsdp_param.sharded._local_tensor
        if local.device != dbuffer.device:  # CPU offload, as FSDP2
            local = local.to(dbuffer.device, non_blocking=True)
        pre = getattr(local, _PRE)
        mesh = _shard_mesh(fsdp_param.unit_mesh)
        slot = dbuffer.slots[fsdp_param.slot]
        if len(inspect.signature(pre).parameters) == 1:
            result, metadata = pre(mesh)
        else:
            module = fsdp_param.owners[0][0]
            result, metadata = pre(mesh, slot.shape, fsdp_param.sharded.stride(), module, mp_policy)
        if not isinstance(result, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in result):
            raise TypeError(
                f"parameter {fsdp_param.fqn!r}: fsdp_pre_all_gather must return (all_gather_inputs, metadata) "
                f"with all_gather_inputs a tuple of tensors, got {type(result).__name__}"
            )
        rows = slot.local_length // row_numel(slot.shape)
        for t in result:
            if t.ndim == 0 or t.shape[0] != rows or t.device != dbuffer.device:
                raise ValueError(
                    f"parameter {fsdp_param.fqn!r}: fsdp_pre_all_gather returned an all-gather input of shape "
                    f"{tuple(t.shape)} on {t.device}; veScale-FSDP shards by whole rows without padding (this "
                    f"rank holds {rows} of its {slot.shape[0]} rows), so each input must have the local shard's "
                    f"rows as dim 0 and be on {dbuffer.device}. An extension that pads to FSDP2's even chunk size "
                    "(from outer_size and the mesh size) needs torch.distributed.fsdp.fully_shard"
                )
        state = self.gathered.setdefault(fsdp_param.slot, _Gathered())
        state.metadata, state.trailing = metadata, tuple(tuple(t.shape[1:]) for t in result)
        return list(result)

    def _build(self, members: Sequence[ExtensionParam], inputs: dict[int, list[torch.Tensor]]) -> None:
        """One input buffer per (input position, dtype, elements per row against the
        parameter's): a buffer's members then fit the DBuffer's rank boundaries exactly."""
        kinds: dict[tuple[int, torch.dtype, Fraction], list[tuple[int, int]]] = {}
        dbuffer = self.dbuffer
        for p in members:
            param_row = row_numel(dbuffer.slots[p.slot].shape)
            for index, t in enumerate(inputs[p.slot]):
                per_row = row_numel(t.shape)
                kinds.setdefault((index, t.dtype, Fraction(per_row, param_row)), []).append((p.slot, per_row))
        self.inputs = []
        self._buffers_of = {p.slot: [] for p in members}
        # By input position, so each slot's buffers come in its inputs' order.
        for (index, dtype, _), pieces in sorted(kinds.items(), key=lambda kind: kind[0][0]):
            buffer = InputBuffer(dbuffer, pieces, dtype)
            self.inputs.append((buffer, [(slot, index) for slot, _ in pieces]))
            for slot, _ in pieces:
                self._buffers_of[slot].append(buffer)

    def post_all_gather(self, fsdp_param: ExtensionParam, param_dtype: torch.dtype) -> torch.Tensor | None:
        """The unsharded parameter's tensor from the gathered inputs (views), or ``None`` when
        the extension refilled the existing one (``out=``, every all-gather after the first)."""
        slot = fsdp_param.slot
        self.awaiting_post.discard(slot)
        state = self.gathered[slot]
        outputs = [b.gathered(slot).view(-1, *shape) for b, shape in zip(self._buffers_of[slot], state.trailing)]
        local = fsdp_param.sharded._local_tensor
        post = getattr(local, _POST)
        metadata, state.metadata = state.metadata, None
        if fsdp_param.unsharded is not None and fsdp_param.unsharded_by_extension:
            for tensor in state.inner_to_free:
                _alloc_storage(tensor)
            post(tuple(outputs), metadata, param_dtype, out=fsdp_param.unsharded)
            return None
        tensor, inner = post(tuple(outputs), metadata, param_dtype)
        state.inner_to_free = [t for t in inner if not any(b.holds(t) for b, _ in self.inputs)]
        shape = fsdp_param.dbuffer.slots[slot].shape
        return tensor if tensor.shape == shape else tensor.view(shape)

    def release(self) -> None:
        """Free the gathered inputs and the inner tensors the extensions asked to free."""
        for buffer, _ in self.inputs:
            buffer.release()
        for state in self.gathered.values():
            for tensor in state.inner_to_free:
                if tensor.untyped_storage().size():
                    tensor.untyped_storage().resize_(0)


def _alloc_storage(tensor: torch.Tensor) -> None:
    size = tensor.numel() * tensor.itemsize
    if tensor.untyped_storage().size() != size:
        tensor.untyped_storage().resize_(size)


def _shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh the extension is given: the shard dim's (FSDP2's ``shard_mesh``)."""
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("all-gather extensions on a 2-D mesh need its dims named (FSDP2's shard_mesh)")
    return mesh[names[-1]]


def _remote_extension_failure(rank: int, failed: tuple[str, str]) -> Exception:
    return RuntimeError(
        f"fsdp_pre_all_gather of parameter {failed[0]!r} failed on rank {rank} of the shard group: {failed[1]}"
    )


def _extension_mismatch(signatures: list[Any], own_rank: int) -> Exception:
    """The first rank whose inputs differ from this rank's, and the first parameter that does."""
    signature = tuple(signatures[own_rank])
    for rank, answer in enumerate(signatures):
        other = tuple(answer)
        if other != signature:
            differing = next((a[0] for a, b in zip(signature, other) if a != b), "the parameter list")
            return ValueError(
                f"all-gather extension inputs differ between ranks at {differing!r} (this rank {signature}, "
                f"rank {rank} {other}): every rank must give every parameter the same extension"
            )
    return ValueError("all-gather extension inputs differ between ranks")
