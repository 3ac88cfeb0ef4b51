"""veScale-FSDP as a Lightning strategy, for the Trainer and for Fabric.

``import lightning_strategy`` registers ``"vescale_fsdp"`` in the Trainer's and in Fabric's
strategy registries, so that ``Trainer(strategy="vescale_fsdp")`` and
``Fabric(strategy="vescale_fsdp")`` work. The import is needed for the string form because
Lightning fills its registries from its own modules at import time and has no entry point
through which an installed package could add a strategy. Passing an instance,
``Trainer(strategy=VeScaleFSDPStrategy(...))`` or ``Fabric(strategy=VeScaleFSDPFabricStrategy(...))``,
needs nothing else.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from .fabric import VeScaleFSDPFabricStrategy
from .precision import VeScaleFSDPFabricPrecision, VeScaleFSDPPrecision
from .processes import STRATEGY_NAME
from .strategy import VeScaleFSDPStrategy

VeScaleFSDPStrategy.register_strategies(StrategyRegistry)
VeScaleFSDPFabricStrategy.register_strategies(STRATEGY_REGISTRY)

__all__ = [
    "STRATEGY_NAME",
    "VeScaleFSDPStrategy",
    "VeScaleFSDPFabricStrategy",
    "VeScaleFSDPPrecision",
    "VeScaleFSDPFabricPrecision",
]
