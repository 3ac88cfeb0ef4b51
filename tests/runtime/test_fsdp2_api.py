"""The FSDPModule surface of vescale_plugins.fully_shard, compared with FSDP2's in the same test.

Managed modules are ``torch.distributed.fsdp.FSDPModule`` instances; every public method
FSDP2 2.13's FSDPModule has is ours (none falls through to FSDP2's internals) and either
works as FSDP2's or raises NotImplementedError saying what to do. Also: ``unshard`` handles,
deepcopy refusal, ``cast_forward_inputs`` into dataclasses and grouped units, tensor
extensions with an invalid signature refused, RaggedShard pickling, and import-order independence of the DTensor
patches (in a fresh interpreter).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.torch_version import TorchVersion

import vescale_plugins
from vescale_plugins import RaggedShard, VeScaleFSDPModule

T = 120
IMPLS = {"torch": fsdp.fully_shard, "vescale": vescale_plugins.fully_shard}


def _public_methods(cls: type) -> list[str]:
    return sorted(n for n, v in vars(cls).items() if callable(v) and not n.startswith("_"))


def test_every_fsdpmodule_method_is_ours():
    """No public FSDPModule method is inherited: each would reach FSDP2's private state."""
    missing = [n for n in _public_methods(FSDPModule) if n not in vars(VeScaleFSDPModule)]
    assert missing == []
    assert issubclass(VeScaleFSDPModule, FSDPModule)
    assert vars(VeScaleFSDPModule)["_get_fsdp_state"] is not FSDPModule._get_fsdp_state


class _MLP(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 2 * dim)
        self.out_proj = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


# What each method does on ours: "works" (returns like FSDP2's) or "refuses"
# (NotImplementedError). Arguments are what a user would pass.
_CALLS = {
    "reshard": ((), "works"),
    "unshard": ((), "works"),
    "set_is_last_backward": ((True,), "works"),
    "set_requires_gradient_sync": ((True,), "works"),
    "set_requires_all_reduce": ((True,), "works"),
    "set_reshard_after_forward": ((True,), "works"),
    "set_reshard_after_backward": ((True,), "works"),
    "set_modules_to_forward_prefetch": (([],), "works"),
    "set_modules_to_backward_prefetch": (([],), "works"),
    "set_gradient_divide_factor": ((2.0,), "works"),
    "set_reduce_scatter_divide_factor": ((2.0,), "works"),
    "set_force_sum_reduction_for_comms": ((True,), "works"),
    "set_reduce_scatter_unused_params": ((True,), "works"),
    "set_reduce_scatter_max_input_buffers": ((2,), "works"),
    "set_separate_reduce_scatter_group": ((False,), "works"),
    "set_unshard_in_backward": ((False,), "works"),
    "set_allocate_memory_from_process_group_for_comm": ((False,), "works"),
    "set_post_optim_event": ((torch.Event("cpu"),), "works"),
    "set_custom_all_gather": ((object(),), "refuses"),
    "set_custom_reduce_scatter": ((object(),), "refuses"),
    "set_all_reduce_hook": ((lambda t: None,), "works"),
    "set_symm_mem_for_comm": ((), "refuses"),
    "reset_iter_state": ((), "works"),
    # torch 2.15's additions (ours on every supported torch): before the first forward
    "set_keep_unsharded_storage": ((False,), "works"),
    "set_manual_backward_finalization": ((False,), "works"),
    "finalize_backward": ((), "works"),
}


def _surface():
    torch.manual_seed(0)
    model = _MLP()
    vescale_plugins.fully_shard(model.in_proj)
    vescale_plugins.fully_shard(model)
    assert isinstance(model, FSDPModule)
    assert isinstance(model.in_proj, FSDPModule)
    assert not isinstance(model.in_proj.weight, FSDPModule)
    outcome = {}
    for name, (args, _) in _CALLS.items():
        refusal = None
        try:
            getattr(model, name)(*args)
        except NotImplementedError as e:
            refusal = str(e)
        assert refusal is None or "vescale" in refusal.lower(), (name, refusal)
        outcome[name] = "works" if refusal is None else "refuses"
    # FSDP2's own validation of the buffer count, same exceptions
    for bad, exc in ((True, TypeError), (0, ValueError)):
        with pytest.raises(exc):
            model.set_reduce_scatter_max_input_buffers(bad)
    # The model still trains after every setter ran (divide factor back to the default; the
    # root gathered again in backward: it reshards after forward now, and its backward reads
    # its weights, which FSDP2 does not gather either under set_unshard_in_backward(False)).
    model.set_gradient_divide_factor(float(dist.get_world_size()))
    model.set_unshard_in_backward(True)
    model(torch.randn(2, 8)).sum().backward()
    assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    # nn.Module methods reach ours, never FSDPModule's (which reads FSDP2's private state).
    model.to(torch.float64)
    assert all(p.dtype == torch.float64 and p.to_local().dtype == torch.float64 for p in model.parameters())
    return outcome


