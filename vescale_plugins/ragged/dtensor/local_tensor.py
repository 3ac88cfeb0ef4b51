"""DTensors over DBuffer views: built without validation on the runtime's hot path, re-pointed
at new storage, copied or pickled even when the view sits at a storage offset, and handed to
consumers that read storages (pickling one entry, torchft's ``PGTransport``) over a storage of
their own bytes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils.weak import WeakTensorKeyDictionary

from vescale_plugins.ragged.dtensor.specs import (
    ORIGINAL,
)


def set_local_tensor(dtensor: DTensor, local: torch.Tensor) -> None:
    """Re-point a DTensor (e.g. a sharded parameter) at new local storage, keeping its identity.

    ``param.data = ...`` does not reach a DTensor's local tensor, so this sets it directly
    (FSDP2 does the same); the layout must not change.
    """
    if local.shape != dtensor._local_tensor.shape:
        raise ValueError(f"new local tensor {tuple(local.shape)} does not match {tuple(dtensor._local_tensor.shape)}")
    dtensor._local_tensor = local


def wrap_local(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool = False) -> DTensor:
    """``DTensor(local, spec, requires_grad=...)`` without its ``__init__``, which does nothing
    but pass through a Dynamo-disabling and an export-marking wrapper (six Python calls a
    tensor, eagerly): the gradients the runtime attaches each step are built here."""
    return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)


def make_dtensor(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: torch.Size,
    stride: tuple[int, ...],
    requires_grad: bool = False,
) -> DTensor:
    """A DTensor over ``local`` with no autograd edge and no validation (the runtime's hot path).

    Its wrapper has ``local``'s storage offset, as every DTensor's: Dynamo rebuilds a DTensor
    from its local tensor and refuses one whose wrapper disagrees (``torch.compile(opt.step)``
    over gradients at an offset). Copying and pickling it go through an offset-0 twin
    (:func:`dtensor_deepcopy`, :func:`dtensor_reduce_ex`).
    """
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return wrap_local(local, spec, requires_grad)


def dtensor_at_offset_zero(local: torch.Tensor, spec: DTensorSpec, requires_grad: bool) -> DTensor:
    """A DTensor over ``local`` whose wrapper has storage offset 0.

    DTensor's wrapper copies its local tensor's storage offset, and torch's ``deepcopy`` and
    pickling recognise a wrapper subclass by ``data_ptr() == 0``: over a view at an offset
    (a slice of a DBuffer, or a ``detach()`` of one, as ``state_dict()`` returns), the
    DTensor is taken for a tensor owning storage and copying or saving it fails. Built over
    an alias of the same storage at offset 0 (no copy), then pointed at the real view.
    """
    if local.storage_offset() == 0:
        return DTensor(local, spec, requires_grad=requires_grad)
    alias = torch.empty(0, dtype=local.dtype, device=local.device).set_(
        local.untyped_storage(), 0, local.shape, local.stride()
    )
    dtensor = DTensor(alias, spec, requires_grad=requires_grad)
    dtensor._local_tensor = local
    return dtensor


def _offset_free(self: DTensor) -> DTensor:
    twin = dtensor_at_offset_zero(self._local_tensor, self._spec, self.requires_grad)
    if self.grad is not None:
        twin.grad = self.grad
    return twin


def own_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` over a storage of exactly the bytes it spans: the same memory, no copy.

    A shard of a DBuffer is a view into the unit's whole flat buffer, so a consumer that
    serialises a tensor through its storage (``pickle`` of one entry, ``torch.save`` of one
    tensor, torchft's ``PGTransport``, which sends ``untyped_storage()`` whole) would send the
    whole buffer once per parameter. The returned tensor's storage is a slice of the buffer's
    (``UntypedStorage.__getitem__`` aliases the memory and keeps the buffer's storage object
    alive); writes through it land in the buffer. Valid while the buffer's storage is not
    resized (a DBuffer's sharded buffer is not while a parameter's data lives in it). An empty
    tensor gets the empty slice at its offset. A tensor that already owns exactly its bytes is
    returned as is.
    """
    if tensor.device.type == "meta" or type(tensor) is not torch.Tensor:
        return tensor
    itemsize = tensor.element_size()
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    storage = tensor.untyped_storage()
    start, nbytes = tensor.storage_offset() * itemsize, span * itemsize if tensor.numel() else 0
    start = min(start, storage.nbytes())  # an empty shard may sit at its buffer's end
    if start == 0 and storage.nbytes() == nbytes:
        return tensor
    own = storage[start : start + nbytes]
    result = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(own, 0, tensor.shape, tensor.stride())
    _VIEW_OF[result] = tensor
    return result


# own_bytes's results -> the views they were made from (not an attribute: pickling would write it).
_VIEW_OF = WeakTensorKeyDictionary()


def buffer_view(tensor: torch.Tensor) -> torch.Tensor:
    """The view into its buffer that :func:`own_bytes` made ``tensor`` from, else ``tensor``:
    for consumers that send a whole buffer at once (``FlatBufferTransport``)."""
    return _VIEW_OF.get(tensor, tensor)


def with_own_bytes(value: Any) -> Any:
    """A state-dict value whose tensor (a DTensor's local tensor) owns exactly its bytes.

    See :func:`own_bytes`; anything that is not a tensor is returned unchanged. Our shards and
    FSDP2's (whose storage is the shard plus its padding) alike.
    """
    if isinstance(value, DTensor):
        local = own_bytes(value._local_tensor)
        if local is value._local_tensor:
            return value
        return DTensor(local, value._spec, requires_grad=value.requires_grad)
    if isinstance(value, torch.Tensor):
        return own_bytes(value)
    return value


def dtensor_deepcopy(self: DTensor, memo: dict) -> DTensor:
    """``copy.deepcopy`` of any DTensor, also one whose wrapper has a storage offset."""
    if self.storage_offset() == 0 or id(self) in memo or not self.is_leaf:
        return ORIGINAL["__deepcopy__"](self, memo)
    twin = _offset_free(self)
    result = ORIGINAL["__deepcopy__"](twin, memo)
    memo[id(self)] = result
    memo.setdefault(id(memo), []).append(twin)  # as copy._keep_alive: the twin's id stays unique
    return result


def dtensor_reduce_ex(self: DTensor, protocol: int) -> Any:
    """Pickling (``torch.save``) of any DTensor, also one whose wrapper has a storage offset.

    Pickled over a local tensor that owns exactly its bytes (:func:`own_bytes`): a shard of a
    DBuffer pickled alone writes its own elements, not the unit's whole buffer.
    """
    local = own_bytes(self._local_tensor)
    if local is self._local_tensor and self.storage_offset() == 0:
        return ORIGINAL["__reduce_ex__"](self, protocol)
    twin = DTensor(local, self._spec, requires_grad=self.requires_grad)
    if self.grad is not None:
        twin.grad = self.grad
    return ORIGINAL["__reduce_ex__"](twin, protocol)
