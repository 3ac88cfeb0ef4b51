"""Healing a torchft replica group from a live one, for both our engine and FSDP2.

torchft (``pip install torchft``; not a dependency of this package) heals a restarted
replica group by sending it a live group's state dict through a checkpoint transport. Its
``PGTransport`` sends each tensor's whole ``untyped_storage()``: a shard of one of our units is
a view into the unit's flat buffer, so it would send that buffer once per parameter (and
FSDP2's shards, their padding). :class:`PGTransport` here is torchft's, over tensors that own
exactly their bytes (:func:`own_storages`: the same memory, no copy), so a heal sends each
shard's elements once. :class:`FlatBufferTransport` goes further: one message per flat buffer
(a unit's DBuffer, a flat optimizer state) instead of one per tensor. Use either wherever
torchft's is constructed (docs/fault_tolerance.md)::

    from vescale_plugins.checkpoint.fault_tolerance import FlatBufferTransport

    transport = FlatBufferTransport(pg, timeout=timedelta(seconds=60), device=device)
    manager = torchft.Manager(pg=pg, checkpoint_transport=transport, ...)
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten
from torchft.checkpointing.pg_transport import PGTransport as _TorchftPGTransport
from torchft.process_group import ProcessGroup

from vescale_plugins.ragged.dtensor import buffer_view, with_own_bytes

__all__ = ["FlatBufferTransport", "PGTransport", "own_storages"]

T = TypeVar("T")


def own_storages(state_dict: T) -> T:
    """``state_dict`` with every tensor (and DTensor's local tensor) over a storage of exactly
    its bytes: views of the same memory, no copy. For a serialisation, not to keep."""
    return tree_map(with_own_bytes, state_dict)


class PGTransport(_TorchftPGTransport[T]):
    """torchft's ``PGTransport`` sending (and receiving in place into) tensors that own exactly
    their bytes: a heal sends each shard once, not its unit's whole buffer per parameter."""

    def __init__(
        self,
        pg: ProcessGroup | torch.distributed.ProcessGroup,
        timeout: timedelta,
        device: torch.device,
        state_dict: Callable[[], object] | None = None,
    ) -> None:
        def own_state_dict() -> object:
            assert state_dict is not None
            return own_storages(state_dict())

        super().__init__(pg, timeout, device, own_state_dict if state_dict is not None else None)

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        super().send_checkpoint(dst_ranks, step, own_storages(state_dict), timeout)


@dataclass
class _Leaf:
    """Where one tensor leaf lies in the messages: its message, its byte offset there, and its
    dtype, shape and stride (a DTensor's: of its local tensor, with its spec)."""

    message: int
    offset: int
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    spec: object | None  # the DTensor's spec (DTensorSpec), or None for a plain tensor


@dataclass
class _Meta:
    step: int
    treespec: TreeSpec
    leaves: list[_Leaf | object]
    sizes: list[int]  # bytes of each message


def _span_bytes(tensor: torch.Tensor) -> int:
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))) * (
        tensor.element_size()
    )


def _bytes_of(storage: torch.UntypedStorage, device: torch.device, start: int, stop: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (stop - start,), (1,))


