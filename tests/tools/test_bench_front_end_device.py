"""The Fabric and Accelerate bench engines train on the GPUs under NCCL, as the plain engines
do (they forced CPU). CPU tests cannot start NCCL, so the backend is pretended and the front
end's constructor records what it was asked, then stops the engine."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import accelerate
import lightning.fabric
import pytest
import torch.nn as nn

import accelerate_plugin  # noqa: F401  (imported before Accelerator is patched: it extends the class on import)
from vescale_plugins.bench import engines


class _Asked(Exception):
    pass


def _asked(front_end: str, backend: str) -> dict:
    settings = SimpleNamespace(reshard_after_forward=None, mixed_precision=False)
    asked: dict = {}

    def record(*args, **kwargs):
        asked.update(kwargs)
        raise _Asked

    target = (lightning.fabric, "Fabric") if front_end == "fabric" else (accelerate, "Accelerator")
    engine = engines._fabric_engine if front_end == "fabric" else engines._accelerate_engine
    with (
        mock.patch.object(*target, record),
        mock.patch.object(engines.dist, "get_backend", return_value=backend),
        mock.patch.object(engines.dist, "get_world_size", return_value=2),
        pytest.raises(_Asked),
    ):
        engine(nn.Linear(2, 2), settings)
    return asked


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_front_end_engines_train_on_the_launchers_device(backend):
    on_gpu = backend == "nccl"
    assert _asked("fabric", backend)["accelerator"] == ("cuda" if on_gpu else "cpu")
    assert _asked("accelerate", backend)["cpu"] is (not on_gpu)