def test_surface_methods_work_or_refuse(dist_run):
    outcome = dist_run(_surface, 2, timeout=T)[0]
    assert outcome == {name: expected for name, (_, expected) in _CALLS.items()}
    assert set(_CALLS) | {"unshard"} >= set(_public_methods(FSDPModule))


def _unshard_handle(impl: str):
    torch.manual_seed(0)
    model = nn.Sequential(_MLP(), _MLP())
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    for m in model:
        IMPLS[impl](m)
    IMPLS[impl](model)
    handle = model[0].unshard(async_op=True)
    assert isinstance(handle, fsdp.UnshardHandle)
    handle.wait()
    handle.wait()  # a second wait is a no-op, as FSDP2's
    for n, p in model[0].named_parameters():
        assert not isinstance(p, DTensor)
        torch.testing.assert_close(p, full[f"0.{n}"], rtol=0, atol=0)
    model[1].unshard(async_op=True)  # never waited for: the forward waits
    x = torch.randn(2, 8)
    out = model(x)
    ref = nn.Sequential(_MLP(), _MLP())
    ref.load_state_dict(full)
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    model.reshard()
    for m in model:
        m.reshard()
    return sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))


def test_unshard_async_handle_matches_fsdp2(dist_run):
    assert dist_run(_unshard_handle, 2, "vescale", timeout=T) == dist_run(_unshard_handle, 2, "torch", timeout=T)


def _container_new_and_deepcopy(impl: str):
    model = nn.Sequential(_MLP(), _MLP(), _MLP())
    IMPLS[impl](model)
    # FSDPModule.__new__ builds the original class for container slicing.
    assert type(model[0:2]) is nn.Sequential
    with pytest.raises(AssertionError, match="FSDP does not support deepcopy"):
        copy.deepcopy(model)
    # The state (DTensors with this impl's placements) deep-copies and pickles.
    sd = model.state_dict()
    copied = copy.deepcopy(sd)
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for key, value in sd.items():
        for other in (copied[key], loaded[key]):
            assert isinstance(other, DTensor)
            assert other.placements == value.placements
            torch.testing.assert_close(other.to_local(), value.to_local(), rtol=0, atol=0)
            torch.testing.assert_close(other.full_tensor(), value.full_tensor(), rtol=0, atol=0)
    return type(model).__mro__.index(nn.Sequential) - type(model)._orig_cls_mro_index


@pytest.mark.parametrize("impl", ["torch", "vescale"])
def test_container_new_deepcopy_and_pickled_state(dist_run, impl):
    assert dist_run(_container_new_and_deepcopy, 2, impl, timeout=T) == [0, 0]


def test_ragged_shard_pickles_and_compares_like_torch_placements():
    from torch.distributed.tensor import Shard

    for placement in (RaggedShard((0,), (3, 0, 2)), RaggedShard((), (0, 1)), Shard(0)):
        for clone in (pickle.loads(pickle.dumps(placement)), copy.deepcopy(placement), copy.copy(placement)):
            assert clone == placement
            assert hash(clone) == hash(placement)
            assert type(clone) is type(placement)
    assert RaggedShard((0,), (1, 2)) != RaggedShard((0,), (2, 1))
    assert RaggedShard((0,), (1, 2)) != Shard(0)


class _Recorder(nn.Module):
    """A linear layer that records the dtypes of every tensor reaching its forward."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = seen

    def forward(self, batch):
        self.seen.append([t.dtype for t in _leaves(batch)])
        return self.lin(batch.x) + batch.extra["y"][0].sum()


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    extra: dict


def _leaves(obj):
    if torch.is_tensor(obj):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in _leaves(getattr(obj, f.name))]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _leaves(v)]
    return []


class _TwoRecorders(nn.Module):
    def __init__(self, seen):
        super().__init__()
        self.a, self.b = _Recorder(seen), _Recorder(seen)

    def forward(self, batch):
        h = self.a(batch).float()  # fp32 again: b's own cast must bring it to bf16
        return self.b(_Batch(h, {"y": [batch.extra["y"][0].float()]}))


def _cast_forward_inputs(impl: str):
    seen: list = []
    torch.manual_seed(0)
    model = _TwoRecorders(seen)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    IMPLS[impl]([model.a, model.b], mp_policy=policy)
    IMPLS[impl](model, mp_policy=policy)  # FSDP2 wants one root
    out = model(_Batch(torch.randn(2, 4), {"y": [torch.randn(3)]}))
    out.float().sum().backward()
    return [[str(d) for d in dtypes] for dtypes in seen], str(out.dtype)


def test_cast_forward_inputs_reaches_dataclasses_and_every_grouped_module(dist_run):
    ours = dist_run(_cast_forward_inputs, 2, "vescale", timeout=T)[0]
    assert ours[0] == [["torch.bfloat16", "torch.bfloat16"]] * 2
    # FSDP2 before torch 2.13 casts the inputs of a grouped unit's first module only (its
    # second then fails on fp32 inputs): compared where FSDP2 casts every module's.
    if TorchVersion(torch.__version__) >= "2.13":
        assert ours == dist_run(_cast_forward_inputs, 2, "torch", timeout=T)[0]


class _WithAllGatherExtension(torch.Tensor):
    """The smallest tensor subclass FSDP2 treats as an all-gather extension, with a
    ``fsdp_pre_all_gather`` signature neither FSDP2's old nor its new one (FSDP2 fails at its
    first all-gather)."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_subclass(cls, data, data.requires_grad)

    def fsdp_pre_all_gather(self, mesh, *args, **kwargs):
        return (self,), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return all_gather_outputs[0], all_gather_outputs


