"""Crash-safe checkpoint directories: a save is either fully there or not there at all.

DCP writes its files in place, so a rank that dies while overwriting a checkpoint leaves a
directory that loads without error and holds a mix of two training states. Here every save
goes to a fresh sibling directory ``<name>.tmp-<token>`` (one token, chosen by rank 0 and
shared by all ranks); once every rank has finished writing, rank 0 records what was written
(file names and sizes, bytes) in a commit marker written last, then swaps the new directory
in: the old one is renamed to ``<name>.old-<token>``, the new one to ``<name>``, and only then
is the old one deleted. Whatever instant a process dies at, one complete, committed
checkpoint survives: ``<name>`` itself, or (if the death fell between the two renames) the
committed ``.tmp``/``.old`` sibling, which :func:`resolve_committed` then finds. A directory
without the marker is refused, and a file whose size differs from the committed one is
named as truncated.

Assumes what DCP assumes: every rank sees the same file system (a shared one across nodes).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "COMMIT_MARKER",
    "CheckpointNotCommittedError",
    "CheckpointCorruptError",
    "committed_directory",
    "commit_file",
    "resolve_committed",
    "mark_committed",
]

COMMIT_MARKER = ".vescale_committed.json"
_STAGING, _OLD = ".tmp-", ".old-"


class CheckpointNotCommittedError(RuntimeError):
    """The directory is not a committed checkpoint (a save that did not finish, or another tool's)."""


class CheckpointCorruptError(RuntimeError):
    """A committed checkpoint's file is missing or its size differs from the committed one."""


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _shared_token() -> str:
    """A fresh token, the same on every rank (rank 0's, broadcast)."""
    token = [uuid.uuid4().hex[:12]]
    if _distributed():
        dist.broadcast_object_list(token, src=0)
    return token[0]


def _raise_if_any_failed(error: BaseException | None) -> None:
    """Every rank learns whether any rank failed, and raises (doubles as a barrier)."""
    errors = [error]
    if _distributed():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if not failed:
        return
    rank, first = next(((r, e) for r, e in failed if r == _rank()), failed[0])
    if rank == _rank():
        raise first
    raise RuntimeError(f"checkpoint save failed on rank {rank}: {first!r}") from first


def _on_rank_zero(action: Callable[[], None]) -> None:
    error: BaseException | None = None
    if _rank() == 0:
        try:
            action()
        except Exception as exc:  # any error: raised on every rank by _raise_if_any_failed
            error = exc
    _raise_if_any_failed(error)


def _sibling(path: Path, kind: str, token: str) -> Path:
    return path.with_name(f"{path.name}{kind}{token}")


@contextlib.contextmanager
def committed_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Every rank: yields a fresh staging directory to write into; commits it as ``path`` on exit.

    Collective (every rank must enter it). If the body raises on any rank, nothing is
    committed, the staging directory is removed and every rank raises. ``path`` may hold a
    previous checkpoint (a directory or a file): it stays until the new one is committed.
    """
    path = Path(path).absolute()
    staging = _sibling(path, _STAGING, _shared_token())

    def prepare() -> None:
        staging.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()

    _on_rank_zero(prepare)
    error: BaseException | None = None
    try:
        yield staging
    except BaseException as exc:  # any error, even KeyboardInterrupt: every rank raises below
        error = exc
    try:
        _raise_if_any_failed(error)
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    _on_rank_zero(lambda: _commit(staging, path))


def commit_file(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """One process: ``write(temporary_path)``, then atomically rename it to ``path``.

    A previous checkpoint at ``path`` (file, or a sharded directory) survives until the
    new file is complete.
    """
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:12]
    staging = _sibling(path, _STAGING, token)
    try:
        write(staging)
        _fsync(staging)
        if path.is_dir():
            old = _sibling(path, _OLD, token)
            os.replace(path, old)
            os.replace(staging, path)
            shutil.rmtree(old)
        else:
            os.replace(staging, path)
    finally:
        if staging.exists():
            staging.unlink()
    _fsync_directory(path.parent)


def _commit(staging: Path, path: Path) -> None:
    """Rank 0, after every rank finished writing: marker last, then the swap."""
    _write_marker(staging)
    old = None
    if path.exists() or path.is_symlink():
        old = _sibling(path, _OLD, staging.name.rsplit(_STAGING, 1)[1])
        _move_aside(path, old)
    _move_in(staging, path)
    _fsync_directory(path.parent)
    _remove_leftovers(path)


def mark_committed(path: str | os.PathLike) -> None:
    """Record the directory's current files as a committed checkpoint (one process).

    For a complete checkpoint written by another tool (``torch.distributed.checkpoint.save``,
    FSDP2, Lightning's FSDP strategy) that you want to load with veScale-FSDP's loaders.
    """
    _write_marker(Path(path))


def _write_marker(directory: Path) -> None:
    files = {
        str(f.relative_to(directory)): f.stat().st_size
        for f in sorted(directory.rglob("*"))
        if f.is_file() and f.name != COMMIT_MARKER
    }
    body = json.dumps({"committed_at_ns": time.time_ns(), "files": files}, indent=1)
    temporary = directory / f"{COMMIT_MARKER}.partial"
    with open(temporary, "w") as stream:
        stream.write(body)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, directory / COMMIT_MARKER)
    _fsync_directory(directory)


def _move_aside(path: Path, old: Path) -> None:
    os.replace(path, old)


def _move_in(staging: Path, path: Path) -> None:
    os.replace(staging, path)


def _remove_leftovers(path: Path) -> None:
    """After a commit: the previous checkpoint and any earlier interrupted saves of ``path``."""
    for sibling in path.parent.glob(f"{path.name}.*"):
        if sibling.name.startswith((f"{path.name}{_STAGING}", f"{path.name}{_OLD}")):
            if sibling.is_dir() and not sibling.is_symlink():
                shutil.rmtree(sibling, ignore_errors=True)
            else:
                sibling.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())


def _fsync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open directories; the renames are still atomic
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _read_marker(directory: Path) -> dict[str, Any] | None:
    marker = directory / COMMIT_MARKER
    if not marker.is_file():
        return None
    try:
        content = json.loads(marker.read_text())
        files = content["files"]
        if not isinstance(files, dict):
            raise TypeError("'files' is not a mapping")
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointCorruptError(f"{marker}: the commit marker is unreadable ({error})") from error
    return content


def _verify(directory: Path, content: dict[str, Any]) -> None:
    for name, size in content["files"].items():
        file = directory / name
        if not file.is_file():
            raise CheckpointCorruptError(f"{file}: missing from the committed checkpoint {directory}")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointCorruptError(
                f"{file}: {actual} bytes on disk, but {size} bytes were committed (truncated or overwritten "
                "after the save); restore it from a copy or load an earlier checkpoint"
            )


def resolve_committed(path: str | os.PathLike) -> Path:
    """The committed checkpoint directory to load for ``path``, its files checked.

    ``path`` itself when it is committed. If it does not exist because a save died between
    its two renames, the committed sibling that save left (the new ``.tmp`` one first, else
    the previous ``.old`` one), with a warning. Raises ``FileNotFoundError`` when there is
    nothing, :class:`CheckpointNotCommittedError` for a directory without a commit marker, and
    :class:`CheckpointCorruptError` naming a missing or truncated file.
    """
    path = Path(path).absolute()
    if path.is_dir():
        content = _read_marker(path)
        if content is None:
            raise CheckpointNotCommittedError(
                f"{path} is not a committed checkpoint: it has no {COMMIT_MARKER}. Either a save into it did "
                "not finish (a rank died or was stopped), or another tool wrote it. Load an earlier checkpoint; "
                "if you know it is complete (e.g. written by torch.distributed.checkpoint.save or FSDP2), "
                "call vescale_plugins.checkpoint.commit.mark_committed(path) once, then load it"
            )
        _verify(path, content)
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is a file, not a sharded checkpoint directory")
    recovered = _recover(path)
    if recovered is None:
        raise FileNotFoundError(f"no checkpoint at {path}")
    if _rank() == 0:
        warnings.warn(
            f"{path} does not exist: a save into it was interrupted while swapping directories; "
            f"loading the committed checkpoint it left at {recovered}",
            stacklevel=2,
        )
    return recovered


def _recover(path: Path) -> Path | None:
    committed: list[tuple[int, int, Path]] = []
    for sibling in path.parent.glob(f"{path.name}.*"):
        for preference, kind in enumerate((_STAGING, _OLD)):
            if sibling.name.startswith(f"{path.name}{kind}") and sibling.is_dir():
                try:
                    content = _read_marker(sibling)
                except CheckpointCorruptError:
                    continue
                if content is not None:
                    committed.append((-preference, content["committed_at_ns"], sibling))
    if not committed:
        return None
    _, _, best = max(committed)
    content = _read_marker(best)
    assert content is not None  # best was chosen for the marker read above
    _verify(best, content)
    return best
