"""Checkpoint files for both strategies, written through ``vescale_plugins.checkpoint.state_dicts``.

Two formats, as with Lightning's FSDP strategies:

* sharded: a directory. The model's and optimizer's shards are a DCP checkpoint written by
  :func:`vescale_plugins.checkpoint.state_dicts.save_sharded` (each rank writes its own shards, nothing is
  gathered; it loads at any world size, and a plain-torch loop using the core helpers reads
  it too). Everything else (loop state, epoch, user metadata) goes to ``meta.pt``, written by
  rank 0, the file name Lightning uses.
* full: one ``torch.save`` file written by rank 0, with full CPU tensors that an unsharded
  model loads with ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.optim import Optimizer

from vescale_plugins.checkpoint import OPTIMIZER_KEY, load_sharded, write_sharded
from vescale_plugins.checkpoint.commit import commit_file, committed_directory, resolve_committed

__all__ = [
    "METADATA_FILENAME",
    "is_sharded_checkpoint",
    "is_full_checkpoint",
    "run_on_rank_zero",
    "save_sharded_checkpoint",
    "save_full_checkpoint",
    "load_sharded_checkpoint",
    "load_file",
    "single_optimizer",
    "check_optimizer_state_keys",
]

METADATA_FILENAME = "meta.pt"
# DCP's own index file: every sharded checkpoint has it, also one saved by the core helpers alone.
_DCP_INDEX = ".metadata"


def is_sharded_checkpoint(path: Path) -> bool:
    """A DCP directory, or (its save interrupted between two renames) a name whose committed
    sibling :func:`resolve_committed` recovers."""
    if path.is_dir():
        return (path / _DCP_INDEX).is_file()
    if path.exists():
        return False
    try:
        resolve_committed(path)
    except FileNotFoundError:
        return False
    return True


def is_full_checkpoint(path: Path) -> bool:
    return path.is_file()


def single_optimizer(optimizers: Sequence[Optimizer]) -> Optimizer | None:
    """A sharded checkpoint holds one optimizer (what ``vescale_plugins.checkpoint.state_dicts`` stores)."""
    if len(optimizers) > 1:
        raise NotImplementedError(
            f"a sharded checkpoint holds one optimizer's state, but there are {len(optimizers)} optimizers; "
            "use state_dict_type='full' for several optimizers"
        )
    return optimizers[0] if optimizers else None


Broadcast = Callable[[Any], Any]


def run_on_rank_zero(action: Callable[[], None], *, is_global_zero: bool, broadcast: Broadcast) -> None:
    """Run a file-system ``action`` on rank 0; if it fails, every rank raises its error.

    The broadcast doubles as a barrier, and no rank is left waiting in a collective for a rank
    that died writing a file (a hang is the worst way to report a full disk or a bad path).
    """
    error: Exception | None = None
    if is_global_zero:
        try:
            action()
        except Exception as exc:
            error = exc
    error = broadcast(error)
    if error is not None:
        raise error


def save_sharded_checkpoint(
    path: Path,
    module: nn.Module,
    optimizer: Optimizer | None,
    metadata: dict[str, Any],
    *,
    is_global_zero: bool,
    broadcast: Broadcast,
) -> None:
    """Write ``module``'s and ``optimizer``'s shards and ``metadata`` to the directory ``path`` (all ranks).

    Committed atomically: a previous checkpoint at ``path`` (directory or full file) stays
    until every rank has written everything.
    """
    with committed_directory(path) as staging:
        write_sharded(staging, module, optimizer)
        run_on_rank_zero(
            lambda: torch.save(metadata, staging / METADATA_FILENAME),
            is_global_zero=is_global_zero,
            broadcast=broadcast,
        )


def save_full_checkpoint(
    path: Path,
    checkpoint: dict[str, Any],
    *,
    is_global_zero: bool,
    broadcast: Broadcast,
    write: Callable[[dict[str, Any], Path], None] = torch.save,
) -> None:
    """Rank 0 writes ``checkpoint`` (full tensors) to the file ``path``, replacing a sharded checkpoint there.

    The file is written under a temporary name and renamed into place, so a previous
    checkpoint survives a crash during the write.
    """

    def write_file() -> None:
        if path.is_dir() and not is_sharded_checkpoint(path):
            raise IsADirectoryError(f"cannot write a full checkpoint file to {path}: it is a directory")
        commit_file(path, lambda temporary: write(checkpoint, temporary))

    run_on_rank_zero(write_file, is_global_zero=is_global_zero, broadcast=broadcast)


def load_sharded_checkpoint(
    path: Path, module: nn.Module, optimizer: Optimizer | None, weights_only: bool | None = None
) -> dict[str, Any]:
    """Load shards into ``module`` (and ``optimizer`` if the checkpoint has its state); return the metadata."""
    path = resolve_committed(path)
    if optimizer is not None and not _has_optimizer_state(path):
        optimizer = None  # a weights-only checkpoint: the optimizer starts fresh, as with Lightning's FSDP
    load_sharded(path, module, optimizer)
    meta_path = path / METADATA_FILENAME
    return torch.load(meta_path, weights_only=weights_only) if meta_path.is_file() else {}


def _has_optimizer_state(path: Path) -> bool:
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return any(key.startswith(f"{OPTIMIZER_KEY}.") for key in stored)


def load_file(path: Path, weights_only: bool | None = None) -> dict[str, Any]:
    """A full checkpoint's contents, memory-mapped so that every rank can read it cheaply."""
    return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)


def check_optimizer_state_keys(state: dict[str, Any]) -> None:
    """A full optimizer state must be keyed by parameter name, as sharded models save it."""
    if any(isinstance(key, int) for key in state.get("state", {})):
        raise ValueError(
            "the checkpoint's optimizer state is keyed by parameter index (as DDP or a single device saves it), "
            "but a sharded model loads optimizer state keyed by parameter name (as a vescale_fsdp or FSDP2 full "
            "checkpoint has it); load only the weights (e.g. model.load_state_dict) and start a fresh optimizer"
        )
