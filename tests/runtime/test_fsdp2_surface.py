"""FSDP2's public surface under the installed torch, enumerated with ``inspect``, against ours.

Every public name ``torch.distributed.fsdp`` exports from FSDP2 (not FSDP1's), every parameter
and default of ``fully_shard``, every public method of ``FSDPModule`` and ``UnshardHandle``
with its parameters, and every field of FSDP2's configuration dataclasses has a counterpart in
ours. Nothing here is a fixed list of torch's names: a torch release that adds surface fails
this test, naming what it added, instead of leaving it silently unsupported.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from torch.distributed import fsdp

import vescale_plugins
from vescale_plugins import VeScaleFSDPModule

# FSDP2's public names (``torch.distributed.fsdp`` re-exports them from ``_fully_shard``).
FSDP2_NAMES = sorted(
    name
    for name in dir(fsdp)
    if not name.startswith("_") and getattr(getattr(fsdp, name), "__module__", None) == "torch.distributed.fsdp"
)

# What answers each name in ours. The configuration dataclasses are torch's own: ours takes
# them as they are, and reads the fields listed in HONOURED_FIELDS.
OURS = {
    "fully_shard": vescale_plugins.fully_shard,
    "register_fsdp_forward_method": vescale_plugins.register_fsdp_forward_method,
    "share_comm_ctx": vescale_plugins.share_comm_ctx,
    "FSDPModule": VeScaleFSDPModule,
    "UnshardHandle": vescale_plugins.UnshardHandle,
    "GradientReductionHandle": vescale_plugins.GradientReductionHandle,  # torch 2.15 on
    "MixedPrecisionPolicy": fsdp.MixedPrecisionPolicy,
    "OffloadPolicy": fsdp.OffloadPolicy,
    "CPUOffloadPolicy": fsdp.CPUOffloadPolicy,
    "DataParallelMeshDims": getattr(fsdp, "DataParallelMeshDims", None),  # torch 2.13 on
}

# Each field of a configuration dataclass ours reads, and where its semantics are proven
# against FSDP2.
HONOURED_FIELDS = {
    "MixedPrecisionPolicy": {
        "param_dtype": "tests/runtime/test_fully_shard.py, test_gradient_dtypes.py",
        "reduce_dtype": "tests/runtime/test_gradient_dtypes.py",
        "output_dtype": "tests/fsdp2_compat/test_compat_mixed_precision.py",
        "cast_forward_inputs": "tests/runtime/test_fsdp2_api.py",
        "param_dtype_override_fn": "tests/runtime/test_fsdp2_215_surface.py (torch 2.15 on)",
    },
    "OffloadPolicy": {},
    "CPUOffloadPolicy": {"pin_memory": "tests/runtime/test_fully_shard.py (CPU offload like FSDP2)"},
    "DataParallelMeshDims": {
        "shard": "tests/runtime/test_torchtitan_recipe.py (dp_mesh_dims)",
        "replicate": "tests/fsdp2_compat/ (dp_mesh_dims with HSDP)",
    },
}


def _parameters(function) -> list[tuple[str, inspect._ParameterKind, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_every_fsdp2_name_has_a_counterpart():
    missing = [name for name in FSDP2_NAMES if name not in OURS]
    assert not missing, f"torch {torch.__version__}'s FSDP2 exports names ours does not answer: {missing}"


def test_fully_shard_takes_every_fsdp2_argument_with_its_default():
    ours = {name: (kind, default) for name, kind, default in _parameters(vescale_plugins.fully_shard)}
    for name, kind, default in _parameters(fsdp.fully_shard):
        assert name in ours, f"torch {torch.__version__}'s fully_shard takes {name!r}; ours does not"
        assert ours[name] == (kind, default), f"fully_shard({name}): ours {ours[name]}, FSDP2's {(kind, default)}"


@pytest.mark.parametrize("name", ["FSDPModule", "UnshardHandle", "GradientReductionHandle"])
def test_every_public_method_with_fsdp2s_parameters(name):
    if not hasattr(fsdp, name):
        pytest.skip(f"torch {torch.__version__} has no {name} (2.15 added it)")
    theirs, ours = getattr(fsdp, name), OURS[name]
    for method, value in sorted(vars(theirs).items()):
        if method.startswith("_") or not callable(value):
            continue
        assert method in vars(ours), f"torch {torch.__version__}'s {name}.{method} has no counterpart in ours"
        assert _parameters(vars(ours)[method]) == _parameters(value), f"{name}.{method}: other parameters than FSDP2's"


@pytest.mark.parametrize("name", sorted(HONOURED_FIELDS))
def test_every_configuration_field_is_honoured(name):
    if not hasattr(fsdp, name):
        pytest.skip(f"torch {torch.__version__} has no {name} (2.13 added it)")
    fields = [field.name for field in dataclasses.fields(getattr(fsdp, name))]
    unknown = [field for field in fields if field not in HONOURED_FIELDS[name]]
    assert not unknown, f"torch {torch.__version__}'s {name} has fields ours does not read: {unknown}"


def test_module_functions_take_fsdp2s_parameters():
    for name in ("register_fsdp_forward_method", "share_comm_ctx"):
        assert [(n, k) for n, k, _ in _parameters(OURS[name])] == [
            (n, k) for n, k, _ in _parameters(getattr(fsdp, name))
        ], name


def _share_comm_ctx() -> None:
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 6)
    for module in (first, second):
        vescale_plugins.fully_shard(module)
    vescale_plugins.share_comm_ctx([first, second])
    streams = {id(d.streams) for m in (first, second) for d in m._vescale_fsdp_unit.dbuffers}
    assert len(streams) == 1  # the two roots' collectives already share one set of streams
    with pytest.raises(ValueError, match="share_comm_ctx takes modules vescale_plugins.fully_shard was applied to"):
        vescale_plugins.share_comm_ctx([first, torch.nn.Linear(2, 2)])


def test_share_comm_ctx_shares_the_streams_of_several_roots(dist_run):
    dist_run(_share_comm_ctx, 2)
