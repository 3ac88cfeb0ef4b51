"""The documented config route, with the real launcher: an FSDP2 config and script, unchanged.

    accelerate launch --config_file examples/accelerate_fsdp2.yaml --num_processes 2 \\
        -m accelerate_plugin.run examples/accelerate_train.py

runs on two CPU processes over gloo (Accelerate's torchrun launcher; each process starts in
``accelerate_plugin.run``), trains with veScale-FSDP, and writes checkpoints and full weights.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
KILL_GRACE_S = 15
STEPS, ACCUMULATION = 3, 2


def _launch(args: list[str]) -> str:
    """Run ``accelerate launch ARGS`` from the repository root; stop the whole tree on timeout."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", *args]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in its own session and kills them on SIGTERM; SIGKILL
        # would orphan them. SIGKILL only if the launcher does not go within the grace period.
        os.killpg(process.pid, signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
        pytest.fail(f"accelerate launch did not finish within {TIMEOUT_S}s:\n{output[-4000:]}")
    assert process.returncode == 0, f"accelerate launch failed ({process.returncode}):\n{output[-6000:]}"
    return output


def _example_module():
    spec = importlib.util.spec_from_file_location("accelerate_train_example", REPO / "examples" / "accelerate_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accelerate_launch_with_an_fsdp2_config_trains_with_vescale(tmp_path):
    _launch([
        "--config_file", "examples/accelerate_fsdp2.yaml", "--num_processes", "2", "--main_process_port", "0",
        "-m", "accelerate_plugin.run", "examples/accelerate_train.py",
        "--steps", str(STEPS), "--accumulation", str(ACCUMULATION), "--output_dir", str(tmp_path),
    ])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["distributed_type"] == "DistributedType.FSDP" and summary["num_processes"] == 2
    assert summary["parameter_placements"] == ["RaggedShard"]
    assert len(summary["losses"]) == STEPS * ACCUMULATION and all(math.isfinite(x) for x in summary["losses"])
    assert len(summary["grad_norms"]) == STEPS

    state = tmp_path / "state"
    assert (state / "pytorch_model_fsdp_0" / ".metadata").exists() and (state / "optimizer_0" / ".metadata").exists()
    plain = _example_module().TinyDecoder()
    plain.load_state_dict(load_file(tmp_path / "model" / "model.safetensors"))
