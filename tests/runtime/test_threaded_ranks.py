"""Ranks as threads of one process (torch's ``MultiThreadedTestCase``: a thread per rank, a
threaded process group): FSDP2's threaded cases, for torch's ``fully_shard`` and ours.

Every process group, mesh and cache is then one per rank-thread, so state kept per process
(a module-level cache keyed by ranks or by a mesh's value) hands one rank another rank's
group. The cases are FSDP2's (``test_fully_shard_init.py``'s HSDP broadcast and custom
all-reduce hooks, ``test_fully_shard_training.py``'s registered parameters), on CPU.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _fsdp(impl: str):
    """(fully_shard, FSDPModule) of torch's FSDP2 or ours; FSDPModule is torch's for both."""
    from torch.distributed import fsdp

    if impl == "torch":
        return fsdp.fully_shard, fsdp.FSDPModule
    import vescale_plugins

    return vescale_plugins.fully_shard, fsdp.FSDPModule


def _pairs(by: str) -> dist.ProcessGroup:
    """This rank's group among pairs of the 4 ranks: ``"node"`` (0, 1), (2, 3); ``"replica"``
    (0, 2), (1, 3). Every rank creates both groups of an enumeration."""
    enumeration = [[0, 1], [2, 3]] if by == "node" else [[0, 2], [1, 3]]
    group, _ = dist.new_subgroups_by_enumeration(enumeration)
    return group


def _node_mesh() -> DeviceMesh:
    group = _pairs("node")
    return DeviceMesh.from_group(group, "cpu", dist.get_process_group_ranks(group), mesh_dim_names=("shard",))


class _ThreadedRanks(MultiThreadedTestCase):
    impl = ""

    @property
    def world_size(self) -> int:
        return 4

    def setUp(self) -> None:
        super().setUp()
        self._spawn_threads()

    def test_hsdp_broadcast_across_replicas(self) -> None:
        fully_shard, _ = _fsdp(self.impl)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        args = ModelArgs(dropout_p=0.0)
        model = Transformer(args)
        model.buf = nn.Buffer(torch.randn((args.dim,)))
        for module in model.modules():
            if isinstance(module, TransformerBlock):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if mesh.get_local_rank("replicate") > 0:
            for tensor in itertools.chain(model.parameters(), model.buffers()):
                tensor.detach().fill_(1337)
        replicate_group = mesh.get_group("replicate")

        def replicas_of(tensor: torch.Tensor) -> list[torch.Tensor]:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            gathered = [torch.empty_like(local) for _ in range(mesh["replicate"].size())]
            dist.all_gather(gathered, local, group=replicate_group)
            return gathered

        for tensor in itertools.chain(model.parameters(), model.buffers()):
            first, second = replicas_of(tensor)
            if first.numel():  # ours may leave a rank no element of a small parameter
                self.assertNotEqual(first, second)
        src = dist.get_process_group_ranks(replicate_group)[0]
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(tensor.to_local() if isinstance(tensor, DTensor) else tensor, src=src, group=replicate_group)
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            first, second = replicas_of(tensor)
            self.assertEqual(first, second)
        model(torch.randint(0, args.vocab_size, (2, 16))).sum().backward()

    def test_all_reduce_hook_on_a_custom_stream(self) -> None:
        fully_shard, _ = _fsdp(self.impl)
        hsdp = fully_shard(
            MLP(10, bias=False), mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        )
        with self.assertRaisesRegex(ValueError, "stream cannot be set when using native HSDP"):
            hsdp.set_all_reduce_hook(lambda output: output, stream=torch.cpu.Stream())
        calls = []
        model = fully_shard(MLP(10, bias=False), mesh=_node_mesh())
        model.set_all_reduce_hook(calls.append, stream=torch.cpu.Stream())
        model(torch.arange(10, dtype=torch.float32).view(1, 10)).sum().backward()
        self.assertEqual(len(calls), 1)

    def test_custom_hsdp_all_reduce_hook(self) -> None:
        fully_shard, _ = _fsdp(self.impl)
        replicas = _pairs("replica")
        mesh = _node_mesh()
        model = MLP(10, bias=False)
        node = dist.get_rank() // 2
        nn.init.constant_(model.in_proj.weight, 1.0 * node)  # constant within each node
        nn.init.constant_(model.out_proj.weight, 2.0 * node)
        fully_shard(model, mesh=mesh)
        calls = []

        def average_across_replicas(output: torch.Tensor) -> None:
            dist.all_reduce(output, group=replicas)
            output.div_(2)
            calls.append(True)

        model.set_all_reduce_hook(average_across_replicas)
        model(torch.arange(10, dtype=torch.float32, requires_grad=True).view(1, 10)).sum().backward()
        self.assertEqual(calls, [True])
        # Node 0's weights are zero, so the average is half of node 1's gradient. (Full
        # gradients: FSDP2's case checks local shards, which are FSDP2's row halves.)
        self.assertEqual(model.out_proj.weight.grad.full_tensor(), torch.full((10, 40), 22.5))
        self.assertEqual(model.in_proj.weight.grad.full_tensor(), torch.arange(0, 100, 10.0).repeat(40, 1))

    def _check_registered(self, params, dtensors: bool) -> None:
        params = list(params)
        self.assertGreater(len(params), 0)
        for param in params:
            self.assertEqual(isinstance(param, DTensor), dtensors)

    def _check_same(self, model: nn.Module, ref: nn.Module) -> None:
        for param, ref_param in zip(model.parameters(), ref.parameters(), strict=True):
            self.assertEqual(param.full_tensor() if isinstance(param, DTensor) else param, ref_param)

    def test_param_registration_after_forward(self) -> None:
        fully_shard, fsdp_module = _fsdp(self.impl)
        for reshard_after_forward in (True, False, None, 2):
            model = nn.Sequential(MLP(3), MLP(3))
            for param in model.parameters():  # rank-threads share one generator: rank 0's values
                dist.broadcast(param.detach(), src=0)
            ref = copy.deepcopy(model)
            fully_shard(model[0].in_proj, reshard_after_forward=reshard_after_forward)
            fully_shard(model[0].out_proj, reshard_after_forward=reshard_after_forward)
            fully_shard(model, reshard_after_forward=reshard_after_forward)
            self._check_registered(model.parameters(), dtensors=True)
            model(torch.randn((2, 3)))
            inner = list(model[0].in_proj.parameters()) + list(model[0].out_proj.parameters())
            root = [p for p in model.parameters() if all(p is not q for q in inner)]
            self._check_registered(inner, dtensors=reshard_after_forward is not False)
            self._check_registered(root, dtensors=reshard_after_forward not in (False, None))
            self._check_same(model, ref)
            for module in model.modules():
                if isinstance(module, fsdp_module):
                    module.reshard()
            self._check_registered(model.parameters(), dtensors=True)
            self._check_same(model, ref)

    def test_param_registration_after_backward(self) -> None:
        fully_shard, _ = _fsdp(self.impl)
        for reshard_after_forward in (True, False, 2):
            model = MLP(8)
            fully_shard(model.in_proj, reshard_after_forward=reshard_after_forward)
            fully_shard(model.out_proj, reshard_after_forward=reshard_after_forward)
            fully_shard(model, reshard_after_forward=reshard_after_forward)
            self._check_registered(model.parameters(), dtensors=True)
            model(torch.randn((2, 8))).sum().backward()
            self._check_registered(model.parameters(), dtensors=True)

    def test_meta_init_then_reset_parameters_and_train(self) -> None:
        """Every rank-thread takes part in its own generator sync (ours arms it per world)."""
        fully_shard, _ = _fsdp(self.impl)
        for _ in range(2):  # a second model: fully_shard arms the sync again
            with torch.device("meta"):
                model = nn.Sequential(MLP(8), MLP(8))
            for block in model:
                fully_shard(block)
            fully_shard(model)
            model.to_empty(device="cpu")
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    module.reset_parameters()
            model(torch.randn((2, 8))).sum().backward()
            for param in model.parameters():
                self.assertTrue(bool(param.grad.full_tensor().isfinite().all()))


class TestTorchFullyShard(_ThreadedRanks):
    impl = "torch"


class TestVescaleFullyShard(_ThreadedRanks):
    impl = "vescale"


del _ThreadedRanks  # collect the two implementations only
