"""The FSDP2-compatible runtime: what ``fully_shard`` builds and what runs around forward and
backward, one concern per module (FSDP2's shape):

* :mod:`.api`: ``fully_shard`` and ``register_fsdp_forward_method``.
* :mod:`.setup`: every set-up check, on every rank before any collective; the per-parameter
  specs a unit is built from.
* :mod:`.placement`: the default mesh and the device a unit's states move to.
* :mod:`.param_group`: ``FSDPParamGroup``, one unit: its DBuffers, gather and reshard, its
  forward and backward hooks, the reduce-scatter of its gradients.
* :mod:`.param`: ``FSDPParam``, one parameter's sharded and unsharded faces and gradients.
* :mod:`.state`: ``RootState``, what the units under a root share: the forward order that
  drives prefetch, the reduce-scatters in flight, the end of backward; ``TrainingState``.
* :mod:`.module`: ``VeScaleFSDPModule``, FSDP2's ``FSDPModule`` methods.
* :mod:`.composable`: a unit as torch's other composable APIs (``replicate``) see it.
* :mod:`.extensions`: FSDP2's all-gather extensions (``fsdp_pre_all_gather`` /
  ``fsdp_post_all_gather``) on DBuffers.
* :mod:`.mesh`: a unit's shard and replicate groups and placements.
* :mod:`.tensor_parallel`: parameters that are already DTensors (TP, EP, SPMD meshes);
  :mod:`.spmd_types_params`: plain parameters annotated with spmd_types (torch 2.15).
* :mod:`.fsdp2_semantics`: where FSDP2's semantics differ between torch releases.
* :mod:`.traversal`: walking a module's inputs and outputs.
* :mod:`.dynamo`: the hooks kept out of ``torch.compile``'s graphs, as FSDP2's.
* :mod:`.torch_hooks`: what the first ``fully_shard`` installs in torch (nothing at import),
  and the registry its one global module hook reads.
"""
