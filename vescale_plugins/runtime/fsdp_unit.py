"""One FSDP unit at run time: its DBuffers, its parameters' two faces, and its hooks.

A unit is what one ``fully_shard`` call manages. Between steps every managed parameter is an
``nn.Parameter(DTensor)`` whose local tensor is a view of a DBuffer's sharded buffer. Around
the unit's forward and backward, the modules see plain unsharded parameters that are views of
the unsharded buffer. Autograd's gradients stay on those parameters through the unit's
backward (and across micro-batches that do not sync, accumulating in place); after the unit
reshards they are copied into the unsharded gradient buffer, which leaves by one
reduce-scatter per DBuffer.

The behaviour lives in ``vescale_plugins.runtime``, one concern per module; this class holds the
state they share.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from vescale_plugins.dbuffer.buffer import GatherHandle, ReduceScatterHandle
from vescale_plugins.dbuffer.storage_pool import StoragePool
from vescale_plugins.runtime.gradients import UnitGradients
from vescale_plugins.runtime.hooks import IterationState, UnitHooks, units_under
from vescale_plugins.runtime.managed import ManagedParam
from vescale_plugins.runtime.mesh import UnitMesh
from vescale_plugins.runtime.params import ParamSpec, UnitParams
from vescale_plugins.runtime.prefetch import UnitPrefetch

__all__ = ["FSDPUnit", "ManagedParam"]


class FSDPUnit(UnitHooks, UnitGradients, UnitPrefetch, UnitParams):
    """The runtime of one ``fully_shard`` call (one unit)."""

    def __init__(
        self,
        modules: list[nn.Module],
        params: list[ParamSpec],
        mesh: DeviceMesh,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules
        self.mesh = mesh
        self.unit_mesh = UnitMesh.of(mesh)
        self.group = self.unit_mesh.shard_group  # the default mesh's (each DBuffer has its own)
        self.requires_all_reduce = True
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.mp_policy = mp_policy
        self.requires_gradient_sync = True
        # None: each DBuffer divides by its mesh's size (every data-parallel rank of it).
        self.gradient_divide_factor: float | None = None
        self.is_last_backward = True
        self.forward_prefetch: list[FSDPUnit] | None = None  # None: the next unit (see prefetch)
        self.backward_prefetch: list[FSDPUnit] | None = None
        self.root: FSDPUnit | None = None
        self._iteration = IterationState()
        self._pending_unshard: list[GatherHandle] = []
        self._modules_run: set[int] = set()
        self._root_units: list[FSDPUnit] = []
        self._forward_order: list[FSDPUnit] = []
        self._previous_forward_order: list[FSDPUnit] = []
        self._reduces_in_flight: list[ReduceScatterHandle] = []
        # (Root) released CPU buffers kept for the next gathers of every unit under it.
        self._storage_pool = StoragePool()
        # (Root) parameters reduced this backward without a local gradient, with the sharded
        # gradient buffer that holds what other ranks sent them (see _attach_remote_gradients).
        self._reduced_without_local_grad: list[tuple[ManagedParam, FSDPUnit, torch.Tensor]] = []
        self.managed = self._build(params)


_iter_units = units_under  # (name kept for the modules that import it)
