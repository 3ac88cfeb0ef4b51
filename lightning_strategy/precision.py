"""Lightning's ``precision=`` flag, mapped onto veScale-FSDP's mixed-precision policy.

* ``"32-true"``: fp32 everywhere, ``MixedPrecisionPolicy()``.
* ``"bf16-mixed"``: the sharded parameters, gradients and optimizer state stay fp32; each unit
  gathers its parameters in bf16 and reduces gradients in fp32,
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, as Lightning's
  ModelParallel/FSDP strategies configure FSDP2. No ``torch.autocast``: ops run in the
  parameters' dtype, exactly as in a plain loop with that ``mp_policy``.
* ``"bf16-true"``: the module itself is bf16 (converted, or built under ``init_module``).

Anything else raises when the Trainer / Fabric is built. Lightning's connectors create their
stock precision plugins from the flag; the strategies swap them for these (see
:func:`as_vescale_precision`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

import torch
import torch.nn as nn
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision as TrainerPrecision
from lightning_utilities import apply_to_collection
from torch.distributed.fsdp import MixedPrecisionPolicy

from vescale_plugins.wrap import is_sharded

__all__ = ["SUPPORTED_PRECISION", "VeScaleFSDPFabricPrecision", "VeScaleFSDPPrecision", "as_vescale_precision"]

PrecisionName = Literal["32-true", "bf16-mixed", "bf16-true"]
SUPPORTED_PRECISION: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true")


class VeScaleFSDPFabricPrecision(FabricPrecision):
    """Fabric's precision plugin for the ``vescale_fsdp`` strategy; ``mp_policy`` is what sharding uses."""

    def __init__(self, precision: PrecisionName = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"precision={precision!r} is not supported by the vescale_fsdp strategy; use one of "
                f"{', '.join(map(repr, SUPPORTED_PRECISION))} ('16-mixed' would need a sharded gradient scaler, "
                "which this strategy does not provide)"
            )
        self.precision = precision
        # The dtype the module itself must have ("true" precision), or None to keep it as built.
        self._module_dtype = torch.bfloat16 if precision == "bf16-true" else None

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        """The policy every unit is sharded with."""
        if self.precision == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self._module_dtype is None:
            return module
        if not is_sharded(module):
            return module.to(dtype=self._module_dtype)
        # A sharded module's flat buffers keep the dtype they were built with: it must be right already.
        dtype = self._module_dtype
        wrong = [name for name, p in module.named_parameters() if p.is_floating_point() and p.dtype != dtype]
        if wrong:
            raise ValueError(
                f"precision={self.precision!r} needs {dtype} parameters, but these were sharded in another dtype "
                f"before the strategy could convert them: {wrong[:5]}{' ...' if len(wrong) > 5 else ''}; build the "
                "model under trainer.init_module() / fabric.init_module(), or let the strategy shard it"
            )
        return module

    def tensor_init_context(self) -> Any:
        return _default_dtype(self._module_dtype)

    def module_init_context(self) -> Any:
        return _default_dtype(self._module_dtype)

    def forward_context(self) -> Any:
        # "true" precision: tensors created inside forward get the module's dtype, as with HalfPrecision.
        return _default_dtype(self._module_dtype)

    def convert_input(self, data: Any) -> Any:
        if self._module_dtype is None:
            return data  # bf16-mixed: each unit casts its floating-point inputs itself (cast_forward_inputs)
        return _cast_floating(data, self._module_dtype)

    def convert_output(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        # Fabric hands outputs back in the default dtype, as its MixedPrecision / HalfPrecision do.
        return _cast_floating(data, torch.get_default_dtype())


class VeScaleFSDPPrecision(VeScaleFSDPFabricPrecision, TrainerPrecision):
    """The Trainer's precision plugin for the ``vescale_fsdp`` strategy.

    The conversions come from the Fabric plugin; backward, optimizer step and gradient
    clipping (``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients: the global norm)
    are the Trainer's stock ones.
    """


PluginT = TypeVar("PluginT", bound=VeScaleFSDPFabricPrecision)


def as_vescale_precision(plugin: Any, cls: type[PluginT]) -> PluginT:
    """Translate the precision plugin Lightning built from ``precision=`` into ``cls``."""
    if isinstance(plugin, cls):
        return plugin
    if type(plugin).__module__.startswith("lightning."):
        # One of Lightning's own plugins, built by the connector from `precision=`: keep only its name.
        return cls(getattr(plugin, "precision", "32-true"))
    raise TypeError(
        f"the vescale_fsdp strategy cannot use the precision plugin {type(plugin).__name__}; pass "
        f"precision= one of {', '.join(map(repr, SUPPORTED_PRECISION))} to the Trainer / Fabric, or a {cls.__name__}"
    )


@contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)
