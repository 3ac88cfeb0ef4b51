"""Crash-safe sharded checkpoints: a rank killed anywhere in a save never leaves a loadable mix.

Each case runs a real 2-process gloo save and kills one rank with ``os._exit`` at an injected
point (before its first file, in the middle of a file through DCP's storage writer, after all
files but before the commit marker, between the two renames of the commit, after the swap).
The test process then loads what is on disk, without a process group, into a plain model:
the previous checkpoint (or, once committed, the new one) loads exactly, and the half-written
directory never loads. These are real process deaths, so the cases use their own small
spawn instead of the shared worker pool (a dead rank would make the pool rebuild).
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from tests.support.distributed import _context
from vescale_plugins import fully_shard
from vescale_plugins.checkpoint import load_sharded, save_sharded
from vescale_plugins.checkpoint.commit import (
    COMMIT_MARKER,
    CheckpointCorruptError,
    CheckpointNotCommittedError,
    mark_committed,
)

WORLD, SPAWN_TIMEOUT_S = 2, 90.0
OLD_SEED, NEW_SEED = 1, 2


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))


def _expected(seed: int) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in _model(seed).named_parameters()}


def _die(*_args, **_kwargs):
    os._exit(17)


def _install_fault(fault: str) -> None:
    import torch.distributed.checkpoint.filesystem as filesystem

    import vescale_plugins.checkpoint.commit as commit

    if fault == "before_first_file":
        filesystem.FileSystemWriter.write_data = _die
    elif fault == "mid_file":
        original, written = filesystem._write_item, []

        def write_one_item_then_die(transforms, stream, data, *args, **kwargs):
            if written:
                stream.flush()
                os._exit(17)
            written.append(True)
            return original(transforms, stream, data, *args, **kwargs)

        filesystem._write_item = write_one_item_then_die
    elif fault == "before_commit":
        commit._write_marker = _die
    elif fault == "between_renames":
        commit._move_in = _die
    elif fault == "after_swap":
        commit._remove_leftovers = _die
    else:
        raise ValueError(fault)


def _save_worker(rank: int, port: int, path: str, seed: int, fault: str | None, fault_rank: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    model = fully_shard(_model(seed))
    if fault is not None and rank == fault_rank:
        _install_fault(fault)
    save_sharded(path, model, extra={"step": torch.tensor(seed)})
    dist.destroy_process_group()


def _spawn_save(path: Path, seed: int, fault: str | None = None, fault_rank: int = 0) -> list[int]:
    """Run a W=2 save; return the ranks' exit codes (17: killed by the fault)."""
    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, wait_for_workers=False)
    processes = [
        _context.Process(target=_save_worker, args=(rank, store.port, str(path), seed, fault, fault_rank), daemon=True)
        for rank in range(WORLD)
    ]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout=SPAWN_TIMEOUT_S)
    for p in processes:
        if p.is_alive():  # a survivor stuck waiting for the dead rank: the test is about the files
            p.kill()
            p.join()
    return [p.exitcode for p in processes]


def _load(path: Path) -> tuple[dict[str, torch.Tensor], int]:
    model = _model(seed=99)
    extra = load_sharded(path, model, extra={"step": torch.tensor(-1)})
    return {name: p.detach() for name, p in model.named_parameters()}, int(extra["step"])


def _assert_state(loaded: tuple[dict[str, torch.Tensor], int], seed: int) -> None:
    params, step = loaded
    assert step == seed
    expected = _expected(seed)
    assert params.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(params[name], expected[name], rtol=0, atol=0)


def _leftovers(path: Path, kind: str) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.{kind}-*"))


