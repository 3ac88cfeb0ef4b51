"""``transformers.Trainer.save_model`` under a sharded state-dict config: say it writes nothing.

With ``fsdp_state_dict_type: SHARDED_STATE_DICT``, ``Trainer.save_model()`` writes no weights
(transformers saves FSDP weights there only for ``FULL_STATE_DICT``; FSDP2 behaves the same),
so a user's final ``trainer.save_model()`` silently leaves nothing behind. With a
:class:`VeScaleFSDPPlugin` in use, a user's call warns and says what to do instead; the
Trainer's own checkpoint saves (``_internal_call=True``), whose shards ``save_state`` writes,
are left alone.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any

from .plugin import VeScaleFSDPPlugin

__all__ = ["install", "SAVES_NOTHING"]

SAVES_NOTHING = (
    "trainer.save_model() writes no model weights with fsdp_state_dict_type SHARDED_STATE_DICT (as under FSDP2): "
    "set fsdp_state_dict_type: FULL_STATE_DICT (fsdp_config / FSDP_STATE_DICT_TYPE) to write a model a plain "
    "from_pretrained loads, or save a resumable sharded checkpoint with trainer.save_state() / "
    "trainer.accelerator.save_state(dir)"
)


def _writes_nothing(trainer: Any) -> bool:
    accelerator = getattr(trainer, "accelerator", None)
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    return isinstance(plugin, VeScaleFSDPPlugin) and "FULL_STATE_DICT" not in str(plugin.state_dict_type)


def install() -> None:
    """Wrap ``Trainer.save_model`` if transformers' trainer is imported (idempotent)."""
    module = sys.modules.get("transformers.trainer")
    trainer_class = getattr(module, "Trainer", None)
    if trainer_class is None or getattr(trainer_class.save_model, "_vescale_hook", False):
        return
    original = trainer_class.save_model

    @functools.wraps(original)
    def save_model(self: Any, output_dir: str | None = None, _internal_call: bool = False) -> Any:
        if not _internal_call and _writes_nothing(self):
            warnings.warn(SAVES_NOTHING, UserWarning, stacklevel=2)
        return original(self, output_dir, _internal_call)

    save_model._vescale_hook = True  # type: ignore[attr-defined]  # a marker attribute on a function
    trainer_class.save_model = save_model
