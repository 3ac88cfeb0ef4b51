"""Where Accelerate is taught veScale-FSDP. Every Accelerate internal we touch is here.

Accelerate has no extension point for a sharding engine: ``distributed_type`` is a closed
enum, and the FSDP2 code path never asks its plugin to wrap. The hooks below stay dormant
unless a :class:`VeScaleFSDPPlugin` is in use (or ``ACCELERATE_USE_VESCALE_FSDP`` asks for
one), so importing this package changes nothing for anyone else:

- ``Accelerator.__init__`` (wrapped): picks the plugin (with the environment variable set, the
  stock plugin Accelerate builds from ``FSDP_*`` variables, or the one ``transformers.Trainer``
  passes, becomes a ``VeScaleFSDPPlugin`` with the same settings), refuses options veScale
  cannot honour before Accelerate initialises anything, and runs on CPU when the machine has
  no accelerator.
- ``AcceleratorState.__init__`` (wrapped): turns the ``MULTI_CPU`` state Accelerate picks on
  CPU into ``FSDP``, exactly as it does itself for GPUs, before ``Accelerator`` reads it; so
  gloo runs take the same code path as NCCL ones.
- ``save_state`` / ``load_state`` (wrapped, see ``atomic_state``): commit atomically.
- ``transformers.Trainer.save_model`` (wrapped, see ``trainer_save``): warns where it writes nothing.
- ``fsdp2_prepare_model`` (rebound by name where Accelerate imported it): shards with
  veScale-FSDP instead of ``torch.distributed.fsdp.fully_shard``.
- ``Accelerator._prepare_tp`` (replaced): with ``tp_size > 1`` the model keeps the DTensors its
  tensor-parallel plan made; Accelerate's own version needs transformers' ``ReplicateParallel``,
  which transformers 5 no longer has.

Everything else is Accelerate's own FSDP2 code running on RaggedShard DTensors: ``prepare``
re-pointing the optimizer by parameter name, ``no_sync``/``accumulate`` through
``set_requires_gradient_sync``, ``clip_grad_norm_``, ``get_state_dict``/``save_model``,
``save_state`` and sharded ``load_state`` (so checkpoints have FSDP2's layout, and tools that
read FSDP2 checkpoints read ours).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import accelerate.accelerator
import accelerate.utils
import accelerate.utils.fsdp_utils
import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.parallelism_config import ParallelismConfig
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, parse_flag_from_env
from torch.distributed.tensor import DTensor

from . import atomic_state, trainer_save
from .plugin import VeScaleFSDPPlugin
from .prepare import prepare_model

__all__ = ["USE_VESCALE_ENV", "install", "is_requested", "has_collective_device"]

USE_VESCALE_ENV = "ACCELERATE_USE_VESCALE_FSDP"

# Modules that bind the replaced helpers by name at import time (transformers.trainer binds
# the load helpers too, but only when it is imported; see ``install``).
_HELPER_HOLDERS = (accelerate.accelerator, accelerate.utils, accelerate.utils.fsdp_utils)
_original_prepare_model = accelerate.utils.fsdp_utils.fsdp2_prepare_model
_original_init = Accelerator.__init__
_init_signature = inspect.signature(_original_init)
_original_state_init = AcceleratorState.__init__
_original_prepare_tp = Accelerator._prepare_tp
_state_init_signature = inspect.signature(_original_state_init)


def is_requested() -> bool:
    """Whether ``ACCELERATE_USE_VESCALE_FSDP`` asks every Accelerator in this process to use veScale-FSDP."""
    return parse_flag_from_env(USE_VESCALE_ENV, default=False)


def install() -> None:
    """Put the hooks in place (idempotent). Importing ``accelerate_plugin`` calls this."""
    if getattr(Accelerator.__init__, "_vescale_hook", False):
        return
    Accelerator.__init__ = _accelerator_init
    atomic_state.install()
    trainer_save.install()
    AcceleratorState.__init__ = _accelerator_state_init
    Accelerator._prepare_tp = _prepare_tp
    replacements: dict[str, Callable[..., Any]] = {
        "fsdp2_prepare_model": _fsdp2_prepare_model,
    }
    trainer = sys.modules.get("transformers.trainer")
    for module in (*_HELPER_HOLDERS, trainer):
        for name, replacement in replacements.items():
            if module is not None and hasattr(module, name):
                setattr(module, name, replacement)


def _fsdp2_prepare_model(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
    if isinstance(getattr(accelerator.state, "fsdp_plugin", None), VeScaleFSDPPlugin):
        return prepare_model(accelerator, model)
    return _original_prepare_model(accelerator, model)


def _prepare_tp(self: Accelerator, *args: Any) -> Any:
    """``prepare``'s tensor-parallel step (``tp_size > 1``), for the veScale plugin.

    Accelerate's FSDP2 branch turns every plain parameter into a ``Replicate`` DTensor on
    ``mesh["tp"]`` with transformers' ``ReplicateParallel`` (an ImportError since transformers 5).
    veScale-FSDP, like ``fully_shard`` itself, shards a plain parameter over the data-parallel
    dims alone and Accelerate's ``clip_grad_norm_`` combines the meshes, so the model stays as
    its TP plan (``from_pretrained(tp_plan=...)``, ``parallelize_module`` on ``mesh["tp"]``) made
    it; ``_prepare_fsdp2`` then prepares everything as without TP.
    """
    if not isinstance(getattr(self.state, "fsdp_plugin", None), VeScaleFSDPPlugin):
        return _original_prepare_tp(self, *args)
    for model in (arg for arg in args if isinstance(arg, torch.nn.Module)):
        if not any(isinstance(p, DTensor) for p in model.parameters()):
            warnings.warn(
                f"tp_size={self.parallelism_config.tp_size} but no parameter of {type(model).__name__} is a DTensor: "
                "apply the tensor-parallel plan on accelerator.torch_device_mesh['tp'] before prepare (each "
                "tensor-parallel rank computes the whole model otherwise)",
                stacklevel=3,
            )
    return args


@functools.wraps(_original_init)
def _accelerator_init(self: Accelerator, *args: Any, **kwargs: Any) -> None:
    bound = _init_signature.bind(self, *args, **kwargs)
    plugin = _resolve_plugin(bound.arguments.get("fsdp_plugin"))
    if plugin is None:
        _original_init(self, *args, **kwargs)
        return
    plugin.check_accelerator_options(_mixed_precision(bound.arguments), _parallelism_config(bound.arguments))
    bound.arguments["fsdp_plugin"] = plugin
    trainer_save.install()  # transformers.Trainer builds its Accelerator after importing itself
    if not has_collective_device():
        # Under torchrun (accelerate launch with an FSDP config) Accelerate only looks for
        # accelerators; without one it would silently fall back to a single process.
        bound.arguments["cpu"] = True
    _original_init(*bound.args, **bound.kwargs)


_accelerator_init._vescale_hook = True  # type: ignore[attr-defined]  # a marker attribute on a function


@functools.wraps(_original_state_init)
def _accelerator_state_init(self: AcceleratorState, *args: Any, **kwargs: Any) -> None:
    _original_state_init(self, *args, **kwargs)
    plugin = _state_init_signature.bind(self, *args, **kwargs).arguments.get("fsdp_plugin")
    if isinstance(plugin, VeScaleFSDPPlugin) and self.distributed_type == DistributedType.MULTI_CPU:
        _promote_cpu_state(self, plugin)


def has_collective_device() -> bool:
    """Whether this machine has an accelerator with collectives; if not, veScale runs on CPU (gloo)."""
    # MPS has no collective backend: a laptop's multi-process run is a gloo run on CPU.
    if not torch.accelerator.is_available():
        return False
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is not None and accelerator.type != "mps"


def _resolve_plugin(given: Any) -> VeScaleFSDPPlugin | None:
    if isinstance(given, VeScaleFSDPPlugin):
        return given
    if not is_requested():
        return None
    if given is None:
        return VeScaleFSDPPlugin()
    if isinstance(given, FullyShardedDataParallelPlugin):
        return VeScaleFSDPPlugin.from_fsdp_plugin(given)
    return None  # not a plugin at all: Accelerate raises its own TypeError


def _mixed_precision(arguments: dict[str, Any]) -> str:
    value = arguments.get("mixed_precision")
    if value is None:
        value = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return str(getattr(value, "value", value)).lower()


def _parallelism_config(arguments: dict[str, Any]) -> Any:
    """The ParallelismConfig Accelerate is about to use, built the way ``Accelerator`` builds it."""
    if arguments.get("parallelism_config") is not None:
        return arguments["parallelism_config"]
    if arguments.get("torch_tp_plugin") is not None:
        return ParallelismConfig(tp_size=arguments["torch_tp_plugin"].tp_size)
    if parse_flag_from_env("ACCELERATE_USE_PARALLELISM_CONFIG", default=False):
        return ParallelismConfig()
    return None


def _promote_cpu_state(state: AcceleratorState, plugin: VeScaleFSDPPlugin) -> None:
    """What ``AcceleratorState.__init__`` does for a plugin on GPUs, done for a gloo run."""
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
