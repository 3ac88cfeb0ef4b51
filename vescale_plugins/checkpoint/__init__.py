"""Saving and loading sharded models: sharded (DCP, any world size) and full checkpoints,
committed atomically (:mod:`.commit`)."""

from vescale_plugins.checkpoint import state_dicts
from vescale_plugins.checkpoint.state_dicts import *  # noqa: F403  (the functions state_dicts.__all__ lists)
from vescale_plugins.checkpoint.state_dicts import MODEL_KEY, OPTIMIZER_KEY

__all__ = ["MODEL_KEY", "OPTIMIZER_KEY", *state_dicts.__all__]
