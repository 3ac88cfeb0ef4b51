"""``Accelerator.save_state`` / ``load_state`` with crash-safe commits, for veScale-FSDP runs.

Accelerate writes a state directory in place (DCP shards, optimizer, RNG states), so a rank
that dies while overwriting one leaves a mix of two training states that loads without
error. With a :class:`VeScaleFSDPPlugin`, ``save_state(output_dir)`` writes into a fresh
sibling directory and commits it only once every rank has finished
(``vescale_plugins.checkpoint.commit``); ``load_state(input_dir)`` loads only a committed
directory. With ``automatic_checkpoint_naming`` Accelerate picks the directory itself and
lists its siblings by number, so those saves run unchanged.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from accelerate import Accelerator

from vescale_plugins.checkpoint.commit import committed_directory, resolve_committed

from .plugin import VeScaleFSDPPlugin

__all__ = ["install"]

_original_save_state = Accelerator.save_state
_original_load_state = Accelerator.load_state


def _commits_atomically(accelerator: Accelerator) -> bool:
    """Whether a save or load into an explicit directory goes through the atomic commit."""
    return (
        isinstance(getattr(accelerator.state, "fsdp_plugin", None), VeScaleFSDPPlugin)
        and not accelerator.project_configuration.automatic_checkpoint_naming
    )


@functools.wraps(_original_save_state)
def _save_state(self: Accelerator, output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
    if output_dir is None or not _commits_atomically(self):
        return _original_save_state(self, output_dir, *args, **kwargs)
    output_dir = os.path.expanduser(output_dir)
    with committed_directory(output_dir) as staging:
        _original_save_state(self, str(staging), *args, **kwargs)
    return output_dir


@functools.wraps(_original_load_state)
def _load_state(self: Accelerator, input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
    if input_dir is not None and _commits_atomically(self):
        input_dir = str(resolve_committed(os.path.expanduser(input_dir)))
    return _original_load_state(self, input_dir, *args, **kwargs)


def install() -> None:
    """Replace ``Accelerator.save_state`` / ``load_state`` (idempotent; dormant without the plugin)."""
    Accelerator.save_state = _save_state
    Accelerator.load_state = _load_state
