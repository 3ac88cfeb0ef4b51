"""Importing our packages changes nothing in torch; the first RaggedShard or ``fully_shard``
installs our patches; stock FSDP2 trains bit-identically either way (in fresh processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]

_UNTOUCHED_UNTIL_FIRST_USE = """
import torch
import torch.distributed as dist
import torch.distributed.tensor._api as api
import torch.distributed.tensor._dispatch as dispatch
import torch.distributed.tensor._redistribute as redistribute
import torch.distributed.tensor._utils as utils
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

FUNCTIONS = [
    api.distribute_tensor,
    DTensor.__dict__["from_local"].__func__,
    redistribute.redistribute_local_tensor,
    utils.compute_local_shape_and_global_offset,
]
DUNDERS = ["__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__", "__deepcopy__", "__reduce_ex__"]
codes = [f.__code__ for f in FUNCTIONS]
methods = [getattr(DTensor, name) for name in DUNDERS]
slow_path = dispatch.OpDispatcher._propagate_op_sharding_dispatch_slow_path
handlers = dict(DTensor._op_dispatcher._custom_op_handlers)
GLOBAL_HOOKS = [
    getattr(nn.modules.module, name)
    for name in dir(nn.modules.module)
    if name.startswith("_global_") and name.endswith("_hooks")
]
hooks = nn.modules.module._global_parameter_registration_hooks


def changed():
    return {
        "code": [f.__code__ is not c for f, c in zip(FUNCTIONS, codes)],
        "dunders": [getattr(DTensor, n) is not m for n, m in zip(DUNDERS, methods)],
        "slow_path": dispatch.OpDispatcher._propagate_op_sharding_dispatch_slow_path is not slow_path,
        "handlers": DTensor._op_dispatcher._custom_op_handlers != handlers,
        "hooks": len(hooks),
        "other_global_hooks": sum(len(h) for h in GLOBAL_HOOKS if h is not hooks),
    }


import accelerate_plugin  # noqa: E402,F401
import lightning_strategy  # noqa: E402,F401
import vescale_plugins  # noqa: E402


# What changed() reads with no unit built: all of torch as it was, or all of it patched.
def expected(patched):
    return {
        "code": [patched] * 4,
        "dunders": [patched] * 5,
        "slow_path": patched,
        "handlers": patched,
        "hooks": 0,
        "other_global_hooks": 0,
    }


assert changed() == expected(False), changed()
import threading  # noqa: E402

start = threading.Barrier(8)  # eight threads build their first RaggedShard at once: one install


def build():
    start.wait()
    vescale_plugins.RaggedShard((0,), [1, 1])


threads = [threading.Thread(target=build) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert api.distribute_tensor.__wrapped__.__code__ is codes[0]  # redirected once, to torch's own code
patched = expected(True)
assert changed() == patched, changed()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
unit = vescale_plugins.fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
unit(torch.ones(2, 4)).sum().backward()
assert changed() == {**patched, "hooks": 1}, changed()
vescale_plugins.fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
assert changed() == {**patched, "hooks": 1}, changed()  # once per process
dist.destroy_process_group()
print("OK")
"""

_FIRST_UNIT_ONLY = """
import torch.distributed as dist
import torch.distributed.tensor._api as api
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

code = api.distribute_tensor.__code__
import vescale_plugins  # noqa: E402

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
vescale_plugins.fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,)))
assert api.distribute_tensor.__code__ is not code
assert len(nn.modules.module._global_parameter_registration_hooks) == 1
dist.destroy_process_group()
print("OK")
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def _run_script(script: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=_env(), cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK"), result.stderr[-3000:]


def test_importing_changes_nothing_until_a_ragged_shard_then_fully_shard_adds_the_hook():
    _run_script(_UNTOUCHED_UNTIL_FIRST_USE)


def test_the_first_unit_installs_the_patches_and_the_hook():
    _run_script(_FIRST_UNIT_ONLY)


def _train_stock_fsdp2(mode: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    out, store = tmp_path / f"{mode}.pt", tmp_path / f"{mode}.store"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.runtime.stock_fsdp2_run"]
            + ["--mode", mode, "--rank", str(rank), "--store", str(store), "--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(),
            cwd=REPO,
        )
        for rank in range(2)
    ]
    try:
        logs = [rank.communicate(timeout=240)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert all(rank.returncode == 0 for rank in ranks), "\n".join(log[-3000:] for log in logs)
    return torch.load(out)


def test_stock_fsdp2_trains_bit_identically_with_our_package_imported_and_installed(tmp_path):
    """W=2 stock FSDP2 (meta init, reset_parameters, AdamW and SGD, clipping, a deep copy and a
    pickle of the sharded state dict) in a process that never imported us, one that imported
    our three packages, and one that also built and trained one of our units first."""
    plain = _train_stock_fsdp2("plain", tmp_path)
    assert len(plain) == 6
    for mode in ("imported", "built"):
        got = _train_stock_fsdp2(mode, tmp_path)
        assert got.keys() == plain.keys()
        for name, tensor in plain.items():
            assert torch.equal(got[name], tensor), (mode, name)