class FlatBufferTransport(_TorchftPGTransport[T]):
    """A heal in one message per flat buffer: torchft's ``PGTransport`` interface (give it to
    ``torchft.Manager(checkpoint_transport=...)`` with the manager's process group), sending
    what several state-dict entries share once.

    Entries that are views of one storage (the shards of one of our units' DBuffers, the
    states of a flat optimizer) are sent as one message: the bytes from the first entry's to
    the last one's, a view, no copy. Entries that own a storage under ``pack_below`` bytes
    (step counters, biases, norms: FSDP2's and stock optimizers' small states) are copied into
    one packed message; larger ones go one message each, as views. The receiver allocates one
    buffer per message and hands out views of it, which ``load_state_dict`` copies from.
    """

    def __init__(
        self,
        pg: ProcessGroup | torch.distributed.ProcessGroup,
        timeout: timedelta,
        device: torch.device,
        pack_below: int = 1 << 16,
    ) -> None:
        super().__init__(pg, timeout, device)
        self._pack_below = pack_below

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        flat, treespec = tree_flatten(state_dict)
        spans: dict[tuple[int, torch.device], list] = {}  # storage -> [start, stop, storage, leaf indices]
        locals_: dict[int, torch.Tensor] = {}
        for index, value in enumerate(flat):
            if not isinstance(value, torch.Tensor):
                continue
            # A view into the whole buffer again where the state dict holds one over its own bytes.
            local = buffer_view(value._local_tensor if isinstance(value, DTensor) else value)
            locals_[index] = local
            storage = local.untyped_storage()
            start = local.storage_offset() * local.element_size()
            stop = start + _span_bytes(local)
            span = spans.setdefault((storage._cdata, local.device), [start, stop, storage, []])
            span[0], span[1] = min(span[0], start), max(span[1], stop)
            span[3].append(index)
        messages: list[torch.Tensor] = []
        packed: list[tuple[int, torch.Tensor, int]] = []  # (leaf, its bytes, byte offset in the pack)
        packed_size = 0
        where: dict[int, tuple[int, int]] = {}  # leaf -> (message, byte offset in it)
        for (_, device), (start, stop, storage, indices) in spans.items():
            if len(indices) == 1 and stop - start < self._pack_below:
                own = locals_[indices[0]].contiguous().reshape(-1).view(torch.uint8)
                packed_size = -(-packed_size // 16) * 16  # aligned for every dtype
                packed.append((indices[0], own, packed_size))
                packed_size += own.numel()
                continue
            for index in indices:
                local = locals_[index]
                where[index] = (len(messages), local.storage_offset() * local.element_size() - start)
            messages.append(_bytes_of(storage, device, start, stop))
        if packed:
            pack = torch.empty(packed_size, dtype=torch.uint8, device=self._device)
            for index, own, offset in packed:
                pack[offset : offset + own.numel()].copy_(own)
                where[index] = (len(messages), offset)
                locals_[index] = locals_[index].contiguous()  # its layout in the pack
            messages.append(pack)
        leaves: list[_Leaf | object] = []
        for index, value in enumerate(flat):
            if index not in locals_:
                leaves.append(value)
                continue
            local = locals_[index]
            message, offset = where[index]
            spec = value._spec if isinstance(value, DTensor) else None
            leaves.append(_Leaf(message, offset, local.dtype, local.shape, local.stride(), spec))
        meta = _Meta(step, treespec, leaves, [m.numel() for m in messages])
        self._send(dst_ranks, meta, messages, timeout)

    def _send(self, dst_ranks: list[int], meta: _Meta, messages: list[torch.Tensor], timeout: timedelta) -> None:
        buf = pickle.dumps(meta)
        len_t = torch.tensor([len(buf)], dtype=torch.int64, device=self._device)
        buf_t = torch.frombuffer(bytearray(buf), dtype=torch.uint8).to(self._device)
        work = []
        for dst in dst_ranks:
            work += [self._pg.send([len_t], dst, tag=1), self._pg.send([buf_t], dst, tag=2)]
        for i, message in enumerate(messages):
            message = message.to(self._device)
            work += [self._pg.send([message], dst, tag=3 + i) for dst in dst_ranks]
        for w in work:
            w.wait(timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        len_t = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._pg.recv([len_t], src_rank, tag=1).wait(timeout)
        buf = torch.empty(int(len_t.item()), dtype=torch.uint8, device=self._device)
        self._pg.recv([buf], src_rank, tag=2).wait(timeout)
        meta: _Meta = pickle.loads(buf.cpu().numpy().tobytes())
        if meta.step != step:
            raise RuntimeError(f"FlatBufferTransport: received the state of step {meta.step}, expected {step}")
        messages = [torch.empty(size, dtype=torch.uint8, device=self._device) for size in meta.sizes]
        work = [self._pg.recv([m], src_rank, tag=3 + i) for i, m in enumerate(messages)]
        for w in work:
            w.wait(timeout)
        values = []
        for leaf in meta.leaves:
            if not isinstance(leaf, _Leaf):
                values.append(leaf)
                continue
            message = messages[leaf.message]
            itemsize = torch.empty(0, dtype=leaf.dtype).element_size()
            local = torch.empty(0, dtype=leaf.dtype, device=self._device).set_(
                message.untyped_storage(), leaf.offset // itemsize, leaf.shape, leaf.stride
            )
            values.append(local if leaf.spec is None else DTensor(local, leaf.spec, requires_grad=False))
        return tree_unflatten(values, meta.treespec)
