"""No optimizer step makes the host wait for the device: no scalar read back from a device
tensor, no host data copied to the device (each is a sync on CUDA).

CI has no GPU, so parameters live on the meta device: a read back or a copy from the host
to it shows as it would to CUDA. The first step builds state (quantisation maps are copied
once and cached); the steady-state second step is checked.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vescale_plugins.optim import AdamW, AdamW8bit, Muon

aten = torch.ops.aten


def _on_host(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


def _on_device(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


class _HostSyncs(TorchDispatchMode):
    """Records reads of device scalars and copies from host tensors to device tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten._local_scalar_dense.default and _on_device(args[0]):
            self.seen.append("item of a device tensor")
        elif func in (aten._to_copy.default, aten.copy_.default):
            source = args[1] if func is aten.copy_.default else args[0]
            if _on_host(source) and source.dim() and any(_on_device(t) for t in tree_leaves(out)):
                self.seen.append(f"{func} host -> device")
        return out


class _HostTensors(TorchFunctionMode):
    """Records tensors made from host data on a device (``torch.tensor(x, device=...)``),
    which the dispatcher does not see."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and torch.device(kwargs.get("device") or "cpu").type != "cpu":
            self.seen.append(f"{func.__name__}(..., device={kwargs['device']})")
        return func(*args, **kwargs)


def _meta_params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(64, 32, device="meta")), torch.nn.Parameter(torch.zeros(32, device="meta"))]


OPTIMIZERS = {
    "AdamW": lambda params: AdamW(params, lr=1e-2),
    "AdamW8bit": lambda params: AdamW8bit(params, lr=1e-2),
    "Muon": lambda params: Muon(params[:1], lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_step_never_syncs_the_host(name):
    params = _meta_params()
    optimizer = OPTIMIZERS[name](params)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    syncs, host_tensors = _HostSyncs(), _HostTensors()
    with host_tensors, syncs:
        optimizer.step()
    assert syncs.seen + host_tensors.seen == []
