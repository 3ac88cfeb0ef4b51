"""Where FSDP2's semantics differ between the torch releases we run on: one place.

torch 2.15 changed how mixed precision treats gradients (``MixedPrecisionPolicy``'s
``reduce_dtype`` documentation there): the unsharded parameter's ``grad_dtype`` is the reduce
dtype, so autograd hands its gradients over in that dtype and accumulates them there across
uses and backwards; and ``reduce_dtype=None`` means the parameter's own dtype, not
``param_dtype``. Before 2.15 gradients arrive in ``param_dtype`` and ``reduce_dtype=None``
reduces in ``param_dtype``. 2.15 also lets ``MixedPrecisionPolicy.param_dtype_override_fn``
keep chosen parameters in their own dtype, keeps a ``grad_dtype`` set before ``fully_shard``,
and takes plain parameters annotated with spmd_types (torchtitan's default
``spmd_backend="spmd_types"``) where the ``spmd_types`` package is installed: it stores them as
DTensors on the ``dp_mesh_dims`` mesh. Every check of the torch version that changes behaviour
is here; the surface 2.15 adds (``FSDPModule.finalize_backward`` and its companions) is ours on
every supported torch (``runtime/module.py``).

On 2.15 these rules give FSDP2 2.15's gradients in eager backwards
(``tests/runtime/test_gradient_dtypes.py``), while a backward under compiled autograd fails
(it assigns the ``param_dtype`` gradient without the cast to ``grad_dtype``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.torch_version import TorchVersion

__all__ = [
    "ShardPlacementResult",
    "TorchGradientReductionHandle",
    "default_reduce_dtype",
    "defer_upcast",
    "defers_upcast",
    "grad_dtype_override",
    "gradients_in_reduce_dtype",
    "hand_gradients_over_in",
    "policy_for_param",
    "register_spmd_local_autograd_function",
    "spmd_no_typecheck",
    "takes_spmd_typed_parameters",
    "upcast_gradient",
]

try:  # shard_placement_fn's answer naming another mesh (torch 2.13 on)
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # before 2.13 a shard_placement_fn returns a Shard or None, as ours then takes

    class ShardPlacementResult:  # type: ignore[no-redef]
        """Stands for torch 2.13's class, which no earlier torch can hand us."""

        placement: Any
        mesh_info: Any


# Whether autograd gives the unsharded parameters' gradients in the reduce dtype (2.15 on).
gradients_in_reduce_dtype = TorchVersion(torch.__version__) >= "2.15"
# Whether FSDP2 reads spmd_types annotations on plain parameters (2.15 on).
_reads_spmd_types = TorchVersion(torch.__version__) >= "2.15"


def takes_spmd_typed_parameters() -> bool:
    """Whether a plain parameter's spmd_types annotations decide how it is stored, as the
    installed torch's FSDP2 does: torch 2.15 on, with the ``spmd_types`` package installed
    (torch's own test, ``torch.distributed._is_spmd_types_available``)."""
    return _reads_spmd_types and dist._is_spmd_types_available()


# The class ours subclasses so that ``isinstance(handle, fsdp.GradientReductionHandle)`` holds
# where torch has it (2.15 on); ``finalize_backward`` is ours on every supported torch.
TorchGradientReductionHandle: type = getattr(fsdp, "GradientReductionHandle", object)


def _spmd_no_typecheck() -> contextlib.AbstractContextManager[None]:
    if dist._is_spmd_types_available():
        import spmd_types

        return spmd_types.no_typecheck()
    return contextlib.nullcontext()


# (torch 2.15 on, spmd_types installed) The unit's own work on its buffers (gathers, reshards,
# reductions) runs outside spmd_types' type checking, as FSDP2's hooks do. Before 2.15 a plain
# null context, chosen here once (it is entered a few times per unit per step).
spmd_no_typecheck: Callable[[], contextlib.AbstractContextManager[None]] = (
    _spmd_no_typecheck if _reads_spmd_types else contextlib.nullcontext
)


def register_spmd_local_autograd_function(function: type) -> type:
    """(torch 2.15 on, spmd_types installed) Let spmd_types' type checking pass the types of
    a unit's inputs through ``function`` (an identity on them), as FSDP2 registers its
    ``RegisterPostBackwardFunction``."""
    if takes_spmd_typed_parameters():
        import spmd_types

        spmd_types.register_local_autograd_function(function)
    return function


