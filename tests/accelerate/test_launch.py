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

import pytest
from safetensors.torch import load_file

from tests.support.launched import REPO, launch

pytestmark = pytest.mark.distributed
TIMEOUT_S = 240
STEPS, ACCUMULATION = 3, 2


def _launch(args: list[str]) -> str:
    """Run ``accelerate launch ARGS`` from the repository root; stop the whole tree on timeout."""
    return launch(["-m", "accelerate.commands.accelerate_cli", "launch", *args], timeout_s=TIMEOUT_S)


def _example_model_module():
    spec = importlib.util.spec_from_file_location("tiny_decoder", REPO / "examples" / "tiny_decoder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_accelerate_launch_with_an_fsdp2_config_trains_with_vescale(tmp_path):
    _launch(
        [
            "--config_file",
            "examples/accelerate_fsdp2.yaml",
            "--num_processes",
            "2",
            "--main_process_port",
            "0",
            "-m",
            "accelerate_plugin.run",
            "examples/accelerate_train.py",
            "--steps",
            str(STEPS),
            "--accumulation",
            str(ACCUMULATION),
            "--output_dir",
            str(tmp_path),
        ]
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["distributed_type"] == "DistributedType.FSDP"
    assert summary["num_processes"] == 2
    assert summary["parameter_placements"] == ["RaggedShard"]
    assert len(summary["losses"]) == STEPS * ACCUMULATION
    assert all(math.isfinite(x) for x in summary["losses"])
    assert len(summary["grad_norms"]) == STEPS

    state = tmp_path / "state"
    assert (state / "pytorch_model_fsdp_0" / ".metadata").exists()
    assert (state / "optimizer_0" / ".metadata").exists()
    plain = _example_model_module().TinyDecoder(vocab=97)
    plain.load_state_dict(load_file(tmp_path / "model" / "model.safetensors"))
