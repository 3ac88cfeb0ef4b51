"""test_fully_shard_clip_grad_norm_.py, _grad_scaler.py, _ignore_params.py, _init.py
(public-behaviour cases) and the custom-forward-method and unshard cases of
_training.py/_comm.py (FSDP2), on CPU/gloo. The 2-D (TP/HSDP) variants are in test_compat_tensor_parallel.py.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import replicate
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_fsdp import MLP, check_sharded_parity
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

from ._compat import api, tc

T = 180
vescale_xfail = lambda reason: pytest.mark.vescale_xfail(reason)


# -- test_fully_shard_clip_grad_norm_.py -------------------------------------------------


def _clip_grad_norm_1d(impl, norm_type):
    A = api(impl)
    max_norm = 1
    torch.manual_seed(42)
    model_args = ModelArgs(dropout_p=0.0)
    model = Transformer(model_args)
    ref_model = replicate(copy.deepcopy(model))
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            A.fully_shard(module)
    A.fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    vector_norm_fn = functools.partial(torch.linalg.vector_norm, ord=norm_type)
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = torch.randint(0, model.model_args.vocab_size, (3, 16))
    for _ in range(10):
        ref_optim.zero_grad()
        ref_model(inp).sum().backward()
        optim.zero_grad()
        model(inp).sum().backward()
        ref_grads = [p.grad.detach().clone() for p in ref_model.parameters()]
        local_grads = [p.grad.to_local().detach().clone() for p in model.parameters()]
        for ref_grad, param in zip(ref_grads, model.parameters()):
            tc.assertEqual(ref_grad, param.grad.full_tensor())
        tc.assertTrue(all(vector_norm_fn(g).item() > max_norm for g in ref_grads))
        if impl == "torch":
            # Every local shard above max_norm holds for FSDP2's even Shard(0) chunks only: a
            # RaggedShard may give a rank a small or empty part of a tensor (README).
            tc.assertTrue(all(vector_norm_fn(g).item() > max_norm for g in local_grads))
        ref_total_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=max_norm, norm_type=norm_type)
        comm_mode = CommDebugMode()
        with comm_mode:
            total_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), max_norm=max_norm, norm_type=norm_type, foreach=True
            )
        tc.assertEqual(ref_total_norm, total_norm.full_tensor())
        tc.assertEqual(comm_mode.get_comm_counts()[torch.ops.c10d_functional.all_reduce], len(total_norm.placements))
        for param, grad in zip(ref_model.parameters(), ref_grads):
            tc.assertTrue(vector_norm_fn(param.grad).item() <= max_norm)
            if torch.count_nonzero(grad):
                tc.assertFalse(torch.equal(param.grad, grad))
        for param, grad in zip(model.parameters(), local_grads):
            if grad.numel() == 0:
                continue  # nothing to clip here (never the case with FSDP2's layout)
            tc.assertTrue(vector_norm_fn(param.grad.to_local()).item() <= max_norm)
            if torch.count_nonzero(grad):
                tc.assertFalse(torch.equal(param.grad.to_local(), grad))


@pytest.mark.parametrize("norm_type", [2, 1, float("inf")], ids=["l2", "l1", "inf"])
def test_clip_grad_norm_1d(dist_run, impl, norm_type):
    dist_run(_clip_grad_norm_1d, 2, impl, norm_type, timeout=T)


# -- test_fully_shard_grad_scaler.py -----------------------------------------------------


def _gradient_scaler(impl, has_inf, test_2d=False):
    from torch.amp.grad_scaler import GradScaler, OptState

    A = api(impl)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    for layer in model:
        A.fully_shard(layer)
    A.fully_shard(model)
    inp = torch.randn([4, 4])
    if test_2d:  # the original's DP x TP case: (dp=2, tp=2) on 4 ranks
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from torch.testing._internal.common_fsdp import MLP

        mesh_2d = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
        dp_mesh, tp_mesh = mesh_2d["dp"], mesh_2d["tp"]
        model = nn.Sequential(MLP(2), MLP(2), MLP(2))
        plan = {
            f"{i}.{name}": style()
            for i in range(3)
            for name, style in (("in_proj", ColwiseParallel), ("out_proj", RowwiseParallel))
        }
        model = parallelize_module(model, device_mesh=tp_mesh, parallelize_plan=plan)
        for module in model:
            A.fully_shard(module, mesh=dp_mesh)
        A.fully_shard(model, mesh=dp_mesh)
        inp = torch.randn((2,))
    loss = model(inp).sum()
    scaler = GradScaler("cpu", init_scale=2.0, enabled=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler.scale(loss).backward()
    inv_scale = scaler._scale.double().reciprocal().float()
    # The original puts the inf on the rank whose device index is 1; on CPU: rank 1.
    grad = opt.param_groups[0]["params"][0].grad
    if has_inf and dist.get_rank() == 1:
        tc.assertGreater(grad._local_tensor.numel(), 0)
        grad._local_tensor.view(-1)[0].fill_(float("inf"))
    initial_grad = grad.to_local().clone()
    scaler.unscale_(opt)
    for found_inf in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values():
        tc.assertEqual(found_inf, has_inf)
    tc.assertEqual(scaler._per_optimizer_states[id(opt)]["stage"].value, OptState.UNSCALED.value)
    unscaled_grad = opt.param_groups[0]["params"][0].grad.to_local().clone()
    tc.assertEqual(unscaled_grad, initial_grad * inv_scale)
    initial_scale = scaler.get_scale()
    initial_state = copy.copy(opt.state)
    scaler.step(opt)
    stepped_state = copy.copy(opt.state)
    if has_inf:
        tc.assertEqual(stepped_state, initial_state)
    else:
        tc.assertNotEqual(stepped_state.items(), initial_state.items())
    scaler.update()
    updated_scale = scaler.get_scale()
    if has_inf:
        tc.assertEqual(updated_scale, initial_scale * scaler.get_backoff_factor())
    else:
        tc.assertEqual(updated_scale, initial_scale)


@pytest.mark.parametrize("has_inf", [True, False])
def test_gradient_scaler(dist_run, impl, has_inf):
    dist_run(_gradient_scaler, 2, impl, has_inf, timeout=T)


@pytest.mark.parametrize("has_inf", [True, False])
def test_gradient_scaler_2d(dist_run, impl, has_inf):
    dist_run(_gradient_scaler, 4, impl, has_inf, True, timeout=T)


# -- test_fully_shard_ignore_params.py ---------------------------------------------------


class _C(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin_c = nn.Linear(dim, dim)

    def forward(self, x):
        return self.lin_c(x)


class _B(nn.Module):
    def __init__(self, dim, subtrahend):
        super().__init__()
        self.lin_b = nn.Linear(dim, dim)
        self.module_c = _C(dim)
        self.subtrahend = nn.Parameter(subtrahend)

    def forward(self, x):
        return self.lin_b(self.module_c(x)) - self.subtrahend


class _A(nn.Module):
    def __init__(self, dim, addend, subtrahend):
        super().__init__()
        self.module_b = _B(dim, subtrahend)
        self.addend = nn.Parameter(addend)

    def forward(self, x):
        return (self.module_b(x) + self.addend).sum()


def _model_and_input():
    dim = 8
    torch.manual_seed(42)
    addend = torch.randn((dim, dim))
    torch.manual_seed(70)
    subend = torch.randn((dim, dim))
    model = _A(dim, addend, subend)
    torch.manual_seed(84)
    return model, torch.randn((dim, dim))


def _ddp_A_fsdp_B_ddp_C(impl):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.nn.parallel import DistributedDataParallel as DDP

    A = api(impl)
    default_pg = dist.distributed_c10d._get_default_group()
    mesh = init_device_mesh("cpu", mesh_shape=(default_pg.size(),))
    ref_model, ref_inp = _model_and_input()
    ref_model = DDP(ref_model, process_group=default_pg)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    ref_map = dict(ref_model.named_parameters())
    test_model, test_inp = _model_and_input()
    name_to_param = dict(test_model.named_parameters())
    ignored = set(test_model.module_b.module_c.parameters())
    # post-order wrap of module_b, skipping the ignored module_c
    A.fully_shard(test_model.module_b.lin_b, mesh=mesh, ignored_params=ignored)
    A.fully_shard(test_model.module_b, mesh=mesh, ignored_params=ignored)
    fsdped = {n for n, m in test_model.named_modules() if isinstance(m, A.FSDPModule)}
    tc.assertEqual(fsdped, {"module_b", "module_b.lin_b"})
    ddp_ignored = [n for n, _ in test_model.module_b.named_parameters("module_b")]
    tc.assertEqual(
        set(ddp_ignored),
        {
            "module_b.subtrahend",
            "module_b.lin_b.weight",
            "module_b.lin_b.bias",
            "module_b.module_c.lin_c.weight",
            "module_b.module_c.lin_c.bias",
        },
    )
    ddp_ignored = [n for n in ddp_ignored if name_to_param[n] not in ignored]
    tc.assertEqual(set(ddp_ignored), {"module_b.subtrahend", "module_b.lin_b.weight", "module_b.lin_b.bias"})
    DDP._set_params_and_buffers_to_ignore_for_model(module=test_model, params_and_buffers_to_ignore=ddp_ignored)
    test_model = DDP(test_model, broadcast_buffers=False)
    test_optim = torch.optim.Adam(test_model.parameters(), lr=1e-2)
    test_map = dict(test_model.named_parameters())

    def compare():
        tc.assertEqual(set(ref_map), set(test_map))
        for name, ref_param in ref_map.items():
            t = test_map[name]
            torch.testing.assert_close(ref_param, t.full_tensor() if isinstance(t, DTensor) else t)

    compare()
    for _ in range(3):
        ref_loss, test_loss = ref_model(ref_inp), test_model(test_inp)
        torch.testing.assert_close(ref_loss, test_loss)
        ref_loss.backward()
        test_loss.backward()
        with implicit_replication():
            ref_optim.step()
            ref_optim.zero_grad()
            test_optim.step()
            test_optim.zero_grad()
            compare()


def test_ddp_A_fsdp_B_ddp_C(dist_run, impl):
    dist_run(_ddp_A_fsdp_B_ddp_C, 2, impl, timeout=T)


# -- test_fully_shard_init.py: TestFullyShardMisc and meta-device init --------------------


def _raise_scalar_parameter(impl):
    A = api(impl)
    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    model.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    with tc.assertRaisesRegex(ValueError, "Change scalar_p to a 1D tensor with numel equal to 1."):
        A.fully_shard(model)


@pytest.mark.vescale_differs(
    "0-dim parameters: FSDP2 refuses them, veScale-FSDP shards them exactly (tests/runtime/test_fsdp2_edge_cases.py::test_zero_dim_and_non_contiguous_parameters_train_exactly)"
)
def test_raise_scalar_parameter(dist_run, impl):
    dist_run(_raise_scalar_parameter, 2, impl, timeout=T)


def _raise_noncontiguous_parameter(impl):
    A = api(impl)
    conv2d = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    with tc.assertRaisesRegex(NotImplementedError, "FSDP does not support non-contiguous parameters"):
        A.fully_shard(conv2d)


@pytest.mark.vescale_differs(
    "non-contiguous parameters: FSDP2 refuses them, veScale-FSDP shards them exactly (tests/runtime/test_fsdp2_edge_cases.py::test_zero_dim_and_non_contiguous_parameters_train_exactly)"
)
def test_raise_noncontiguous_parameter(dist_run, impl):
    dist_run(_raise_noncontiguous_parameter, 2, impl, timeout=T)


def _fully_shard_deepcopy(impl):
    A = api(impl)
    model = MLP(4)
    A.fully_shard(model)
    with tc.assertRaisesRegex(AssertionError, "FSDP does not support deepcopy"):
        copy.deepcopy(model)


def test_fully_shard_deepcopy(dist_run, impl):
    dist_run(_fully_shard_deepcopy, 2, impl, timeout=T)


def _meta_device_1d_init(impl):
    A = api(impl)
    mlp_dim = 8
    torch.manual_seed(42)
    model = nn.Sequential(MLP(mlp_dim, with_buffer=True), MLP(mlp_dim, with_buffer=True))
    ref_model = copy.deepcopy(model)
    with torch.device("meta"):
        meta_model = nn.Sequential(MLP(mlp_dim, with_buffer=True), MLP(mlp_dim, with_buffer=True))
    for module in meta_model:
        A.fully_shard(module)
    A.fully_shard(meta_model)
    for param in meta_model.parameters():
        tc.assertEqual(param.device, torch.device("meta"))
    meta_model.to_empty(device="cpu")
    for param in meta_model.parameters():
        tc.assertEqual(param.device.type, "cpu")
    # Initialise from the reference values (the original re-runs reset_parameters with the
    # same seed; the values are the point, not the initialiser).
    with torch.no_grad():
        for (_name, p), ref_p in zip(meta_model.named_parameters(), ref_model.parameters()):
            p.copy_(torch.distributed.tensor.distribute_tensor(ref_p, p.device_mesh, p.placements))
        for b, ref_b in zip(meta_model.buffers(), ref_model.buffers()):
            b.copy_(ref_b)
    replicate(ref_model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(meta_model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = torch.randn((4, mlp_dim))
    for iter_idx in range(10):
        losses = []
        for _model, _optim in ((ref_model, ref_optim), (meta_model, optim)):
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            losses.append(_model(inp).sum())
            losses[-1].backward()
            _optim.step()
        tc.assertEqual(losses[0], losses[1])


def test_meta_device_1d_init(dist_run, impl):
    dist_run(_meta_device_1d_init, 2, impl, timeout=T)


def _unsupported_module_cls(impl):
    A = api(impl)
    regex = r"fully\_shard does not support containers that do not implement forward"
    model = nn.ModuleList([MLP(8) for _ in range(3)])
    with tc.assertRaisesRegex(ValueError, regex):
        A.fully_shard(model)
    model = nn.ModuleDict({"1": MLP(8), "2": MLP(8)})
    with tc.assertRaisesRegex(ValueError, regex):
        A.fully_shard(model)


def test_fully_shard_unsupported_module_cls(dist_run, impl):
    dist_run(_unsupported_module_cls, 2, impl, timeout=T)


# -- TestFullyShardCustomForwardMethod ---------------------------------------------------


class _VisionTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch_proj = nn.Conv2d(3, 64, kernel_size=4, stride=4)

    def forward_features(self, imgs):
        return self.patch_proj(imgs).flatten(2).transpose(1, 2)

    def forward(self, imgs):
        return self.forward_features(imgs).sum(dim=1)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.vit, self.projector = _VisionTransformer(), nn.Linear(64, 16)

    def forward(self, imgs):
        # Run `vit.forward_features`, which is not `forward`!
        return self.projector(self.vit.forward_features(imgs)).sum()


def _register_fsdp_forward_method(impl):
    A = api(impl)
    torch.manual_seed(42)
    model = _Model()
    ref_model = copy.deepcopy(model)
    A.fully_shard(model.vit)
    A.fully_shard(model.projector)
    A.fully_shard(model)
    A.register_fsdp_forward_method(model.vit, "forward_features")
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = torch.randn(4, 3, 16, 16)
    ref_loss = ref_model(inp)
    loss = model(inp)
    tc.assertEqual(ref_loss, loss)
    ref_loss.backward()
    loss.backward()
    for param in ref_model.parameters():
        dist.all_reduce(param.grad)
        param.grad.div_(dist.get_world_size())
    check_sharded_parity(tc, ref_model, model)


def test_register_fsdp_forward_method(dist_run, impl):
    dist_run(_register_fsdp_forward_method, 2, impl, timeout=T)


# -- test_fully_shard_comm.py: explicit unshard --------------------------------------------


def _unshard_async(impl):
    """Explicit ``unshard(async_op=True)`` ahead of forward (the original's
    TestFullyShardUnshardMultiProcess.test_unshard_async, without CUDA sleeps): the
    handle is an ``UnshardHandle``; waiting registers the unsharded parameters."""
    A = api(impl)
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    for mlp in model:
        A.fully_shard(mlp)
    A.fully_shard(model)
    inp = torch.randn((2, 8))
    handles = [mlp.unshard(async_op=True) for mlp in model]
    for h in handles:
        tc.assertIsInstance(h, A.UnshardHandle)
    handles[0].wait()
    for p in model[0].parameters():
        tc.assertNotIsInstance(p, DTensor)
    for h in handles:
        h.wait()
    tc.assertIsNone(model[1].unshard())
    loss = model(inp).sum()
    tc.assertEqual(loss, ref_model(inp).sum())
    loss.backward()
    for p in model.parameters():
        tc.assertIsInstance(p, DTensor)


def test_unshard_async(dist_run, impl):
    dist_run(_unshard_async, 2, impl, timeout=T)
