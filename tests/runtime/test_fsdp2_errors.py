"""fully_shard's set-up errors are FSDP2's: for each mistake, torch's FSDP2 and ours are
given the same input in the same test, and ours raises an instance of FSDP2's exception
class whose text contains FSDP2's (ours adds the parameter and the fix where FSDP2's
names neither). Re-applying ``fully_shard`` is refused by both.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import vescale_plugins

IMPLS = {"torch": fsdp.fully_shard, "vescale": vescale_plugins.fully_shard}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _raised(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except Exception as error:  # the case compares whatever each engine raises
        return error
    raise AssertionError("no error raised")


def _three_d_mesh(shard):
    mesh = init_device_mesh("cpu", (1, 1, dist.get_world_size()))
    return lambda: shard(_model(), mesh=mesh)


def _unnamed_two_d_mesh(shard):
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()))
    return lambda: shard(_model(), mesh=mesh)


def _invalid_shard_dim(shard):
    model = _model()
    return lambda: shard(model, shard_placement_fn=lambda p: Shard(2) if p is model[0].weight else None)


def _not_a_shard_placement(shard):
    model = _model()
    return lambda: shard(model, shard_placement_fn=lambda p: Replicate() if p is model[2].weight else None)


def _meta_parameter_before_to_empty(shard):
    with torch.device("meta"):
        model = _model()
    shard(model[0])
    shard(model)
    return lambda: model(torch.randn(2, 8))


def _applied_twice(shard):
    model = _model()
    shard(model[0])
    return lambda: shard(model[0])


def _root_applied_twice(shard):
    model = _model()
    shard(model[0])
    shard(model)
    return lambda: shard(model)


def _list_member_applied_again(shard):
    model = _model()
    shard([model[0], model[2]])
    return lambda: shard(model[2])


CASES = {
    "3-D mesh": _three_d_mesh,
    "2-D mesh without dim names": _unnamed_two_d_mesh,
    "invalid Shard dim from shard_placement_fn": _invalid_shard_dim,
    "not a Shard from shard_placement_fn": _not_a_shard_placement,
    "meta-device parameter used before to_empty": _meta_parameter_before_to_empty,
    "fully_shard applied twice": _applied_twice,
    "fully_shard applied twice to the root": _root_applied_twice,
    "a grouped module sharded again": _list_member_applied_again,
}


def _errors_match_fsdp2():
    for case, make in CASES.items():
        theirs = _raised(make(IMPLS["torch"]))
        ours = _raised(make(IMPLS["vescale"]))
        assert isinstance(ours, type(theirs)), f"{case}: FSDP2 raises {theirs!r}, ours {ours!r}"
        assert re.search(re.escape(str(theirs)), str(ours)), f"{case}: FSDP2 says {theirs}, ours {ours}"
    named = _raised(_invalid_shard_dim(IMPLS["vescale"]))  # ours also names the parameter
    assert "for '0.weight'" in str(named)
    assert isinstance(named, ValueError)
    dist.barrier()  # every rank got here: no rank was left waiting in a collective


def test_setup_errors_are_fsdp2s(dist_run):
    dist_run(_errors_match_fsdp2, 2)
