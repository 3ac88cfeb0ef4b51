"""test_fully_shard_compile.py of torch 2.13 (FSDP2 under ``torch.compile``), on CPU/gloo.

Torch 2.13's file has four cases, all of which run on CPU (the original skips them without a
GPU only through class decorators; nothing in them needs one):

- ``test_disable_compiling_hooks``: ``model.compile()`` (inductor, here its CPU backend) over
  a sharded ``MLP``; Dynamo must never consult its trace rules for a frame of the file that
  holds the implementation's hooks, i.e. it never traces into them.
- ``test_dynamo_trace_use_training_state``: Dynamo traces FSDP2's private
  ``FSDPParamGroup.use_training_state`` with ``fullgraph=True`` (torch only, see README).
- ``test_trace_fsdp_copy_``: FSDP2's ``torch.ops.fsdp.copy_`` op under ``aot_eager``
  (torch only, see README).
- ``test_dynamo_recompiles_on_fsdp_layers``: a model whose ``Linear`` children were each
  ``torch.compile``-d is sharded and run forward. The original wraps it in FSDP1
  (``FullyShardedDataParallel(FULL_SHARD, use_orig_params=True)``); here ``fully_shard``
  from the switch shards it, as the rest of the suite does.

Changes from the originals: CPU for CUDA, gloo for NCCL, world size 2, the implementation's
hooks (the ``vescale_plugins`` package) for FSDP2's ``_fsdp_state.py``, ``fully_shard`` for
FSDP1 and, added to the last case, its output against the unsharded model's, no graph break
and FSDP2's graph count.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
import torch.distributed as dist
from torch.testing._internal.common_fsdp import MLP

from ._compat import api, tc

T = 300


# -- TestFullyShardCompileCompute.test_disable_compiling_hooks ---------------------------------


def _in_hooks_file(impl: str):
    """Whether a code object is hook code Dynamo must never trace.

    FSDP2's hooks live in ``_fsdp_state.py``, each behind ``_dynamo_disable``'s ``wrapper``
    (a frame Dynamo may see). Ours live in ``vescale_plugins/runtime/`` and call into
    ``dbuffer/`` and ``ragged/``, behind ``torch._disable_dynamo``, whose wrapper is torch's
    code: no frame of the whole package may be traced.
    """
    if impl == "torch":
        hooks_file = "torch/distributed/fsdp/_fully_shard/_fsdp_state.py"
        return lambda f_code: f_code.co_filename.endswith(hooks_file) and f_code.co_name != "wrapper"
    import vescale_plugins

    package = str(Path(vescale_plugins.__file__).parent) + "/"
    return lambda f_code: f_code.co_filename.startswith(package)


def _disable_compiling_hooks(impl):
    """Verify that Dynamo never traces into the hooks."""
    A = api(impl)
    in_hooks_file = _in_hooks_file(impl)
    torch._dynamo.reset()
    trace_rules_check_count = 0
    traced: list[str] = []

    def patched_trace_rules_check(*args, **kwargs):
        nonlocal trace_rules_check_count
        f_code = args[0]
        if hasattr(f_code, "co_filename") and in_hooks_file(f_code):
            trace_rules_check_count += 1
            traced.append(f"{f_code.co_filename}:{f_code.co_name}")
        return orig_trace_rules_check(*args, **kwargs)

    orig_trace_rules_check = torch._dynamo.trace_rules.check
    dist.barrier()
    torch._dynamo.trace_rules.check = patched_trace_rules_check
    try:
        model = MLP(4)
        A.fully_shard(model)
        model.compile()
        model(torch.randn((4, 4)))
        dist.barrier()
    finally:
        torch._dynamo.trace_rules.check = orig_trace_rules_check
        torch._dynamo.reset()
    tc.assertEqual(trace_rules_check_count, 0, msg=f"Dynamo traced into the hooks: {traced}")


def test_disable_compiling_hooks(dist_run, impl):
    dist_run(_disable_compiling_hooks, 2, impl, timeout=T)


# -- TestFullyShardCompile.test_dynamo_trace_use_training_state --------------------------------


def _dynamo_trace_use_training_state():
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    torch._dynamo.reset()
    # A dummy FSDPParamGroup: only its `use_training_state` context manager is under test.
    param_group = FSDPParamGroup(
        [],  # params
        (torch.nn.Linear(1, 1),),  # modules
        None,  # mesh_info
        None,  # post_forward_mesh_info
        torch.device("cpu"),  # device
        None,  # shard_placement_fn
        None,  # mp_policy
        None,  # offload_policy
    )

    def f(x):
        param_group._training_state = TrainingState.IDLE
        with param_group.use_training_state(TrainingState.FORWARD):
            if param_group._training_state == TrainingState.FORWARD:
                return x + 1
            else:
                return x

    inp = torch.zeros(1)
    tc.assertEqual(param_group._training_state, TrainingState.IDLE)

    eager_out = f(inp)
    tc.assertEqual(param_group._training_state, TrainingState.IDLE)
    tc.assertEqual(eager_out, inp + 1)

    cnt = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled_out = torch.compile(f, backend=cnt, fullgraph=True)(inp)
    tc.assertEqual(param_group._training_state, TrainingState.IDLE)
    tc.assertEqual(eager_out, compiled_out)
    tc.assertEqual(cnt.frame_count, 1)
    tc.assertEqual(cnt.op_count, 1)
    tc.assertEqual(len(cnt.graphs), 1)
    torch._dynamo.reset()


@pytest.mark.vescale_differs(
    "FSDP2's private FSDPParamGroup.use_training_state, which Dynamo special-cases; ours keeps "
    "its training state inside hooks Dynamo never traces (test_disable_compiling_hooks)"
)
def test_dynamo_trace_use_training_state(dist_run, impl):
    dist_run(_dynamo_trace_use_training_state, 2, timeout=T)


# -- TestFullyShardCompile.test_trace_fsdp_copy_ -----------------------------------------------


@functools.cache
def _add_one_out_op() -> None:
    """The original's ``mylib::add_one_out``, defined once per worker process (the pool is reused)."""

    @torch.library.custom_op("mylib::add_one_out", mutates_args={"out"})
    def add_one_out(x: torch.Tensor, out: torch.Tensor) -> None:
        torch.add(x, 1, out=out)


