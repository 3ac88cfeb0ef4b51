"""The runtime of one ``fully_shard`` unit, split by concern; ``FSDPUnit`` (in
``vescale_plugins.runtime.fsdp_unit``) composes them:

* ``params``: parameters, DBuffers, sharded/unsharded faces, unshard/reshard
* ``hooks``: the forward/backward state machine and the root's end of iteration
* ``gradients``: post-backward, reduce-scatter (and HSDP all-reduce), routing
* ``prefetch``: which unit to gather next
* ``mesh``: shard and replicate groups, placements, post-forward groups
* ``managed``, ``traversal``: a parameter's record; walking inputs and outputs
"""
