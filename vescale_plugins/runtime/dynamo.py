"""Keeping Dynamo out of the runtime's hooks, as FSDP2 does.

Under ``torch.compile`` the hooks a unit installs would otherwise be traced down to the
in-place collectives (which Dynamo refuses: gloo's point-to-point) and the bookkeeping that
changes every call (recompiles, graph breaks). Run eagerly, they leave the compiled graphs
exactly the module's own computation, so a compiled block gives FSDP2's graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["eager_hook", "mark_managed"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def eager_hook(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` (and all it calls) run outside Dynamo, as FSDP2's ``_dynamo_disable``.

    ``torch._disable_dynamo`` (recursive) imports Dynamo at the first call, not at import,
    and Dynamo calls it from traced code without a graph break, also under
    ``fullgraph=True``; ``torch._dynamo.disable`` applied at call time from a file Dynamo
    traces would be refused there.
    """
    return torch._disable_dynamo(fn, recursive=True)


def mark_managed(module: torch.nn.Module) -> None:
    """Mark ``module`` as FSDP2 marks its managed modules: Dynamo then treats it as an
    unspecialised module whose parameters it does not guard on (they are swapped between
    their sharded and unsharded faces every step)."""
    module._is_fsdp_managed_module = True  # type: ignore[assignment]  # torch stubs Module.__setattr__ for tensors and modules; it takes any value
    module._fsdp_use_orig_params = True  # type: ignore[assignment]  # same
