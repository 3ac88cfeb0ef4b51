"""The FSDP2-compatible runtime: what ``fully_shard`` builds and what runs around forward and
backward, one concern per module (FSDP2's shape). Top down; every call goes down (the layer
contract in ``pyproject.toml`` keeps it so, and no module imports one above it even for
types):

* :mod:`.api`: ``fully_shard``, ``register_fsdp_forward_method``, ``share_comm_ctx``.
* :mod:`.module`: ``VeScaleFSDPModule``, FSDP2's ``FSDPModule`` methods.
* :mod:`.state`: ``RootState``, the end-of-backward driver above the units (FSDP2's root
  ``FSDPState``): makes the root at the first forward, queues and runs the end of backward,
  ``finalize_backward``, ``reset_iter_state``.
* :mod:`.param_group`: ``FSDPParamGroup``, one unit: its DBuffers, gather and reshard, its
  forward and backward hooks, the reduce-scatter of its gradients, its prefetch.
* :mod:`.iteration`: ``IterationContext``, what the units under a root share below them
  (FSDP2's comm context): the forward orders, the reductions in flight; ``TrainingState``.
* :mod:`.setup`: every set-up check, on every rank before any collective; the per-parameter
  specs a unit is built from. :mod:`.discovery`: which parameters a unit takes.
* :mod:`.param`: ``FSDPParam``, one parameter's sharded and unsharded faces and gradients.
* :mod:`.extensions`: FSDP2's all-gather extensions over DBuffers.
* :mod:`.registry`: the lookups kept across units (which parameter a sharded face is, which
  call took a parameter, which module slots hold one), and what the first ``fully_shard``
  installs in torch (nothing at import): our DTensor patches and the one global module hook.
* :mod:`.tensor_parallel`, :mod:`.spmd_types_params`: parameters that are already DTensors
  (TP, EP, SPMD meshes) or carry spmd_types annotations.
* :mod:`.agreement`: the one cross-rank agreement (set-up's plan, the extensions' inputs).
* :mod:`.mesh` (a unit's shard and replicate groups and placements), :mod:`.unit_device`
  (the default mesh, where a unit's states live), :mod:`.fsdp2_semantics` (what differs
  between torch releases), :mod:`.traversal` (walking inputs and outputs), :mod:`.dynamo`
  (the hooks kept out of ``torch.compile``'s graphs), :mod:`.composable` (torch's
  composable-API registry).
"""
