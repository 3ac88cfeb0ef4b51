"""Where FSDP2's semantics differ between the torch releases we run on: one place.

torch 2.15 changed how mixed precision treats gradients (``MixedPrecisionPolicy``'s
``reduce_dtype`` documentation there): the unsharded parameter's ``grad_dtype`` is the reduce
dtype, so autograd hands its gradients over in that dtype and accumulates them there across
uses and backwards; and ``reduce_dtype=None`` means the parameter's own dtype, not
``param_dtype``. Before 2.15 gradients arrive in ``param_dtype`` and ``reduce_dtype=None``
reduces in ``param_dtype``. Every check of the torch version that changes behaviour is here.

The package declares torch < 2.14 until CI runs the other releases; on 2.15 these rules give
FSDP2 2.15's gradients in eager backwards (``tests/runtime/test_gradient_dtypes.py`` run there
by hand), while a backward under compiled autograd fails (it assigns the ``param_dtype``
gradient without the cast to ``grad_dtype``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.torch_version import TorchVersion

__all__ = ["default_reduce_dtype", "gradients_in_reduce_dtype", "hand_gradients_over_in"]

# Whether autograd gives the unsharded parameters' gradients in the reduce dtype (2.15 on).
gradients_in_reduce_dtype = TorchVersion(torch.__version__) >= "2.15"


def default_reduce_dtype(
    reduce_dtype: torch.dtype | None, param_dtype: torch.dtype | None, dtype: torch.dtype
) -> torch.dtype:
    """The dtype a floating-point parameter of ``dtype`` is reduced in, as the installed
    torch's FSDP2 decides it for ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``."""
    if reduce_dtype is not None:
        return reduce_dtype
    if gradients_in_reduce_dtype:
        return dtype
    return param_dtype or dtype


def hand_gradients_over_in(unsharded: nn.Parameter, reduce_dtype: torch.dtype) -> None:
    """(torch 2.15 on) Make autograd give ``unsharded``'s gradient in ``reduce_dtype``, as
    FSDP2 sets its unsharded parameter's ``grad_dtype``."""
    if gradients_in_reduce_dtype and unsharded.dtype != reduce_dtype:
        unsharded.grad_dtype = reduce_dtype
