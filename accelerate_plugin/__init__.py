"""veScale-FSDP for Hugging Face Accelerate.

``Accelerator(fsdp_plugin=VeScaleFSDPPlugin(...))`` shards with veScale-FSDP where the stock
``FullyShardedDataParallelPlugin`` would use FSDP2; everything else in the training script
stays as it is. Importing this package installs two dormant hooks into Accelerate (see
``hooks``); ``python -m accelerate_plugin launch`` is ``accelerate launch`` with veScale-FSDP
switched on for an unchanged FSDP2 config and script.
"""

from .hooks import USE_VESCALE_ENV, install, is_requested
from .plugin import VeScaleFSDPPlugin

install()

__all__ = ["VeScaleFSDPPlugin", "USE_VESCALE_ENV", "install", "is_requested"]