@pytest.fixture(scope="module")
def committed_old(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("old") / "last.ckpt"
    assert _spawn_save(path, OLD_SEED) == [0, 0]
    assert (path / COMMIT_MARKER).is_file()
    return path


@pytest.fixture
def old_copy(tmp_path, committed_old) -> Path:
    """A copy of the committed old checkpoint, under the same name, for one test to save over."""
    path = tmp_path / committed_old.name
    shutil.copytree(committed_old, path)
    return path


UNCOMMITTED_FAULTS = [("before_first_file", 1), ("mid_file", 0), ("before_commit", 0)]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("fault", "fault_rank"), [("before_first_file", 1), ("mid_file", 0)])
def test_killed_save_into_new_directory_never_loads(tmp_path, fault, fault_rank):
    path = tmp_path / "ckpt"
    codes = _spawn_save(path, NEW_SEED, fault, fault_rank)
    assert codes[fault_rank] == 17
    assert not path.exists()
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        _load(path)
    # A surviving rank 0 removes the staging directory; a killed one leaves it behind.
    staging = _leftovers(path, "tmp")
    assert len(staging) == (1 if fault_rank == 0 else 0)
    for directory in staging:
        with pytest.raises(CheckpointNotCommittedError, match=f"has no {COMMIT_MARKER}"):
            _load(directory)
    if fault == "mid_file":  # the killed rank's file holds one item, not all of them
        assert (staging[0] / f"__{fault_rank}_0.distcp").stat().st_size > 0


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("fault", "fault_rank"), UNCOMMITTED_FAULTS + [("mid_file", 1)])
def test_killed_overwrite_keeps_previous_checkpoint_exactly(old_copy, fault, fault_rank):
    codes = _spawn_save(old_copy, NEW_SEED, fault, fault_rank)
    assert codes[fault_rank] == 17
    _assert_state(_load(old_copy), OLD_SEED)
    staging = _leftovers(old_copy, "tmp")
    assert len(staging) == (1 if fault_rank == 0 else 0)
    for directory in staging:
        with pytest.raises(CheckpointNotCommittedError):
            _load(directory)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_killed_between_renames_loads_the_committed_new_checkpoint_then_next_save_cleans_up(old_copy):
    assert _spawn_save(old_copy, NEW_SEED, "between_renames", 0)[0] == 17
    assert not old_copy.exists()
    assert len(_leftovers(old_copy, "old")) == 1
    with pytest.warns(UserWarning, match="interrupted while swapping"):
        _assert_state(_load(old_copy), NEW_SEED)
    save_sharded(old_copy, _model(OLD_SEED), extra={"step": torch.tensor(OLD_SEED)})
    assert _leftovers(old_copy, "tmp") == []
    assert _leftovers(old_copy, "old") == []
    _assert_state(_load(old_copy), OLD_SEED)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_killed_after_swap_loads_new_checkpoint(old_copy):
    assert _spawn_save(old_copy, NEW_SEED, "after_swap", 0)[0] == 17
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*interrupted while swapping")
        _assert_state(_load(old_copy), NEW_SEED)


@pytest.mark.distributed  # committed_old saves on two processes
def test_truncated_file_is_named(tmp_path, committed_old):
    old_copy = tmp_path / "ckpt"
    shutil.copytree(committed_old, old_copy)
    shard = old_copy / "__1_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    with pytest.raises(
        CheckpointCorruptError, match=rf"__1_0\.distcp: {size // 2} bytes on disk, but {size} bytes were committed"
    ):
        _load(old_copy)
    shard.unlink()
    with pytest.raises(CheckpointCorruptError, match=r"__1_0\.distcp: missing"):
        _load(old_copy)


def test_foreign_directory_is_refused_until_marked_committed(tmp_path):
    old_copy = tmp_path / "foreign"
    model = _model(OLD_SEED)
    dcp.save({"model": model.state_dict(), "step": torch.tensor(OLD_SEED)}, checkpoint_id=str(old_copy), no_dist=True)
    with pytest.raises(CheckpointNotCommittedError, match="mark_committed"):
        _load(old_copy)
    mark_committed(old_copy)
    _assert_state(_load(old_copy), OLD_SEED)
    (old_copy / COMMIT_MARKER).write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match="commit marker is unreadable"):
        _load(old_copy)


def test_single_process_overwrite_replaces_a_full_checkpoint_file(tmp_path):
    old_copy = tmp_path / "ckpt"
    old_copy.write_bytes(b"a full checkpoint saved under the same name")
    save_sharded(old_copy, _model(NEW_SEED), extra={"step": torch.tensor(NEW_SEED)})
    _assert_state(_load(old_copy), NEW_SEED)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
