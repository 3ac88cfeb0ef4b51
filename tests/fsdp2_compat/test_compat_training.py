"""test_fully_shard_training.py (FSDP2, torch 2.13) on CPU/gloo, for either implementation.

Changes from the original: CPU instead of CUDA, gloo instead of NCCL, ``all_reduce(AVG)``
as SUM then divide, the smallest world size the case needs (2; 3 where sharding is
uneven), and no device sleeps (CUDA-only delays that only shift timing).
"""

from __future__ import annotations

import copy
import functools
import gc
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint, replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    apply_activation_checkpointing,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_fsdp import MLP, check_sharded_parity
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

from ._compat import allreduce_avg_grads, api, broadcast_params, tc

T = 180  # seconds per case


class ChunkedHeadModel(nn.Module):
    """The original's chunked-loss model: the head is skipped in forward, called per chunk."""

    def __init__(self, dim: int, vocab_size: int, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, *, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


# -- TestFullyShardForwardInputs ---------------------------------------------------------


def _root_move_forward_input_to_device(impl):
    A = api(impl)

    class ParamlessModule(nn.Module):
        def forward(self, x, ys):
            return x + ys[0] + ys[1] + 1

    model = ParamlessModule()
    A.fully_shard(model)
    x, ys = torch.randn((3,)), (torch.randn((3,)), torch.randn((3,)))
    tc.assertEqual(model(x, ys), x + ys[0] + ys[1] + 1)


def _root_no_forward_inputs(impl):
    A = api(impl)

    class ParameterOnlyModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self):
            return self.weight @ self.weight

    model = ParameterOnlyModule()
    A.fully_shard(model)
    out = model()
    tc.assertEqual(out.shape, (4, 4))
    out.sum().backward()


def test_root_move_forward_input_to_device(dist_run, impl):
    dist_run(_root_move_forward_input_to_device, 2, impl, timeout=T)


def test_root_no_forward_inputs(dist_run, impl):
    dist_run(_root_no_forward_inputs, 2, impl, timeout=T)


# -- TestFullyShardRegisteredParams ------------------------------------------------------


def _assert_tensor_params(params):
    params = list(params)
    tc.assertGreater(len(params), 0)
    for p in params:
        tc.assertNotIsInstance(p, DTensor)
        tc.assertIsInstance(p, torch.Tensor)


def _assert_dtensor_params(params):
    params = list(params)
    tc.assertGreater(len(params), 0)
    for p in params:
        tc.assertIsInstance(p, DTensor)


def _assert_same_params(params, ref_params):
    params, ref_params = list(params), list(ref_params)
    tc.assertEqual(len(params), len(ref_params))
    for p, ref in zip(params, ref_params):
        if isinstance(p, DTensor):
            p = p.full_tensor()
        tc.assertEqual(p.shape, ref.shape)
        tc.assertEqual(p, ref)


def _param_registration_after_forward(impl, reshard_after_forward):
    A = api(impl)
    torch.manual_seed(42)
    model = MLP(3)
    broadcast_params(model)
    ref_model = copy.deepcopy(model)
    A.fully_shard(model, reshard_after_forward=reshard_after_forward)  # root only
    inp = torch.randn((2, 3))
    _assert_dtensor_params(model.parameters())
    _assert_same_params(model.parameters(), ref_model.parameters())
    model(inp)
    if reshard_after_forward:
        _assert_dtensor_params(model.parameters())
    else:
        _assert_tensor_params(model.parameters())
    _assert_same_params(model.parameters(), ref_model.parameters())
    model.reshard()
    _assert_dtensor_params(model.parameters())
    _assert_same_params(model.parameters(), ref_model.parameters())

    torch.manual_seed(42)
    model = nn.Sequential(MLP(3), MLP(3))
    broadcast_params(model)
    ref_model = copy.deepcopy(model)
    A.fully_shard(model[0].in_proj, reshard_after_forward=reshard_after_forward)
    A.fully_shard(model[0].out_proj, reshard_after_forward=reshard_after_forward)
    A.fully_shard(model, reshard_after_forward=reshard_after_forward)
    _assert_dtensor_params(model.parameters())
    _assert_same_params(model.parameters(), ref_model.parameters())
    model(inp)
    non_root = list(model[0].in_proj.parameters()) + list(model[0].out_proj.parameters())
    root = list(set(model.parameters()) - set(non_root))
    if reshard_after_forward is None:
        _assert_dtensor_params(non_root)
        _assert_tensor_params(root)
    elif reshard_after_forward:
        _assert_dtensor_params(non_root)
        _assert_dtensor_params(root)
    else:
        _assert_tensor_params(non_root)
        _assert_tensor_params(root)
    _assert_same_params(model.parameters(), ref_model.parameters())
    for module in model.modules():
        if isinstance(module, A.FSDPModule):
            module.reshard()
    _assert_dtensor_params(model.parameters())
    _assert_same_params(model.parameters(), ref_model.parameters())


@pytest.mark.parametrize("reshard_after_forward", [True, False, None, 2])
def test_param_registration_after_forward(dist_run, impl, reshard_after_forward):
    world_size = 4 if reshard_after_forward == 2 else 2  # 2 must be a proper divisor
    dist_run(_param_registration_after_forward, world_size, impl, reshard_after_forward, timeout=T)


