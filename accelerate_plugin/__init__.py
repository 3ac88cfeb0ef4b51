"""veScale-FSDP for Hugging Face Accelerate.

``Accelerator(fsdp_plugin=VeScaleFSDPPlugin(...))`` shards with veScale-FSDP where the stock
``FullyShardedDataParallelPlugin`` would use FSDP2; everything else in the training script
stays as it is. Importing this package installs dormant hooks into Accelerate (see
``hooks``). For an unchanged FSDP2 config and script, start the script through
``accelerate_plugin.run``, which switches veScale-FSDP on in every process::

    accelerate launch --config_file fsdp2.yaml -m accelerate_plugin.run train.py [ARGS...]
"""

from .hooks import USE_VESCALE_ENV, install, is_requested
from .plugin import VeScaleFSDPPlugin

install()

__all__ = ["VeScaleFSDPPlugin", "USE_VESCALE_ENV", "install", "is_requested"]