def _trace_fsdp_copy_():
    import torch.distributed.fsdp._fully_shard._fsdp_param  # defines torch.ops.fsdp.copy_

    _add_one_out_op()
    torch._dynamo.reset()

    def f(x):
        buf = torch.zeros(2)
        buf_view = buf.view(-1)
        torch.ops.mylib.add_one_out(x, out=buf_view)
        buf_view2 = buf.view(-1)
        torch.ops.fsdp.copy_(x, buf_view2)

    ref_x = torch.zeros(2)
    x = copy.deepcopy(ref_x)
    f(ref_x)
    torch.compile(f, backend="aot_eager")(x)
    tc.assertEqual(x, ref_x)
    torch._dynamo.reset()


@pytest.mark.vescale_differs(
    "FSDP2's own torch.ops.fsdp.copy_ op, not fully_shard; ours does not use it (its gathered "
    "parameters are views of the all-gather buffer)"
)
def test_trace_fsdp_copy_(dist_run, impl):
    dist_run(_trace_fsdp_copy_, 2, timeout=T)


# -- TestFullyShardCompile.test_dynamo_recompiles_on_fsdp_layers -------------------------------


class _Mod(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(
            torch.nn.Linear(28 * 28, 1024),
            torch.nn.Linear(1024, 1024),
            torch.nn.Linear(1024, 4096),
        )

    def forward(self, x):
        return self.encoder(x)


def _dynamo_recompiles_on_fsdp_layers(impl):
    from torch._dynamo.utils import counters

    A = api(impl)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = _Mod()
    ref = copy.deepcopy(m)
    for name, child in m.encoder.named_children():
        if isinstance(child, torch.nn.Linear):
            new_child = torch.compile(child)
            setattr(m.encoder, name, new_child)
    A.fully_shard(m)  # the original: FSDP(m, sharding_strategy=FULL_SHARD, use_orig_params=True)
    inp = torch.randn(32, 784)
    out = m(inp)
    # Added: the unsharded model's output, no graph break and one graph per compiled child
    # (FSDP2's count, checked by the --fsdp-impl=torch run).
    tc.assertEqual(out, ref(inp))
    tc.assertEqual(dict(counters["graph_break"]), {})
    tc.assertEqual(counters["stats"]["unique_graphs"], 3)
    torch._dynamo.reset()


def test_dynamo_recompiles_on_fsdp_layers(dist_run, impl):
    dist_run(_dynamo_recompiles_on_fsdp_layers, 2, impl, timeout=T)
