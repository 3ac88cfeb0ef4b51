"""Flat buffers whose memory comes and goes while the tensor (and every view cut from it)
stays: how unsharded parameters and gradients are freed between uses."""

from __future__ import annotations

import torch

from vescale_plugins.dbuffer import observer

__all__ = ["ResizableStorage", "set_version_counter"]


class ResizableStorage:
    """A flat tensor whose storage is released and re-grown in place, so views survive (FSDP2
    does the same for its unsharded parameters). ``kind`` is what the observer is told.

    The tensor is made by the first :meth:`allocate`, on the stream current then (the
    all-gather stream for unsharded parameters), as FSDP2 makes its all-gather outputs at the
    first all-gather: made at construction and freed at once, each unit would pass through
    memory whole and, on CUDA, stay reserved in the compute stream's pool. On the meta device
    it is made at once (it costs nothing there).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, kind: str) -> None:
        self._numel, self._dtype, self._device = numel, dtype, device
        self.nbytes = numel * dtype.itemsize
        self.kind = kind
        self._tensor: torch.Tensor | None = None
        # Whether the storage holds its bytes: only this class resizes it, so a flag answers
        # (asked several times per unit per step; the storage object would be made each time).
        self._allocated = False
        if device.type == "meta":
            self._tensor = torch.empty(numel, dtype=dtype, device=device)
            self._allocated = self.nbytes > 0

    @property
    def tensor(self) -> torch.Tensor:
        """The flat tensor (views cut from it stay valid); made by the first ``allocate``."""
        assert self._tensor is not None, "allocate() makes the tensor"
        return self._tensor

    @property
    def allocated(self) -> bool:
        return self._allocated

    def allocate(self) -> torch.Tensor:
        if not self.allocated:
            watcher = observer.current()
            if watcher is not None:
                watcher.buffer_allocated(self.kind, self.nbytes)
            if self._tensor is None:
                self._tensor = torch.empty(self._numel, dtype=self._dtype, device=self._device)
            else:
                self._tensor.untyped_storage().resize_(self.nbytes)
            self._allocated = self.nbytes > 0
        return self.tensor

    def release(self) -> None:
        if self.allocated:
            watcher = observer.current()
            if watcher is not None:
                watcher.buffer_freed(self.kind, self.nbytes)
            if self._device.type != "meta":
                self.tensor.untyped_storage().resize_(0)
                self._allocated = False


def set_version_counter(tensor: torch.Tensor, version: int) -> None:
    """Reset ``tensor``'s autograd version counter (shared with all its views) to ``version``.

    The all-gather refills the storage that the unsharded parameters (saved for backward)
    alias, with the same values, so autograd must not see it as a modification. gloo's
    asynchronous all-gather writes from its own thread, after the call returns, so the
    version is restored when the collective is waited on. FSDP2 uses the same private API
    (through ``_unsafe_preserve_version_counter``) for its copy-out.
    """
    torch._C._autograd._unsafe_set_version_counter((tensor,), (version,))