def _param_registration_after_backward(impl, reshard_after_forward):
    A = api(impl)
    model = MLP(8)
    A.fully_shard(model, reshard_after_forward=reshard_after_forward)
    inp = torch.randn((2, 8))
    _assert_dtensor_params(model.parameters())
    model(inp).sum().backward()
    _assert_dtensor_params(model.parameters())
    model = MLP(8)
    A.fully_shard(model.in_proj, reshard_after_forward=reshard_after_forward)
    A.fully_shard(model.out_proj, reshard_after_forward=reshard_after_forward)
    A.fully_shard(model, reshard_after_forward=reshard_after_forward)
    _assert_dtensor_params(model.parameters())
    model(inp).sum().backward()
    _assert_dtensor_params(model.parameters())


@pytest.mark.parametrize("reshard_after_forward", [True, False, 2])
def test_param_registration_after_backward(dist_run, impl, reshard_after_forward):
    world_size = 4 if reshard_after_forward == 2 else 2
    dist_run(_param_registration_after_backward, world_size, impl, reshard_after_forward, timeout=T)


# -- TestFullyShardCastAfterInit ---------------------------------------------------------


def _to_float64_after_init(impl):
    A = api(impl)
    torch.manual_seed(42)
    mlp_dim, dtype = 4, torch.float64
    model = MLP(mlp_dim)
    broadcast_params(model)
    ref_model = copy.deepcopy(model).to(dtype)
    replicate(ref_model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for module in (model.in_proj, model.out_proj, model):
        A.fully_shard(module)
    model.to(dtype)
    for param in model.parameters():
        tc.assertEqual(param.dtype, dtype)
        tc.assertEqual(param.to_local().dtype, dtype)
        tc.assertEqual(param._spec.tensor_meta.dtype, dtype)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    check_sharded_parity(tc, ref_model, model)
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = torch.randn((2, mlp_dim), dtype=dtype)
    for iter_idx in range(10):
        losses = []
        for _model in (ref_model, model):
            losses.append(_model(inp).sum())
            losses[-1].backward()
        tc.assertEqual(losses[0], losses[1])
        check_sharded_parity(tc, ref_model, model)
        for param in model.parameters():
            tc.assertEqual(param.dtype, dtype)
            tc.assertEqual(param.to_local().dtype, dtype)
            tc.assertEqual(param._spec.tensor_meta.dtype, dtype)
            tc.assertEqual(param.grad.dtype, dtype)
            tc.assertEqual(param.grad.to_local().dtype, dtype)
            tc.assertEqual(param.grad._spec.tensor_meta.dtype, dtype)
        for _optim in (ref_optim, optim):
            _optim.step()
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))


def test_to_float64_after_init(dist_run, impl):
    dist_run(_to_float64_after_init, 2, impl, timeout=T)


# -- TestFullyShard1DTrainingCore --------------------------------------------------------


def _train_parity_single_group(impl, lin_shapes, use_shard_placement_fn):
    A = api(impl)
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(*lin_shapes[0]), nn.ReLU(), nn.Linear(*lin_shapes[1]))
    ref_model = copy.deepcopy(model)
    replicate(ref_model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)

    def _shard_placement_fn(param):
        from torch.distributed.tensor import Shard

        return Shard(param.shape.index(max(param.shape)))

    A.fully_shard(model, shard_placement_fn=_shard_placement_fn if use_shard_placement_fn else None)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = (torch.randn((4, lin_shapes[0][0])),)
    for iter_idx in range(10):
        losses = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            losses.append(_model(*inp).sum())
            losses[-1].backward()
            _optim.step()
        tc.assertEqual(losses[0], losses[1])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    "lin_shapes", [[(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]], ids=["16x15", "7x15", "16x17"]
)
def test_train_parity_single_group_shard_dim0(dist_run, impl, world_size, lin_shapes):
    dist_run(_train_parity_single_group, world_size, impl, lin_shapes, False, timeout=T)


def test_train_parity_single_group_shard_largest_dim(dist_run, impl):
    dist_run(_train_parity_single_group, 2, impl, [(32, 16), (16, 8)], True, timeout=T)