def default_reduce_dtype(
    reduce_dtype: torch.dtype | None,
    param_dtype: torch.dtype | None,
    dtype: torch.dtype,
    grad_dtype: torch.dtype | None = None,
) -> torch.dtype:
    """The dtype a floating-point parameter of ``dtype`` (``grad_dtype``: the one set on it
    before ``fully_shard``, see :func:`grad_dtype_override`) is reduced in, as the installed
    torch's FSDP2 decides it for ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``."""
    if reduce_dtype is not None:
        return reduce_dtype
    if gradients_in_reduce_dtype:
        return grad_dtype or dtype
    return param_dtype or dtype


def grad_dtype_override(param: nn.Parameter) -> torch.dtype | None:
    """(torch 2.15 on) The ``grad_dtype`` set on ``param`` before ``fully_shard``, which FSDP2
    keeps: the sharded gradient is in it, and with ``reduce_dtype=None`` so is the reduction."""
    if not gradients_in_reduce_dtype or not getattr(param, "_has_grad_dtype_override", False):
        return None
    return param.grad_dtype if param.grad_dtype != param.dtype else None


def hand_gradients_over_in(unsharded: nn.Parameter, reduce_dtype: torch.dtype) -> None:
    """(torch 2.15 on) Make autograd give ``unsharded``'s gradient in ``reduce_dtype``, as
    FSDP2 sets its unsharded parameter's ``grad_dtype``."""
    if gradients_in_reduce_dtype and unsharded.dtype != reduce_dtype:
        unsharded.grad_dtype = reduce_dtype


def policy_for_param(mp_policy: MixedPrecisionPolicy, param: nn.Parameter) -> MixedPrecisionPolicy:
    """The policy as it applies to ``param``: (torch 2.15 on) ``param_dtype_override_fn``
    resolved and checked by torch's own rule, so the errors are FSDP2's."""
    if getattr(mp_policy, "param_dtype_override_fn", None) is None:  # None, or a torch without it
        return mp_policy
    return mp_policy._resolve_for_param(param)  # type: ignore[attr-defined]  # torch 2.15 on


@functools.cache  # asked per unit per backward, with a DBuffer's two dtypes: answered in C after the first
def defers_upcast(compute_dtype: torch.dtype, reduce_dtype: torch.dtype) -> bool:
    """(Per DBuffer) Whether its gradients follow FSDP2 2.15's deferred upcast: torch 2.15 on,
    a reduce dtype wider than the compute dtype (:func:`defer_upcast`, :func:`upcast_gradient`)."""
    return (
        gradients_in_reduce_dtype
        and reduce_dtype.is_floating_point
        and compute_dtype.is_floating_point
        and reduce_dtype.itemsize > compute_dtype.itemsize
    )


def defer_upcast(unsharded: nn.Parameter, will_reduce: bool) -> None:
    """(torch 2.15 on, at a unit's pre-backward) FSDP2 2.15's
    ``_set_unsharded_grad_dtypes(defer_upcast=True)``: where the reduce dtype is wider than the
    compute dtype and a gradient already accumulates or this backward reduces, autograd keeps
    the gradients' own dtype in this backward (its contributions add in it, or in place into
    the wider accumulated gradient); the first backward without sync accumulates upcast.
    For DBuffers where :func:`defers_upcast` holds."""
    if unsharded.grad is not None or will_reduce:
        unsharded.grad_dtype = None


def upcast_gradient(unsharded: nn.Parameter, reduce_dtype: torch.dtype) -> None:
    """(torch 2.15 on, at a unit's post-backward) The gradient in the reduce dtype again, and
    autograd's ``grad_dtype`` with it (FSDP2 2.15's ``defer_upcast=False``). For DBuffers where
    :func:`defers_upcast` holds."""
    grad = unsharded.grad
    if grad is not None and grad.dtype != reduce_dtype:
        unsharded.grad = None
        unsharded.grad_dtype = reduce_dtype
        unsharded.grad = grad.to(reduce_dtype)
    else:
        unsharded.grad_dtype = reduce_dtype
