"""``VeScaleFSDPPlugin``: Accelerate's FSDP2 plugin, with veScale-FSDP doing the sharding.

Every field inherited from :class:`accelerate.FullyShardedDataParallelPlugin` keeps its FSDP2
meaning and its ``FSDP_*`` environment variable (so an ``accelerate launch`` FSDP2 config
fills it exactly as it fills the stock plugin). veScale adds three fields, ``block_size_fn``,
``find_unused_parameters`` and ``comm_policy``.
Options veScale-FSDP does not implement are refused here, when the plugin is built, so a bad
configuration fails before any process group or collective exists.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch.nn as nn
from accelerate import FullyShardedDataParallelPlugin
from accelerate.utils import str_to_bool
from accelerate.utils.dataclasses import get_module_class_from_name

from vescale_plugins import BlockSizeFn, QuantizedComm

__all__ = ["VeScaleFSDPPlugin", "BLOCK_SIZE_FN_ENV", "FIND_UNUSED_PARAMETERS_ENV", "SUPPORTED_MIXED_PRECISION"]

# ``FSDP_*`` is Accelerate's prefix for plugin fields; ours follows it so configs read alike.
BLOCK_SIZE_FN_ENV = "FSDP_VESCALE_BLOCK_SIZE_FN"
FIND_UNUSED_PARAMETERS_ENV = "FSDP_VESCALE_FIND_UNUSED_PARAMETERS"
SUPPORTED_MIXED_PRECISION = ("no", "fp16", "bf16")


@dataclass
class VeScaleFSDPPlugin(FullyShardedDataParallelPlugin):
    """Configure veScale-FSDP through Accelerate: ``Accelerator(fsdp_plugin=VeScaleFSDPPlugin(...))``.

    The inherited fields mean what they mean for FSDP2: ``auto_wrap_policy`` with
    ``transformer_cls_names_to_wrap`` or ``min_num_params`` chooses the sharding units (no
    policy: the root is the only unit), ``reshard_after_forward``, ``mixed_precision_policy``,
    ``state_dict_type`` (sharded DCP or full checkpoints), ``activation_checkpointing``,
    ``ignored_modules`` and ``cpu_ram_efficient_loading``. ``fsdp_version`` defaults to 2 and
    must be 2: veScale-FSDP implements FSDP2's ``fully_shard`` API.

    ``block_size_fn(name, param)`` is veScale's own: the number of leading rows that must stay
    together on one rank (e.g. a block-wise quantiser's block), or ``None`` for one row. It may
    be a callable or a ``"package.module:function"`` string; the ``FSDP_VESCALE_BLOCK_SIZE_FN``
    environment variable supplies the string when the field is left unset.

    ``find_unused_parameters`` is DDP's switch for data-dependent routing (mixture-of-experts
    layers, conditional branches), accepted so configs written for DDP keep working: veScale-FSDP
    handles a parameter that gets a gradient on some ranks only whatever its value. Left
    ``None`` it comes from ``FSDP_VESCALE_FIND_UNUSED_PARAMETERS`` (true/false), else from the
    Accelerator's ``DistributedDataParallelKwargs`` (what ``transformers.Trainer`` fills from
    ``ddp_find_unused_parameters``).

    ``comm_policy`` is veScale's own: a :class:`vescale_plugins.QuantizedComm` makes every
    unit's collectives move block-quantized values (int8 weight gathers, optionally int8
    gradient reductions); ``None`` (default) keeps them exact, as FSDP2's.
    """

    block_size_fn: BlockSizeFn | str | None = field(
        default=None,
        metadata={
            "help": "veScale: rows per block that must not straddle two ranks, as a callable (name, param) -> int | None or 'module:function'."
        },
    )

    find_unused_parameters: bool | None = field(
        default=None,
        metadata={
            "help": "DDP's find_unused_parameters, accepted for compatibility: veScale-FSDP always handles parameters that get gradients on some ranks only (MoE routing)."
        },
    )

    comm_policy: QuantizedComm | None = field(
        default=None,
        metadata={
            "help": "veScale: QuantizedComm(weights='int8', grads=None or 'int8') to quantize the collectives; None: exact."
        },
    )

    def __post_init__(self) -> None:
        self.fsdp_version: int | None  # the inherited field's type (Accelerate ships none)
        if self.fsdp_version is None:
            self.fsdp_version = int(os.environ.get("FSDP_VERSION", "2"))
        if self.fsdp_version != 2:
            raise ValueError(
                f"fsdp_version={self.fsdp_version}: veScale-FSDP implements FSDP2 (fully_shard); set "
                "fsdp_version: 2 (`accelerate to-fsdp2 --config_file <yaml> --output_file <new yaml>` "
                "converts an FSDP1 config)"
            )
        super().__post_init__()
        if self.block_size_fn is None:
            self.block_size_fn = os.environ.get(BLOCK_SIZE_FN_ENV) or None
        if isinstance(self.block_size_fn, str):
            self.block_size_fn = _import_callable(self.block_size_fn)
        if self.find_unused_parameters is None and os.environ.get(FIND_UNUSED_PARAMETERS_ENV):
            self.find_unused_parameters = str_to_bool(os.environ[FIND_UNUSED_PARAMETERS_ENV]) == 1
        if self.find_unused_parameters is not None and not isinstance(self.find_unused_parameters, bool):
            raise TypeError(f"find_unused_parameters must be True, False or None, got {self.find_unused_parameters!r}")
        if self.block_size_fn is not None and not callable(self.block_size_fn):
            raise TypeError(f"block_size_fn must be a callable (name, param) -> int | None, got {self.block_size_fn!r}")
        if self.comm_policy is not None and not isinstance(self.comm_policy, QuantizedComm):
            raise TypeError(
                f"comm_policy must be a vescale_plugins.QuantizedComm or None, got {type(self.comm_policy).__name__}"
            )

    @classmethod
    def from_fsdp_plugin(cls, plugin: FullyShardedDataParallelPlugin) -> VeScaleFSDPPlugin:
        """The veScale plugin with every setting of a stock plugin (e.g. one ``transformers.Trainer`` built)."""
        if isinstance(plugin, cls):
            return plugin
        return cls(**{f.name: getattr(plugin, f.name) for f in fields(FullyShardedDataParallelPlugin)})

    def resolve_find_unused_parameters(self, ddp_handler: Any) -> bool:
        """This field; unset, the Accelerator's ``DistributedDataParallelKwargs`` (or off)."""
        if self.find_unused_parameters is not None:
            return self.find_unused_parameters
        return bool(getattr(ddp_handler, "find_unused_parameters", False))

    def set_auto_wrap_policy(self, model: nn.Module) -> None:
        """Accelerate's policy resolution, after checking every named layer class exists in ``model``."""
        names = self.transformer_cls_names_to_wrap
        if names:
            missing = [name for name in names if get_module_class_from_name(model, name) is None]
            if missing:
                present = sorted({type(m).__name__ for m in model.modules()})
                raise ValueError(
                    f"transformer_cls_names_to_wrap (fsdp_transformer_layer_cls_to_wrap) names {missing}, "
                    f"but {type(model).__name__} has no module of that class; its module classes are {present}"
                )
        super().set_auto_wrap_policy(model)

    def check_accelerator_options(self, mixed_precision: str, parallelism_config: Any) -> None:
        """Refuse Accelerator options veScale-FSDP cannot honour; called before Accelerate starts.

        ``mixed_precision`` is the resolved string (argument or ``ACCELERATE_MIXED_PRECISION``);
        ``parallelism_config`` is Accelerate's ``ParallelismConfig`` or ``None``.
        """
        if mixed_precision not in SUPPORTED_MIXED_PRECISION:
            raise ValueError(
                f"mixed_precision={mixed_precision!r} is not supported with veScale-FSDP; use one of "
                f"{list(SUPPORTED_MIXED_PRECISION)}"
            )
        if parallelism_config is None:
            return
        # dp_replicate_size x dp_shard_size is hybrid sharding (a 2-D mesh); tp_size composes
        # with it as FSDP2's does: the model's own TP DTensors on mesh["tp"], sharded further
        # over the data-parallel dims.
        extra = {"cp_size": parallelism_config.cp_size, "sp_size": getattr(parallelism_config, "sp_size", 1)}
        extra = {name: size for name, size in extra.items() if size and size > 1}
        if extra:
            raise NotImplementedError(
                f"parallelism_config asks for {extra}: veScale-FSDP shards over the data-parallel dims "
                "(dp_shard_size, and dp_replicate_size for hybrid sharding) and composes with tensor "
                "parallelism (tp_size); context and sequence parallelism are not supported yet"
            )
        if parallelism_config.tp_size > 1 and parallelism_config.dp_shard_size == 1:
            raise ValueError(
                f"parallelism_config has tp_size={parallelism_config.tp_size} but dp_shard_size=1: veScale-FSDP "
                "would have no data-parallel dim to shard over; set dp_shard_size > 1 (tp_size x dp_shard_size "
                "x dp_replicate_size = the number of processes), or train without the veScale plugin"
            )


def _import_callable(path: str) -> Callable[..., Any]:
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"block_size_fn {path!r}: expected 'package.module:function'")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"block_size_fn {path!r} cannot be imported: {error}") from error