def _train_parity_multi_group(impl, reshard_after_forward, offload_policy=None):
    A = api(impl)
    torch.manual_seed(42)
    vocab_size = 1024
    model_args = ModelArgs(n_layers=3, n_heads=4, vocab_size=vocab_size, max_seq_len=64, dropout_p=0)
    model = Transformer(model_args)
    ref_model = copy.deepcopy(model)
    replicate(ref_model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    fully_shard_fn = functools.partial(
        A.fully_shard, reshard_after_forward=reshard_after_forward, offload_policy=offload_policy or OffloadPolicy()
    )
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard_fn(module)
    fully_shard_fn(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank() + 1)
    for iter_idx in range(10):
        inp = torch.randint(0, vocab_size, (3, 64))
        losses = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            losses.append(_model(inp).sum())
            losses[-1].backward()
            _optim.step()
        tc.assertEqual(losses[0], losses[1])


@pytest.mark.parametrize("reshard_after_forward", [True, False, 2])
def test_train_parity_multi_group(dist_run, impl, reshard_after_forward):
    world_size = 4 if reshard_after_forward == 2 else 2
    dist_run(_train_parity_multi_group, world_size, impl, reshard_after_forward, timeout=T)


def test_train_parity_multi_group_cpu_offload(dist_run, impl):
    # The original's offload_policy=CPUOffloadPolicy(pin_memory=False) subtest (pinning needs an accelerator)
    dist_run(_train_parity_multi_group, 2, impl, True, CPUOffloadPolicy(pin_memory=False), timeout=T)


def _non_root_forward_backward(impl):
    A = api(impl)
    world_size = dist.get_world_size()
    torch.manual_seed(42)
    lin_dim = 32
    model = nn.Sequential(*[MLP(lin_dim) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        A.fully_shard(mlp)
    A.fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randn((8, lin_dim))

    ref_root_loss = ref_model(inp).sum()
    ref_root_loss.backward()
    for param in ref_model.parameters():
        dist.all_reduce(param.grad)
        param.grad.detach().div_(world_size)
    ref_optim.step()
    ref_optim.zero_grad()
    ref_nonroot_loss = ref_model[0](inp).sum()
    ref_nonroot_loss.backward()
    for param in ref_model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad.detach().div_(world_size)
    ref_optim.step()

    root_loss = model(inp).sum()
    root_loss.backward()
    optim.step()
    optim.zero_grad()
    nonroot_loss = model[0](inp).sum()
    nonroot_loss.backward()
    optim.step()

    tc.assertEqual(ref_root_loss, root_loss)
    tc.assertEqual(ref_nonroot_loss, nonroot_loss)
    tc.assertEqual(ref_model(inp).sum(), model(inp).sum())


def test_non_root_forward_backward(dist_run, impl):
    dist_run(_non_root_forward_backward, 2, impl, timeout=T)


def _multi_forward_module(impl, reshard_after_forward):
    A = api(impl)

    class MultiForwardModule(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)
            self.outer = nn.Linear(4, 5)

        def forward(self, x):
            i = self.inner(x)
            j = self.inner(x)
            return self.outer(i + j)

    torch.manual_seed(42)
    model = MultiForwardModule()
    ref_model = copy.deepcopy(model)
    replicate(ref_model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    # As in the original, the subtest's reshard_after_forward is not passed to fully_shard.
    A.fully_shard(model.inner)
    A.fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randn((32, 4))
    for iter_idx in range(10):
        losses = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            losses.append(_model(inp).sum())
            losses[-1].backward()
            _optim.step()
        tc.assertEqual(losses[0], losses[1])


def test_multi_forward_module(dist_run, impl):
    dist_run(_multi_forward_module, 2, impl, None, timeout=T)


def _explicit_prefetching(impl):
    A = api(impl)
    torch.manual_seed(42)
    model_args = ModelArgs(n_layers=8, dropout_p=0.0)
    model = Transformer(model_args)
    ref_model = replicate(copy.deepcopy(model))
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for layer in itertools.chain(model.layers, [model]):
        A.fully_shard(layer)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    n = 2
    for i, layer in enumerate(model.layers):
        if i >= len(model.layers) - n:
            break
        layer.set_modules_to_forward_prefetch([model.layers[i + j] for j in range(1, n + 1)])
    for i, layer in enumerate(model.layers):
        if i < n:
            continue
        layer.set_modules_to_backward_prefetch([model.layers[i - j] for j in range(1, n + 1)])
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randint(0, model_args.vocab_size, (2, 8))
    for _ in range(10):
        losses = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            _optim.zero_grad()
            losses.append(_model(inp).sum())
            losses[-1].backward()
            _optim.step()
        tc.assertEqual(losses[0], losses[1])


def test_explicit_prefetching(dist_run, impl):
    dist_run(_explicit_prefetching, 2, impl, timeout=T)


# -- TestFullyShard1DTrainingCompose -----------------------------------------------------


def _train_parity_with_activation_checkpointing(impl, reshard_after_forward, checkpoint_impl, module_grouping):
    A = api(impl)
    torch.manual_seed(42)
    vocab_size = 1024
    model_args = ModelArgs(
        n_layers=3,
        n_heads=4,
        vocab_size=vocab_size,
        max_seq_len=64,
        dropout_p=0,
        checkpoint_activations=(checkpoint_impl == "utils"),
        weight_tying=module_grouping != "mem_eff",
    )
    model = Transformer(model_args)
    ref_model = replicate(copy.deepcopy(model))
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    prefixes_to_ignore = ()
    if checkpoint_impl == "wrapper":
        prefixes_to_ignore = (_CHECKPOINT_PREFIX,)
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
    elif checkpoint_impl == "composable":
        for module in model.modules():
            if isinstance(module, TransformerBlock):
                checkpoint(module)
    kw = {"reshard_after_forward": reshard_after_forward}
    if module_grouping == "mem_eff":
        A.fully_shard(model.layers[0], **kw)
        A.fully_shard([model.layers[1], model.layers[2]], **kw)
        A.fully_shard([model.tok_embeddings, model.pos_embeddings], **kw)
        model.tok_embeddings.set_unshard_in_backward(False)
        A.fully_shard([model.norm, model.output], **kw)
    elif module_grouping == "mem_eff_weight_tied":
        A.fully_shard([model.tok_embeddings, model.output], **kw)
        for layer in model.layers:
            A.fully_shard(layer, **kw)
    else:
        for layer in model.layers:
            A.fully_shard(layer, **kw)
    A.fully_shard(model, **kw)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randint(0, vocab_size, (3, 64))
    check_sharded_parity(tc, ref_model, model, prefixes_to_ignore=prefixes_to_ignore)
    for iter_idx in range(10):
        losses = []
        for _model in (ref_model, model):
            torch.manual_seed(iter_idx + 1)
            losses.append(_model(inp).sum())
            losses[-1].backward()
        check_sharded_parity(tc, ref_model, model, prefixes_to_ignore=prefixes_to_ignore)
        tc.assertEqual(losses[0], losses[1])
        for _optim in (ref_optim, optim):
            _optim.step()
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        check_sharded_parity(tc, ref_model, model, prefixes_to_ignore=prefixes_to_ignore)


@pytest.mark.parametrize("module_grouping", ["block", "mem_eff", "mem_eff_weight_tied"])
@pytest.mark.parametrize("checkpoint_impl", ["composable", "utils", "wrapper"])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_train_parity_with_activation_checkpointing(
    dist_run, impl, reshard_after_forward, checkpoint_impl, module_grouping
):
    dist_run(
        _train_parity_with_activation_checkpointing,
        2,
        impl,
        reshard_after_forward,
        checkpoint_impl,
        module_grouping,
        timeout=T,
    )


def _grouped_module_cast_forward_inputs(impl):
    A = api(impl)
    dim = 32

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(dim, dim, bias=False)
            self.b = nn.Linear(dim, dim, bias=False)

        def forward(self, x):
            return self.b(self.a(x).float())

    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    torch.manual_seed(42)
    model = Model()
    broadcast_params(model)
    A.fully_shard([model.a, model.b], mp_policy=mp_policy)
    A.fully_shard(model, mp_policy=mp_policy)
    out = model(torch.randn(2, dim))
    tc.assertEqual(out.dtype, torch.bfloat16)
    out.sum().backward()
    for name, p in model.named_parameters():
        tc.assertIsNotNone(p.grad, f"grad None for {name}")


def test_grouped_module_cast_forward_inputs(dist_run, impl):
    dist_run(_grouped_module_cast_forward_inputs, 2, impl, timeout=T)


def _snapshot_grad(grad):
    return grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()


def _partial_group_forward_then_standalone(impl, reshard_after_forward, weight_tying, mp_policy_mode, ac):
    A = api(impl)
    world_size = dist.get_world_size()
    dim, vocab_size, n_chunks = 32, 128, 4
    bf16_out = {"param_dtype": torch.float32, "output_dtype": torch.bfloat16}
    if mp_policy_mode == "bf16_everywhere":
        inner_mp = root_mp = MixedPrecisionPolicy(**bf16_out)
        expected_h_dtype = torch.bfloat16
    elif mp_policy_mode == "bf16_inner_only":
        inner_mp = MixedPrecisionPolicy(**bf16_out)
        root_mp = MixedPrecisionPolicy(param_dtype=torch.float32)
        expected_h_dtype = torch.bfloat16
    else:
        inner_mp = root_mp = MixedPrecisionPolicy()
        expected_h_dtype = torch.float32
    do_parity = mp_policy_mode == "none"
    do_grouping_parity = not weight_tying
    kw = {"reshard_after_forward": reshard_after_forward}

    def run_chunked(model, h_dtype):
        h = model(tokens, skip_head=True)
        tc.assertEqual(h.dtype, h_dtype)
        chunks = torch.chunk(h.detach().to(torch.float32), n_chunks, dim=1)
        h_grads, per_chunk = [], []
        total_loss = torch.tensor(0.0)
        for chunk in chunks:
            chunk = chunk.contiguous().detach().requires_grad_(True)
            out = model.head(chunk)
            tc.assertEqual(out.dtype, h_dtype)
            loss = out.sum()
            total_loss += loss.detach()
            loss.backward()
            h_grads.append(chunk.grad.detach())
            per_chunk.append(_snapshot_grad(model.head.weight.grad))
        for i in range(1, len(per_chunk)):
            tc.assertGreater((per_chunk[i] - per_chunk[i - 1]).norm().item(), 0.0, f"chunk {i} did not contribute")
        h.backward(torch.cat(h_grads, dim=1).to(h.dtype))
        return total_loss, per_chunk[-1]

    def new_model():
        torch.manual_seed(42)
        m = ChunkedHeadModel(dim, vocab_size, weight_tying)
        broadcast_params(m)
        if ac:
            checkpoint(m.body)
        return m

    def shard(m, grouped):
        if grouped and weight_tying:
            A.fully_shard(m.body, mp_policy=root_mp, **kw)
            A.fully_shard([m.embed, m.norm, m.head], mp_policy=inner_mp, **kw)
        else:
            A.fully_shard(m.embed, mp_policy=root_mp, **kw)
            A.fully_shard(m.body, mp_policy=root_mp, **kw)
            if grouped:
                A.fully_shard([m.norm, m.head], mp_policy=inner_mp, **kw)
            else:
                A.fully_shard(m.norm, mp_policy=inner_mp, **kw)
                A.fully_shard(m.head, mp_policy=inner_mp, **kw)
        A.fully_shard(m, mp_policy=root_mp, **kw)
        return torch.optim.Adam(m.parameters(), lr=1e-2)

    torch.manual_seed(42)
    tokens = torch.randint(0, vocab_size, (2, 16))
    ref_model = new_model()
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    model = new_model()
    optim = shard(model, grouped=True)
    if do_grouping_parity:
        ungrouped = new_model()
        ungrouped_optim = shard(ungrouped, grouped=False)
    for iter_idx in range(10):
        loss, head_grad = run_chunked(model, expected_h_dtype)
        if do_grouping_parity:
            ug_loss, ug_head_grad = run_chunked(ungrouped, expected_h_dtype)
            tc.assertEqual(ug_loss, loss)
            tc.assertEqual(ug_head_grad, head_grad)
            for (name, ug_p), (_, p) in zip(ungrouped.named_parameters(), model.named_parameters()):
                # Full tensors: unit layouts differ between the groupings for ours (the planner
                # packs each unit), so local shards are not comparable; full gradients are.
                tc.assertEqual(ug_p.grad.full_tensor(), p.grad.full_tensor(), msg=f"grad {name}")
        if do_parity:
            ref_loss, ref_head_grad = run_chunked(ref_model, torch.float32)
            for p in ref_model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world_size)
            dist.all_reduce(ref_head_grad)
            ref_head_grad.div_(world_size)
            tc.assertEqual(head_grad, ref_head_grad)
            tc.assertEqual(ref_loss, loss)
            check_sharded_parity(tc, ref_model, model)
            ref_optim.step()
            ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        optim.step()
        optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        if do_grouping_parity:
            ungrouped_optim.step()
            ungrouped_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            for (name, ug_p), (_, p) in zip(ungrouped.named_parameters(), model.named_parameters()):
                tc.assertEqual(ug_p.full_tensor(), p.full_tensor(), msg=f"param {name}")


@pytest.mark.parametrize("mp_policy_mode", ["none", "bf16_everywhere", "bf16_inner_only"])
@pytest.mark.parametrize("weight_tying", [False, True])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_partial_group_forward_then_standalone(dist_run, impl, reshard_after_forward, weight_tying, mp_policy_mode):
    dist_run(
        _partial_group_forward_then_standalone,
        2,
        impl,
        reshard_after_forward,
        weight_tying,
        mp_policy_mode,
        False,
        timeout=T,
    )


def test_partial_group_forward_then_standalone_ac(dist_run, impl):
    dist_run(_partial_group_forward_then_standalone, 2, impl, True, False, "none", True, timeout=T)


def test_partial_group_forward_then_standalone_int_reshard(dist_run, impl):
    dist_run(_partial_group_forward_then_standalone, 2, impl, 1, False, "none", False, timeout=T)


def _partial_group_forward_grad_accum_chunked(impl, reshard_after_forward):
    A = api(impl)
    dim, vocab_size, n_chunks, n_microbatches = 32, 128, 2, 3
    kw = {"reshard_after_forward": reshard_after_forward}

    def setup(grouped):
        torch.manual_seed(42)
        m = ChunkedHeadModel(dim, vocab_size, tie=False)
        broadcast_params(m)
        A.fully_shard(m.embed, **kw)
        A.fully_shard(m.body, **kw)
        if grouped:
            A.fully_shard([m.norm, m.head], **kw)
        else:
            A.fully_shard(m.norm, **kw)
            A.fully_shard(m.head, **kw)
        A.fully_shard(m, **kw)
        return m

    ref_model, model = setup(grouped=False), setup(grouped=True)
    tokens_list = [torch.randint(0, vocab_size, (2, 16)) for _ in range(n_microbatches)]
    for m in (ref_model, model):
        for i, tokens in enumerate(tokens_list):
            is_last = i == n_microbatches - 1
            m.set_requires_gradient_sync(is_last)
            m.set_is_last_backward(is_last)
            h = m(tokens, skip_head=True)
            h_grads = []
            for chunk in torch.chunk(h.detach(), n_chunks, dim=1):
                chunk = chunk.contiguous().detach().requires_grad_(True)
                m.head(chunk).sum().backward()
                h_grads.append(chunk.grad.detach())
            h.backward(torch.cat(h_grads, dim=1))
    for (name, ref_p), (_, p) in zip(ref_model.named_parameters(), model.named_parameters()):
        # Full tensors: ours lays each grouping's units out differently (see above).
        tc.assertEqual(ref_p.grad.full_tensor(), p.grad.full_tensor(), msg=f"grad mismatch for {name}")


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_partial_group_forward_grad_accum_chunked(dist_run, impl, reshard_after_forward):
    dist_run(_partial_group_forward_grad_accum_chunked, 2, impl, reshard_after_forward, timeout=T)


def _reset_iter_state_after_exception(impl):
    A = api(impl)
    dim, vocab_size = 32, 128

    class Raiser(nn.Module):
        def __init__(self, wrapped):
            super().__init__()
            self.wrapped = wrapped
            self.armed = False

        def forward(self, x):
            if self.armed:
                raise RuntimeError("boom")
            return self.wrapped(x)

    torch.manual_seed(42)
    model = ChunkedHeadModel(dim, vocab_size, tie=False)
    model.body = Raiser(model.body)
    broadcast_params(model)
    A.fully_shard([model.norm, model.head])
    A.fully_shard(model)
    tokens = torch.randint(0, vocab_size, (2, 16))
    model.body.armed = True
    with tc.assertRaises(RuntimeError):
        model(tokens, skip_head=True)
    model.body.armed = False
    model.reset_iter_state()
    model(tokens).sum().backward()
    for name, param in model.named_parameters():
        tc.assertIsNotNone(param.grad, f"grad None for {name} after reset")


def test_reset_iter_state_after_exception(dist_run, impl):
    dist_run(_reset_iter_state_after_exception, 2, impl, timeout=T)


def _double_forward_with_nested_fsdp_and_checkpoint(impl, reshard_after_forward, checkpoint_impl):
    A = api(impl)
    torch.manual_seed(42)
    vocab_size = 1024
    model_args = ModelArgs(
        n_layers=3,
        n_heads=4,
        vocab_size=vocab_size,
        max_seq_len=64,
        dropout_p=0,
        checkpoint_activations=(checkpoint_impl == "utils"),
    )
    model = Transformer(model_args)
    if checkpoint_impl == "composable":
        for module in model.modules():
            if isinstance(module, TransformerBlock):
                checkpoint(module)
    for layer in model.layers:
        A.fully_shard(layer.attention, reshard_after_forward=reshard_after_forward)
        A.fully_shard(layer.feed_forward, reshard_after_forward=reshard_after_forward)
        A.fully_shard(layer, reshard_after_forward=reshard_after_forward)
    A.fully_shard(model, reshard_after_forward=reshard_after_forward)
    torch.manual_seed(42 + dist.get_rank())
    inp1 = torch.randint(0, vocab_size, (2, 32))
    inp2 = torch.randint(0, vocab_size, (2, 32))
    out1, out2 = model(inp1), model(inp2)
    (out1.sum() - out2.sum()).pow(2).backward()
    for param in model.parameters():
        if param.requires_grad:
            tc.assertIsNotNone(param.grad)


@pytest.mark.parametrize("checkpoint_impl", ["composable", "utils"])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_double_forward_with_nested_fsdp_and_checkpoint(dist_run, impl, reshard_after_forward, checkpoint_impl):
    dist_run(
        _double_forward_with_nested_fsdp_and_checkpoint, 2, impl, reshard_after_forward, checkpoint_impl, timeout=T
    )


def _double_partial_forward_then_backward(impl):
    A = api(impl)
    dim, vocab_size = 32, 128
    torch.manual_seed(42)
    model = ChunkedHeadModel(dim, vocab_size, tie=False)
    broadcast_params(model)
    A.fully_shard([model.norm, model.head])
    A.fully_shard(model)
    tokens1 = torch.randint(0, vocab_size, (2, 16))
    tokens2 = torch.randint(0, vocab_size, (2, 16))
    h1 = model(tokens1, skip_head=True)
    h2 = model(tokens2, skip_head=True)
    (h1.sum() + h2.sum()).backward()
    params = dict(model.named_parameters())
    for name in ("embed.weight", "norm.weight"):
        tc.assertIsNotNone(params[name].grad, f"grad is None for {name}")
        local = params[name].grad.to_local() if isinstance(params[name].grad, DTensor) else params[name].grad
        tc.assertTrue(torch.isfinite(local).all().item())
    tc.assertIsNone(model.head.weight.grad)


def test_double_partial_forward_then_backward(dist_run, impl):
    dist_run(_double_partial_forward_then_backward, 2, impl, timeout=T)


# -- TestFullyShardSharedParams ----------------------------------------------------------


def _train_shared_params(impl, reshard_after_forward, use_activation_checkpointing):
    A = api(impl)
    torch.manual_seed(42)
    model_args = ModelArgs(n_layers=3, dropout_p=0.0, weight_tying=True)
    model = Transformer(model_args)
    ref_model = copy.deepcopy(model)
    replicate(ref_model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            if use_activation_checkpointing:
                checkpoint(module)
            A.fully_shard(module, reshard_after_forward=reshard_after_forward)
    A.fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank() + 1)
    for iter_idx in range(10):
        inp = torch.randint(0, model_args.vocab_size, (2, 16))
        losses = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            losses.append(_model(inp).sum())
            losses[-1].backward()
            _optim.step()
        tc.assertEqual(losses[0], losses[1])


@pytest.mark.parametrize("use_activation_checkpointing", [False, True])
@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_train_parity_with_shared_params(dist_run, impl, reshard_after_forward, use_activation_checkpointing):
    dist_run(_train_shared_params, 2, impl, reshard_after_forward, use_activation_checkpointing, timeout=T)


def _train_shared_params_uneven_shard(impl, reshard_after_forward):
    A = api(impl)
    hidden_size = 16
    vocab_size = dist.get_world_size() * 4 + 1

    class TiedModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
            self.output = nn.Linear(hidden_size, vocab_size, bias=False)
            self.output.weight = self.tok_embeddings.weight

        def forward(self, ids):
            return self.output(self.tok_embeddings(ids))

    torch.manual_seed(42)
    model = TiedModel()
    A.fully_shard([model.tok_embeddings, model.output], reshard_after_forward=reshard_after_forward)
    A.fully_shard(model, reshard_after_forward=reshard_after_forward)
    model.tok_embeddings.unshard()
    initial_weight = model.tok_embeddings.weight.detach().clone()
    model.tok_embeddings.reshard()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank())
    for _ in range(10):
        ids = torch.randint(0, vocab_size, (2, 8))
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits.view(-1, vocab_size).float(), ids.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.tok_embeddings.unshard()
    final_weight = model.tok_embeddings.weight
    for row in range(vocab_size):
        tc.assertFalse(torch.equal(initial_weight[row], final_weight[row]), f"Row {row} was not updated")
    model.tok_embeddings.reshard()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_train_shared_params_uneven_shard(dist_run, impl, reshard_after_forward, world_size):
    dist_run(_train_shared_params_uneven_shard, world_size, impl, reshard_after_forward, timeout=T)


def _shared_params_separate_fsdp_groups_error(impl):
    A = api(impl)
    hidden_size, vocab_size = 16, 17

    class TiedModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
            self.output = nn.Linear(hidden_size, vocab_size, bias=False)
            self.output.weight = self.tok_embeddings.weight

        def forward(self, ids):
            return self.output(self.tok_embeddings(ids))

    model = TiedModel()
    A.fully_shard(model.tok_embeddings)
    A.fully_shard(model.output)
    A.fully_shard(model)
    ids = torch.randint(0, vocab_size, (2, 8))
    with tc.assertRaisesRegex(ValueError, "already managed by another"):
        model(ids)


@pytest.mark.vescale_differs(
    "ours refuses a weight tied across sibling units earlier, at the second fully_shard call "
    "(tests/runtime/test_fsdp2_edge_cases.py::test_weight_tied_across_sibling_units_is_refused_or_grouped); "
    "FSDP2 refuses at the first forward"
)
def test_shared_params_separate_fsdp_groups_error(dist_run, impl):
    dist_run(_shared_params_separate_fsdp_groups_error, 2, impl, timeout=T)


def _layer_by_layer_shard_no_false_positive(impl):
    A = api(impl)
    dim, n_blocks = 16, 8

    class SimpleBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.linear = nn.Linear(dim, dim, bias=False)

        def forward(self, x):
            return self.linear(self.norm(x))

    class LayerByLayerModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList()

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    model = LayerByLayerModel()
    for _ in range(n_blocks):
        block = SimpleBlock()
        model.blocks.append(block)
        A.fully_shard(block)
        gc.collect()
    A.fully_shard(model)
    model(torch.randn(2, 4, dim)).sum().backward()


def test_layer_by_layer_shard_no_false_positive(dist_run, impl):
    dist_run(_layer_by_layer_shard_no_false_positive, 2, impl, timeout=T)


# -- TestFullyShardGradientAccumulation --------------------------------------------------


def _gradient_accumulation(impl, reshard_after_forward, mode, reshard_after_backward):
    from collections import defaultdict

    from torch.distributed.tensor.debug import CommDebugMode

    c10d_ops = torch.ops.c10d
    A = api(impl)
    torch.manual_seed(42)
    batch_size, lin_dim, num_mlps, num_microbatches = 2, 32, 3, 3
    num_mlps_to_disable_reduce_scatter = 2
    modules = [nn.Linear(lin_dim, lin_dim)]
    modules.extend(MLP(lin_dim) for _ in range(num_mlps))
    model = nn.Sequential(*modules)
    ref_model = copy.deepcopy(model)
    fully_shard_fn = functools.partial(A.fully_shard, reshard_after_forward=reshard_after_forward)
    for mlp in model[1:]:
        fully_shard_fn(mlp)
    fully_shard_fn(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    def set_backward_flags(_model, is_last):
        if mode == "all":
            _model.set_requires_gradient_sync(is_last)
            if not reshard_after_backward:
                _model.set_reshard_after_backward(is_last)
        elif mode == "some_mlps":
            for mlp in model[1 : 1 + num_mlps_to_disable_reduce_scatter]:
                mlp.set_requires_gradient_sync(is_last)
                if not reshard_after_backward:
                    mlp.set_reshard_after_backward(is_last)
        elif mode == "root_only":
            _model.set_requires_gradient_sync(is_last, recurse=False)
            if not reshard_after_backward:
                _model.set_reshard_after_backward(is_last, recurse=False)

    torch.manual_seed(42 + dist.get_rank() + 1)
    for iter_idx in range(5):
        comm_count_list = []
        for microbatch_idx in range(num_microbatches):
            is_last = microbatch_idx == num_microbatches - 1
            set_backward_flags(model, is_last)
            inp = torch.randn(batch_size, lin_dim)
            losses = []
            for _model in (ref_model, model):
                with CommDebugMode() as comm_mode:
                    losses.append(_model(inp).sum())
                    losses[-1].backward()
                comm_count_list.append(comm_mode.get_comm_counts())
            tc.assertEqual(losses[0], losses[1])
        comm_counts = defaultdict(int)
        for d in comm_count_list:
            for collective, count in d.items():
                comm_counts[collective] += count
        all_gather_count = comm_counts[c10d_ops._allgather_base_]
        reduce_scatter_count = comm_counts[c10d_ops._reduce_scatter_base_]
        all_reduce_count = comm_counts[c10d_ops.allreduce_]
        expected_rs = num_mlps + 1
        if mode == "some_mlps":
            expected_rs += (num_mlps - num_mlps_to_disable_reduce_scatter + 1) * (num_microbatches - 1)
        elif mode == "root_only":
            expected_rs += num_mlps * (num_microbatches - 1)
        # Which c10d ops carry the collectives is FSDP2's implementation (veScale's in-place
        # DBuffer collectives are other ops): counted for torch only (README).
        if impl == "torch":
            tc.assertEqual(reduce_scatter_count, expected_rs)
            tc.assertEqual(all_reduce_count, 0)
        expected_ag = num_mlps + 1
        if reshard_after_forward is not False:
            expected_ag += num_mlps + 1
            expected_ag *= num_microbatches
        elif reshard_after_backward:
            expected_ag *= num_microbatches
        elif mode == "all":
            pass
        elif mode == "root_only":
            expected_ag += num_mlps * (num_microbatches - 1)
        if impl == "torch":
            tc.assertEqual(all_gather_count, expected_ag)
        allreduce_avg_grads(ref_model)
        check_sharded_parity(tc, ref_model, model)
        for _optim in (optim, ref_optim):
            _optim.step()
            _optim.zero_grad(set_to_none=(iter_idx % 2))


def _grad_acc_cases():
    for rfa in (True, False, 2):
        for mode in ("all", "root_only", "some_mlps"):
            for rab in (False, True):
                if not rab and (rfa is not False or mode == "some_mlps"):
                    continue  # the original skips these as not common
                marks = []
                yield pytest.param(rfa, mode, rab, marks=marks, id=f"rfa{rfa}-{mode}-rab{rab}")


@pytest.mark.parametrize(("reshard_after_forward", "mode", "reshard_after_backward"), list(_grad_acc_cases()))
def test_gradient_accumulation(dist_run, impl, reshard_after_forward, mode, reshard_after_backward):
    world_size = 4 if reshard_after_forward == 2 else 2
    dist_run(_gradient_accumulation, world_size, impl, reshard_after_forward, mode, reshard_after_backward, timeout=T)


def _1f1b_microbatching(impl, use_explicit_unshard, reshard_after_backward):
    A = api(impl)
    torch.manual_seed(42)
    model_args = ModelArgs(dropout_p=0.0)
    model = Transformer(model_args)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            A.fully_shard(module, reshard_after_forward=False)
    A.fully_shard(model, reshard_after_forward=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    num_microbatches, local_batch_size = 3, 2
    torch.manual_seed(42 + dist.get_rank() + 1)
    inps = [torch.randint(0, model_args.vocab_size, (local_batch_size, 16)) for _ in range(num_microbatches)]
    if use_explicit_unshard:
        for module in model.modules():
            if isinstance(module, A.FSDPModule):
                module.unshard(async_op=True)
    losses, ref_losses = [], []
    for inp_idx, inp in enumerate(inps):
        is_last = inp_idx == num_microbatches - 1
        model.set_requires_gradient_sync(is_last)
        model.set_is_last_backward(is_last)
        if not reshard_after_backward:
            model.set_reshard_after_backward(is_last)
        losses.append(model(inp).sum())
        losses[-1].backward()
        ref_losses.append(ref_model(inp).sum())
        ref_losses[-1].backward()
    allreduce_avg_grads(ref_model)
    for loss, ref_loss in zip(losses, ref_losses):
        tc.assertEqual(loss, ref_loss)
    optim.step()
    ref_optim.step()
    check_sharded_parity(tc, ref_model, model)


@pytest.mark.parametrize("reshard_after_backward", [False, True])
@pytest.mark.parametrize("use_explicit_unshard", [False, True])
def test_1f1b_microbatching(dist_run, impl, use_explicit_unshard, reshard_after_backward):
    dist_run(_1f1b_microbatching, 2, impl, use_explicit_unshard, reshard_after_backward, timeout=T)


# -- TestFullyShardHSDPTraining ----------------------------------------------------------


def _train_parity_hsdp(impl, reshard_after_forward):
    """The original's subtests for one ``reshard_after_forward`` (activation checkpointing,
    gradient sync only at the last micro-batch or at every one, and the two MLP widths of its
    three that shard unevenly: 3 and 17; 16 is left out for time), on a 2x2 (replicate,
    shard) mesh against a ``replicate`` (DDP) reference."""
    from torch.distributed.device_mesh import init_device_mesh

    A = api(impl)
    global_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for use_activation_checkpointing, mlp_dim, sync_gradients_at_last_batch in itertools.product(
        [False, True], [3, 17], [True, False]
    ):
        torch.manual_seed(42)
        model = nn.Sequential(
            nn.LayerNorm(mlp_dim, bias=False),
            MLP(mlp_dim, dim_multiplier=3),
            MLP(mlp_dim),
            MLP(mlp_dim, dim_multiplier=3),
        )
        ref_model = copy.deepcopy(model)
        replicate(ref_model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for mlp in model:
            if use_activation_checkpointing:
                checkpoint(mlp)
            A.fully_shard(mlp, mesh=global_mesh, reshard_after_forward=reshard_after_forward)
        A.fully_shard(model, mesh=global_mesh, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        check_sharded_parity(tc, ref_model, model)
        torch.manual_seed(42 + dist.get_rank() + 1)
        num_microbatches = 3
        for iter_idx in range(5):
            for microbatch_idx in range(num_microbatches):
                is_last_microbatch = microbatch_idx == num_microbatches - 1
                if sync_gradients_at_last_batch:
                    model.set_requires_gradient_sync(is_last_microbatch)
                inp = torch.randn((8, mlp_dim))
                losses = []
                for _model in (ref_model, model):
                    losses.append(_model(inp).sum())
                    losses[-1].backward()
                tc.assertEqual(losses[0], losses[1])
            check_sharded_parity(tc, ref_model, model)
            for _optim in (ref_optim, optim):
                _optim.step()
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            check_sharded_parity(tc, ref_model, model)


@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_train_parity_hsdp(dist_run, impl, reshard_after_forward):
    dist_run(_train_parity_hsdp, 4, impl, reshard_after_forward, timeout=2 * T)
