"""The examples run end to end under real launchers, on 2 CPU processes.

``examples/lightning_train.py`` under Lightning's own launcher (``devices=2``: it re-runs the
script as a second process), then again resuming its sharded checkpoint;
``examples/fabric_train.py`` under ``torchrun``. Each run is its own process group (session)
so that a timeout kills every process it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 150


def _run(args: list[str], cwd: Path) -> str:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.Popen(
        args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's children too
        output, _ = proc.communicate()
        raise AssertionError(f"{' '.join(args)} did not finish within {TIMEOUT_S}s:\n{output[-4000:]}") from None
    assert proc.returncode == 0, f"{' '.join(args)} exited with {proc.returncode}:\n{output[-4000:]}"
    return output


def test_lightning_example_trains_and_resumes_under_lightnings_launcher(tmp_path):
    script = str(REPO / "examples" / "lightning_train.py")
    first = _run([sys.executable, script, "--max-steps", "4", "--output-dir", "out"], tmp_path)
    assert "finished at step 4" in first
    assert (tmp_path / "out" / "last.ckpt" / "meta.pt").is_file()  # a sharded checkpoint directory
    resumed = _run(
        [sys.executable, script, "--max-steps", "6", "--output-dir", "out", "--resume", "out/last.ckpt"], tmp_path
    )
    assert "finished at step 6" in resumed
    # As documented, a resume without --max-steps trains DEFAULT_STEPS more (not none at all).
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import lightning_train
    finally:
        sys.path.pop(0)
    checkpoint = str(tmp_path / "out" / "last.ckpt")
    saved_at = lightning_train.checkpoint_step(checkpoint)
    assert saved_at >= 4
    assert (
        lightning_train.last_step(lightning_train.parse_args(["--resume", checkpoint]))
        == saved_at + lightning_train.DEFAULT_STEPS
    )
    assert lightning_train.last_step(lightning_train.parse_args([])) == lightning_train.DEFAULT_STEPS


def test_fabric_example_trains_under_torchrun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]  # a free port
    output = _run(
        [*torchrun, str(REPO / "examples" / "fabric_train.py"), "--steps", "3", "--checkpoint", "ckpt"], tmp_path
    )
    assert "step 3: loss" in output
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    resumed = _run(
        [*torchrun, str(REPO / "examples" / "fabric_train.py"), "--steps", "2", "--checkpoint", "ckpt", "--resume"],
        tmp_path,
    )
    assert "step 4: loss" in resumed
    assert "step 5: loss" in resumed
    assert "step 3: loss" not in resumed
