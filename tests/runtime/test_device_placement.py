"""Which mesh and device ``fully_shard`` chooses, compared with FSDP2's choices on the same input.

CPU tests cannot build a CUDA mesh, so the accelerator is pretended: the default mesh's
device type is read from a patched ``torch._C._get_accelerator`` (mesh creation recorded,
a CPU mesh returned), and the states' target device is patched to ``meta``, which a CPU
tensor can really move to. Both implementations run under the same patches.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard

import vescale_plugins
from vescale_plugins.runtime import unit_device
from vescale_plugins.wrap import shard_model

T = 120
move_states_to_device = _fsdp_init._move_states_to_device  # FSDP2's, unpatched


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)  # buffers: running stats, the batch count

    def forward(self, x):
        return self.norm(self.proj(x))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()
        self.head = nn.Linear(4, 2)
        self.frozen = nn.Linear(2, 2)  # ignored: stays where it was built

    def forward(self, x):
        return self.frozen(self.head(self.block(x)))


def _shard(impl, model: nn.Module) -> None:
    ignored = set(model.frozen.parameters())
    impl(model.block)
    impl(model, ignored_params=ignored)


def _states(model: nn.Module) -> dict[str, str]:
    local = {n: getattr(p, "_local_tensor", p) for n, p in model.named_parameters()}
    return {n: str(t.device) for n, t in [*local.items(), *model.named_buffers()]}


def _default_mesh_device_types() -> dict[str, list[str]]:
    """The device type each implementation's default mesh asks for, on a pretend CUDA machine."""
    asked: dict[str, list[str]] = {}
    cpu_mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name, impl in (("torch", fsdp.fully_shard), ("vescale", vescale_plugins.fully_shard)):
        calls: list[str] = []

        def record(device_type, *args, calls=calls, **kwargs):
            calls.append(device_type)
            return cpu_mesh

        with (
            mock.patch.object(torch._C, "_get_accelerator", return_value=torch.device("cuda")),
            mock.patch.object(_fsdp_init, "init_device_mesh", record),
            mock.patch.object(unit_device, "init_device_mesh", record),
        ):
            _shard(impl, _Model())
        asked[name] = calls
    return asked


def test_default_mesh_is_the_accelerators_as_fsdp2(dist_run):
    asked = dist_run(_default_mesh_device_types, 2, timeout=T)[0]
    assert asked["torch"]
    assert set(asked["torch"]) == {"cuda"}
    assert asked["vescale"] == asked["torch"]


def _moved_states() -> dict[str, tuple[list[str], str]]:
    """Which of the model's parameters and buffers each implementation moves, and where to."""
    moved: dict[str, tuple[list[str], str]] = {}
    for name, impl in (
        ("torch", fsdp.fully_shard),
        ("vescale", vescale_plugins.fully_shard),
        # The Accelerate route: the auto-wrapped units, no mesh.
        ("vescale via shard_model", lambda m, **kw: shard_model(m, unit_fn=lambda _: [], **kw)),
    ):
        model = _Model()
        names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        calls: list[tuple[list[str], str]] = []

        def record(params, buffers, device, calls=calls, names=names):
            calls.append((sorted(names[id(t)] for t in [*params, *buffers]), str(device)))
            move_states_to_device(params, buffers, device)

        with (
            mock.patch.object(_fully_shard, "_get_modules_and_states", _moving_with(record)),
            mock.patch.object(unit_device, "_move_states_to_device", record),
        ):
            _shard(impl, model)
        moved[name] = (sorted(n for call, _ in calls for n in call), calls[-1][1])
    return moved


def _moving_with(record):
    """FSDP2's ``_get_modules_and_states`` with its move reported to ``record``."""

    def get_modules_and_states(*args, **kwargs):
        with mock.patch.object(_fsdp_init, "_move_states_to_device", record):
            return original(*args, **kwargs)

    original = _fsdp_init._get_modules_and_states
    return get_modules_and_states


def test_states_move_to_the_mesh_device_as_fsdp2(dist_run):
    moved = dist_run(_moved_states, 2, timeout=T)[0]
    names, device = moved["torch"]
    assert "block.norm.running_mean" in names
    assert "frozen.weight" not in names
    assert device == "cpu"
    assert moved["vescale"] == moved["torch"]
    assert moved["vescale via shard_model"] == moved["torch"]


def test_the_mesh_device_is_fsdp2s():
    """A CUDA mesh keeps states on the current CUDA device, as FSDP2's (pretend device 3)."""
    cuda_mesh = mock.Mock(device_type="cuda")
    with mock.patch.object(_fsdp_init, "_get_device_handle", return_value=mock.Mock(current_device=lambda: 3)):
        assert (
            unit_device.mesh_device(cuda_mesh) == _fsdp_init._get_device_from_mesh(cuda_mesh) == torch.device("cuda", 3)
        )
    assert unit_device.mesh_device(mock.Mock(device_type="cpu")) == torch.device("cpu")