def _tensor_extensions_refused():
    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(_WithAllGatherExtension(model.weight.detach()))
    assert hasattr(model.weight, "fsdp_pre_all_gather")
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(TypeError, match=r"'weight'.*invalid fsdp_pre_all_gather"):
        vescale_plugins.fully_shard(model)
    assert dict(model.named_parameters()) == before
    assert not isinstance(model, FSDPModule)


def test_tensor_extensions_refused_before_touching_the_module(dist_run):
    dist_run(_tensor_extensions_refused, 2, timeout=T)


class _ViT(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward_features(self, x):
        return self.proj(x)


def _torch_register_forward_method_on_ours():
    """transformers' Trainer calls torch's register_fsdp_forward_method(model, "generate")."""
    torch.manual_seed(0)
    model = nn.Sequential(_ViT(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    vescale_plugins.fully_shard(model[0])
    vescale_plugins.fully_shard(model)
    fsdp.register_fsdp_forward_method(model[0], "forward_features")
    x = torch.randn(2, 8)
    out = model[0].forward_features(x)
    torch.testing.assert_close(out, ref[0].forward_features(x))
    out.sum().backward()
    assert isinstance(model[0].proj.weight, DTensor)
    assert isinstance(model[0].proj.weight.grad, DTensor)
    with pytest.raises(NotImplementedError, match="_comm_ctx"):
        _ = model._get_fsdp_state()._comm_ctx


def test_torch_register_fsdp_forward_method_works_on_ours(dist_run):
    dist_run(_torch_register_forward_method_on_ours, 2, timeout=T)


_IMPORT_ORDER_SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from_local = DTensor.from_local
    import vescale_plugins  # after the references were taken
    from vescale_plugins import RaggedShard
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + __import__("sys").argv[1], rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(12.0).view(4, 3)
    placement = RaggedShard((0,), (1,))
    d = distribute_tensor(full, mesh, [placement])
    assert d.placements == (placement,), d.placements
    assert torch.equal(d.full_tensor(), full)
    e = from_local(d.to_local(), mesh, [placement], shape=full.shape, stride=full.stride())
    assert torch.equal(e.full_tensor(), full)
    try:
        from_local(d.to_local(), mesh, [placement])
    except ValueError as err:
        assert "needs shape= and stride=" in str(err)
    else:
        raise AssertionError("from_local taken before the import skipped our validation")
    assert compute_local_shape_and_global_offset(full.shape, mesh, [placement]) == ((4, 3), (0, 0))
    dist.destroy_process_group()
    print("OK")
    """
)


@pytest.mark.distributed
def test_dtensor_patches_do_not_depend_on_import_order():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [os.path.dirname(os.path.dirname(vescale_plugins.__file__)), os.environ.get("PYTHONPATH", "")]
        ),
    )
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ORDER_SCRIPT, str(port)], capture_output=True, text=True, timeout=240, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("OK"), result.stderr[-3000:]


def test_redirected_functions_keep_their_signatures():
    from torch.distributed.tensor import distribute_tensor

    assert list(inspect.signature(distribute_tensor).parameters) == [
        "tensor",
        "device_mesh",
        "placements",
        "src_data_rank",
    ]
    assert "shape" in inspect.signature(DTensor.from_local).parameters


def _managed_class_names() -> None:
    names = {}
    for impl, fully_shard in IMPLS.items():
        model = _MLP()
        fully_shard(model.in_proj)
        fully_shard(model)
        names[impl] = (type(model).__name__, type(model.in_proj).__name__)
        assert isinstance(model, FSDPModule)
    assert names["vescale"] == names["torch"] == ("FSDP_MLP", "FSDPLinear")
    assert isinstance(model, VeScaleFSDPModule)


def test_managed_class_is_named_as_fsdp2s(dist_run):
    """``FSDP<Name>``, as FSDP2 names it (code matches on the name)."""
    dist_run(_managed_class_names, 1, timeout=T)
