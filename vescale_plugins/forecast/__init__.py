"""Memory per rank and step time for veScale-FSDP and FSDP2 at 8 to 16K GPUs, by calculation.

``python -m vescale_plugins.forecast --model NAME --gpus 8,256,8192 --gpu h100``. Layouts
come from the planner and FSDP2's ``Shard(0)`` rule (:mod:`.layouts`), memory parts follow
the run record's split (:mod:`.memory`), step time from the planner's model of NCCL's
collectives (:mod:`.comm_model`) and FLOPs at a stated MFU (:mod:`.compute`,
:mod:`.step_time`). Every hardware figure is a field of :class:`Hardware`.
"""

from vescale_plugins.forecast.forecast import forecast, forecast_world_size
from vescale_plugins.forecast.hardware import GPUS, Hardware, load_hardware
from vescale_plugins.forecast.model import ModelSpec, resolve_model, spec_from_modules
from vescale_plugins.forecast.settings import ForecastSettings

__all__ = [
    "GPUS",
    "ForecastSettings",
    "Hardware",
    "ModelSpec",
    "forecast",
    "forecast_world_size",
    "load_hardware",
    "resolve_model",
    "spec_from_modules",
]
