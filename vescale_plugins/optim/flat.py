"""Contiguous runs of parameters: the unit of a group-level (flat) optimizer step.

Parameters sharded by ``fully_shard`` are views of one sharded DBuffer per unit and their
gradients views of one sharded gradient buffer with the same layout. A *run* is a maximal
sequence of such parameters, in storage order, whose gradients sit at the same relative
offsets and that are separated by at most alignment padding (so nothing else lives between
them, or by a sharded DBuffer's padding). A run is stepped as one flat tensor (one kernel per run instead of one per parameter).
Any other parameter (a plain tensor, or one whose gradient is its own tensor) is a run of one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from vescale_plugins.dbuffer.planning import ALIGNMENT_BYTES
from vescale_plugins.runtime.registry import dbuffer_of

__all__ = ["Member", "Run", "contiguous_runs", "local_of"]


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor, else the tensor itself."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


@dataclass
class Member:
    """One parameter of a run; ``offset`` is its first element's index in the run (elements)."""

    param: torch.Tensor
    local: torch.Tensor
    grad: torch.Tensor
    offset: int

    @property
    def numel(self) -> int:
        return self.local.numel()


@dataclass
class Run:
    """Parameters stepped as one flat tensor of ``span`` elements (gaps are padding)."""

    members: list[Member]
    span: int
    param_flat: torch.Tensor
    grad_flat: torch.Tensor
    gaps: list[tuple[int, int]] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        """Identifies the run's layout: same key, same flat state buffers."""
        return (self.span, tuple((id(m.param), m.offset, tuple(m.local.shape)) for m in self.members))


def _storage_offset(t: torch.Tensor) -> int:
    # Runs are found by storage address, so on eager tensors, whose offsets are ints (torch
    # types them ``int | SymInt`` for traced code).
    offset = t.storage_offset()
    assert isinstance(offset, int)
    return offset


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.dtype, t.device)


def contiguous_runs(params: list[torch.Tensor]) -> list[Run]:
    """Split parameters (each with a ``.grad``) into runs; order within a run is storage order."""
    by_storage: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    singles: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for p in params:
        assert p.grad is not None  # callers pass the parameters that have gradients
        local, grad = local_of(p), local_of(p.grad)
        entry = (p, local, grad)
        if local.numel() and local.is_contiguous() and grad.is_contiguous() and grad.dtype == local.dtype:
            key = (_storage_key(local), _storage_key(grad), _storage_offset(grad) - _storage_offset(local))
            by_storage.setdefault(key, []).append(entry)
        else:
            singles.append(entry)
    runs: list[Run] = [_run([e]) for e in singles]
    for entries in by_storage.values():
        entries.sort(key=lambda e: _storage_offset(e[1]))
        # DBuffer aligns every parameter: a gap shorter than the alignment is padding, never a tensor.
        align = max(1, ALIGNMENT_BYTES // entries[0][1].element_size())
        padding = _storage_padding(entries[0][0], entries[0][1])
        current = [entries[0]]
        for entry in entries[1:]:
            previous_end = _storage_offset(current[-1][1]) + current[-1][1].numel()
            start = _storage_offset(entry[1])
            padding_only = previous_end <= start and (
                (start - previous_end < align and start % align == 0) or _is_padding(padding, previous_end, start)
            )
            if padding_only:
                current.append(entry)
            else:
                runs.append(_run(current))
                current = [entry]
        runs.append(_run(current))
    return runs


def _storage_padding(param: torch.Tensor, local: torch.Tensor) -> list[tuple[int, int]] | None:
    """The padding of the sharded DBuffer ``param`` is a view of, as element offsets into its
    storage (that of ``local``); ``None`` for a parameter no DBuffer holds."""
    dbuffer = dbuffer_of(param)
    if dbuffer is None or dbuffer.sharded.untyped_storage().data_ptr() != local.untyped_storage().data_ptr():
        return None
    base = _storage_offset(dbuffer.sharded)
    return [(base + start, base + end) for start, end in dbuffer.sharded_padding()]


def _is_padding(padding: list[tuple[int, int]] | None, start: int, end: int) -> bool:
    """Whether storage elements ``[start, end)`` are DBuffer padding (no parameter lives there)."""
    if padding is None:
        return False
    covered = start
    for a, b in padding:
        if a <= covered < b:
            covered = b
    return covered >= end


def _run(entries: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Run:
    first_local, first_grad = entries[0][1], entries[0][2]
    base = _storage_offset(first_local)
    last = entries[-1][1]
    span = _storage_offset(last) + last.numel() - base
    members = [Member(p, local, grad, _storage_offset(local) - base) for p, local, grad in entries]
    if len(entries) == 1:
        # Stepped in its own shape (it may be a non-contiguous plain tensor).
        return Run([Member(entries[0][0], first_local, first_grad, 0)], first_local.numel(), first_local, first_grad)
    param_flat = first_local.as_strided((span,), (1,), base)
    grad_flat = first_grad.as_strided((span,), (1,), _storage_offset(first_grad))
    gaps = []
    for a, b in zip(members, members[1:]):
        if a.offset + a.numel < b.offset:
            gaps.append((a.offset + a.numel, b.offset))
    return Run(members, span, param_flat, grad_flat, gaps)
