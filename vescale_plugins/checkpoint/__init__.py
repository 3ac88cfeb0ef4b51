"""Saving and loading sharded models: sharded (DCP, any world size) and full checkpoints,
committed atomically (:mod:`.commit`)."""

from vescale_plugins.checkpoint.state_dicts import (
    MODEL_KEY,
    OPTIMIZER_KEY,
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
    load_sharded,
    save_sharded,
    write_sharded,
)

__all__ = [
    "MODEL_KEY",
    "OPTIMIZER_KEY",
    "save_sharded",
    "write_sharded",
    "load_sharded",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
]
