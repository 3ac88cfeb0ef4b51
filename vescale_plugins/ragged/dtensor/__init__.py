"""Where torch's DTensor is taught about RaggedShard: the only modules that use private
``torch.distributed.tensor`` APIs.

DTensor has no public extension point for new placements, so :func:`install` hooks the few
places that interpret placements and routes a call to our code only when a RaggedShard is
involved (everything else goes to torch unchanged). One module per torch subsystem:

- :mod:`.propagation`: op rules for ragged operands, on ``OpDispatcher``'s sharding-cache
  miss (``propagate_op_sharding_dispatch_slow_path``). The C++ cache then keys on our
  placement's ``__hash__``/``__eq__``, so a rule runs once per layout.
- :mod:`.norms`: p-norms (``OpDispatcher._custom_op_handlers``), because a rank that holds no
  element must contribute the identity instead of failing (inf-norm).
- :mod:`.random_init`: random in-place initialisers (custom handlers too), so sharded init
  draws exactly what the full tensor would; :mod:`.generator_sync` gives every rank the same
  generator state first.
- :mod:`.redistribute`: ``_redistribute.redistribute_local_tensor`` (also bound by name in
  ``_api`` and ``_dispatch``): ragged collectives for ``redistribute``, ``full_tensor`` and
  their backward.
- :mod:`.construction`: ``distribute_tensor`` (ragged split), ``DTensor.from_local``
  (validate a ragged layout, demand the global shape) and
  ``_utils.compute_local_shape_and_global_offset`` (one box for a row-wise ragged shard).
  These and ``redistribute_local_tensor`` are redirected in place (:func:`_redirect`: the
  function object's code becomes a call to ours), so references taken before :func:`install`
  work too.
- :mod:`.checkpoint`: ``DTensor.__create_write_items__ / __create_chunk_list__ /
  __get_tensor_shard__`` (DCP's checkpointable protocol): a ragged shard as a few boxes.
- :mod:`.local_tensor`: DTensors over DBuffer views (``DTensor(local, spec)``,
  ``_local_tensor``), and ``__deepcopy__`` / ``__reduce_ex__``: torch tells a wrapper subclass
  by ``data_ptr() == 0``, which a DTensor over a view at an offset misses; such a DTensor is
  copied and pickled through an offset-0 twin over the same local tensor.
- :mod:`.mesh`: ``DeviceMesh._layout`` / ``_rank_map`` (every copy of a submesh, for
  subgroups every rank must create) and ``DeviceMesh._concatenate`` (the (dp, tp) mesh of a
  tensor-parallel parameter, as FSDP2 builds it).

When: :func:`install` runs at the first ``RaggedShard`` built (its constructor calls it, so
every way to a ragged DTensor passes here first: our constructors, ``DTensor.from_local`` or
``distribute_tensor`` with such a placement, a pickled or checkpointed one being loaded) and at
the first ``fully_shard`` call; never at import. Until then torch is untouched. Every hook
hands a call without a RaggedShard to torch's original, so stock DTensor and FSDP2 work the
same after it.

Next to even ``Shard`` placements on other mesh dims (tensor/expert parallel), a RaggedShard
cuts this rank's local tensor of those dims, whatever its mesh-dim position
(``StridedRaggedShard`` names the case where, read left to right, its rows are strided):
every path goes through :func:`.specs.other_dims_box` for that.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from typing import Any

import torch.distributed.tensor._api as dtensor_api
import torch.distributed.tensor._dispatch as dtensor_dispatch
import torch.distributed.tensor._redistribute as dtensor_redistribute
import torch.distributed.tensor._utils as dtensor_utils
from torch.distributed.tensor import DTensor

from vescale_plugins.ragged.dtensor.checkpoint import (
    create_chunk_list,
    create_write_items,
    get_tensor_shard,
)
from vescale_plugins.ragged.dtensor.construction import (
    compute_local_shape_and_global_offset,
    distribute_tensor,
    from_local,
)
from vescale_plugins.ragged.dtensor.generator_sync import sync_generator_at_next_draw
from vescale_plugins.ragged.dtensor.local_tensor import (
    buffer_view,
    dtensor_deepcopy,
    dtensor_reduce_ex,
    make_dtensor,
    own_bytes,
    set_local_tensor,
    with_own_bytes,
)
from vescale_plugins.ragged.dtensor.mesh import concatenate_meshes, every_copy_of_mesh
from vescale_plugins.ragged.dtensor.norms import (
    foreach_norm_handler,
    vector_norm_handler,
)
from vescale_plugins.ragged.dtensor.propagation import (
    propagate_op_sharding_dispatch_slow_path,
)
from vescale_plugins.ragged.dtensor.random_init import (
    RANDOM_INPLACE,
    random_inplace_handler,
)
from vescale_plugins.ragged.dtensor.redistribute import redistribute_local_tensor
from vescale_plugins.ragged.dtensor.specs import ORIGINAL, aten, other_dims_slice
from vescale_plugins.ragged.placement import at_every_placement

__all__ = [
    "install",
    "is_installed",
    "make_dtensor",
    "set_local_tensor",
    "buffer_view",
    "own_bytes",
    "with_own_bytes",
    "concatenate_meshes",
    "every_copy_of_mesh",
    "other_dims_slice",
    "sync_generator_at_next_draw",
]


def _redirect(original: Callable[..., Any], replacement: Callable[..., Any]) -> types.FunctionType:
    """Make ``original`` itself call ``replacement``; return an untouched copy of it.

    torch modules and user code bind these functions by name (``from ... import
    distribute_tensor``), most before :func:`install` runs. Rebinding names would miss
    references taken earlier (locals, partials, other objects), so the function object is
    changed instead: its code becomes a call to ``replacement``, and ``replacement`` calls
    the returned copy for what it leaves to torch. So when it runs does not matter.
    """
    assert isinstance(original, types.FunctionType)  # torch's Python functions: code to swap
    copy = types.FunctionType(
        original.__code__, original.__globals__, original.__name__, original.__defaults__, original.__closure__
    )
    copy.__kwdefaults__ = original.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = original.__qualname__, original.__doc__, original.__module__
    copy.__dict__.update(original.__dict__)
    # The trampoline looks ``replacement`` up in the original's module globals, under a name
    # no torch code uses.
    name = f"_vescale_plugins_{original.__name__}"
    original.__globals__[name] = replacement
    namespace: dict[str, Any] = {}
    exec(f"def trampoline(*args, **kwargs):\n    return {name}(*args, **kwargs)\n", {}, namespace)
    original.__code__ = namespace["trampoline"].__code__
    original.__defaults__ = None
    original.__kwdefaults__ = None
    original.__dict__["__wrapped__"] = copy  # inspect.signature shows the real signature
    return copy


def _replace_methods(cls: type, **methods: Callable[..., Any]) -> None:
    """Set methods of a torch class to ours (the hook points; torch's originals are in
    ORIGINAL). By ``setattr``: mypy refuses assignments to methods, and these are deliberate."""
    for name, method in methods.items():
        setattr(cls, name, method)


_INSTALL_LOCK = threading.Lock()
_installed = False


def install() -> None:
    """Teach torch's DTensor the RaggedShard placement: idempotent and thread-safe.

    Called by ``RaggedShard``'s constructor and by ``fully_shard``; call it yourself only to
    have torch patched before either (the module docstring lists what changes).
    """
    global _installed
    if _installed:  # the common case, without the lock: every RaggedShard built asks
        return
    with _INSTALL_LOCK:
        if not _installed:
            _install_hooks()
            _installed = True


def is_installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return _installed


def _install_hooks() -> None:
    dispatcher_cls = dtensor_dispatch.OpDispatcher
    propagator_cls = type(DTensor._op_dispatcher.sharding_propagator)
    ORIGINAL.update(
        slow_path=dispatcher_cls._propagate_op_sharding_dispatch_slow_path,
        propagate_non_cached=propagator_cls.propagate_op_sharding_non_cached,
        __create_write_items__=DTensor.__create_write_items__,
        __create_chunk_list__=DTensor.__create_chunk_list__,
        __get_tensor_shard__=DTensor.__get_tensor_shard__,
        __deepcopy__=DTensor.__deepcopy__,
        __reduce_ex__=DTensor.__reduce_ex__,
    )
    # Module-level functions (and from_local, a staticmethod) are redirected in place, so
    # references taken before install() reach our code too.
    ORIGINAL["redistribute_local_tensor"] = _redirect(
        dtensor_redistribute.redistribute_local_tensor, redistribute_local_tensor
    )
    ORIGINAL["distribute_tensor"] = _redirect(dtensor_api.distribute_tensor, distribute_tensor)
    ORIGINAL["compute_local_shape_and_global_offset"] = _redirect(
        dtensor_utils.compute_local_shape_and_global_offset, compute_local_shape_and_global_offset
    )
    ORIGINAL["from_local"] = _redirect(DTensor.__dict__["from_local"].__func__, from_local)
    _replace_methods(dispatcher_cls, _propagate_op_sharding_dispatch_slow_path=propagate_op_sharding_dispatch_slow_path)
    DTensor._op_dispatcher._custom_op_handlers[aten.linalg_vector_norm.default] = vector_norm_handler
    DTensor._op_dispatcher._custom_op_handlers[aten._foreach_norm.Scalar] = foreach_norm_handler
    for op in RANDOM_INPLACE:
        DTensor._op_dispatcher._custom_op_handlers[op] = random_inplace_handler
    _replace_methods(
        DTensor,
        __create_write_items__=create_write_items,
        __create_chunk_list__=create_chunk_list,
        __get_tensor_shard__=get_tensor_shard,
        __deepcopy__=dtensor_deepcopy,
        __reduce_ex__=dtensor_reduce_ex,
    )


# Every RaggedShard built runs install() first (the placement module calls what is registered).
at_every_placement(install)
