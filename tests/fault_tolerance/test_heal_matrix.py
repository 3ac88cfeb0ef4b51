"""torchft's crash-and-restart heal over the whole matrix users wire: transport (torchft's
``HTTPTransport``, its default, and its ``PGTransport``) x state dicts (the modules' own, or
DCP's ``get_*_state_dict`` / ``set_*_state_dict``, torchtitan's path) x quorum (sync, async:
torchft's default) x the manager's all-reduce hook (none, ``set_all_reduce_hook``) x each
group's mesh (flat, HSDP 1 x 2), on the uneven MLP (16-37-64-37-8: the last weight's shards
(4, 4) rows, its bias's (0, 8)); then the decoder and a failure inside a backward.

Two replica groups of 2 gloo ranks under a real ``Manager`` and lighthouse; replica 1 dies
before step 3 and is restarted; it heals from replica 0. Each case checks, for both engines:

- what the healed group loaded is what its source sent, bit for bit: every entry's global
  shape, placements and this rank's shard (:func:`check_heal`: the sender records its state
  dict as it sends it, the healed rank its own state dict right after loading);
- both groups train to the last step; their final parameters and optimizer states are equal
  bit for bit, except under the async quorum without the hook: there the healed group's
  first step uses the gradient of its weights before the heal (torchft's async quorum leans
  on its all-reduce to replace it), for FSDP2 as for us;
- ours equals FSDP2's run of the same case (FSDP2 under the sync quorum: under the async one
  its own forward races the state dict's reshard, ``measure_async_heal``), and a heal sends
  at most FSDP2's bytes.

The cheap cases (torchtitan's path: DCP's state dicts over HTTP and the all-reduce hook, and
the decoder) run in every ``-m "not slow"`` run; the rest are marked ``slow`` (all run in
``make test``). Rank processes fork from a preloaded server (``ft_launch``): a case costs
about 4 s per engine on 2 cores.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

from tests.fault_tolerance.ft_case import Case
from tests.fault_tolerance.ft_launch import DEADLINE_S, STEPS, run_heal

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(3 * DEADLINE_S + 60)]

TRANSPORTS = ("http", "torchft-pg")
STATES = ("dcp", "module")


def check_heal(results: dict[tuple[int, int], dict], out: Path, final_equal: bool) -> str:
    """Assert the heal of one run (see the module docstring); return ``"ok"``."""
    for rank in range(2):
        restarted_heals = [int(f.name.split(".step")[1][:-3]) for f in out.glob(f"healed.1.{rank}.step*.pt")]
        assert any(step > 0 for step in restarted_heals), f"rank {rank} of replica 1 did not heal after its restart"
        for healed_file in out.glob(f"healed.*.{rank}.step*.pt"):  # (torchft may sync either group at step 0)
            replica, step = int(healed_file.name.split(".")[1]), healed_file.name.split(".step")[1][:-3]
            sent_file = out / f"sent.{1 - replica}.{rank}.step{step}.pt"
            assert sent_file.exists(), f"{healed_file.name}: the other group sent nothing at step {step}"
            _assert_same_state(torch.load(sent_file, weights_only=False), torch.load(healed_file, weights_only=False))
        for replica in range(2):
            steps = [s for s, _ in results[(replica, rank)]["losses"]]
            assert steps[-1:] == [STEPS - 1], f"replica {replica} rank {rank} stopped at {steps}"
        if final_equal:
            live, healed = results[(0, rank)]["full"], results[(1, rank)]["full"]
            assert live.keys() == healed.keys()
            for key, value in live.items():
                assert torch.equal(value, healed[key]), f"rank {rank}: {key} differs after the heal's steps"
    return "ok"


def _assert_same_state(sent: dict[str, Any], loaded: dict[str, Any]) -> None:
    assert sent.keys() == loaded.keys(), sorted(set(sent) ^ set(loaded))
    for key, value in sent.items():
        got = loaded[key]
        if isinstance(value, tuple):  # a DTensor: global shape, placements, local shard
            assert value[:2] == got[:2], f"{key}: sent {value[:2]}, loaded {got[:2]}"
            value, got = value[2], got[2]
        if isinstance(value, torch.Tensor):
            assert (value.dtype, value.shape) == (got.dtype, got.shape), key
            assert torch.equal(value, got), f"{key}: values differ"
        else:
            assert value == got, (key, value, got)


# FSDP2's sync run of each (transport, case): the reference for both quorums, run once.
_FSDP2_SYNC: dict[tuple[str, Case], dict] = {}


def _fsdp2_sync(tmp_path: Path, transport: str, case: Case) -> dict:
    if (transport, case) not in _FSDP2_SYNC:
        out = tmp_path / "fsdp2"
        out.mkdir()
        results = run_heal("torch", transport, out, "crash", case=case)
        check_heal(results, out, final_equal=True)
        _FSDP2_SYNC[(transport, case)] = results
    return _FSDP2_SYNC[(transport, case)]


def _matrix() -> list[Any]:
    cases = []
    for transport, state, quorum, hook, mesh in itertools.product(
        TRANSPORTS, STATES, ("sync", "async"), ("hook", "no-hook"), ("flat", "hsdp")
    ):
        cheap = transport == "http" and state == "dcp" and hook == "hook" and mesh == "flat"
        marks = [] if cheap else [pytest.mark.slow]
        case = Case(model="mlp", state=state, hook=hook == "hook", hsdp=mesh == "hsdp")
        cases.append(
            pytest.param(transport, quorum, case, marks=marks, id=f"{transport}-{state}-{quorum}-{hook}-{mesh}")
        )
    for transport, fail in itertools.product(TRANSPORTS, ("boundary", "midstep")):
        # The decoder over torchtitan's path, killed between two steps or inside a backward.
        case = Case(model="decoder", state="dcp", hook=True, fail=fail)
        marks = [] if transport == "http" else [pytest.mark.slow]
        cases.append(pytest.param(transport, "async", case, marks=marks, id=f"decoder-{transport}-dcp-async-{fail}"))
    cases.append(
        pytest.param("http", "async", Case(model="mlp", state="dcp", fail="midstep"), id="http-dcp-async-midstep")
    )
    return cases


@pytest.mark.parametrize(("transport", "quorum", "case"), _matrix())
def test_crashed_group_heals_bit_for_bit(tmp_path, transport, quorum, case):
    async_quorum = quorum == "async"
    final_equal = case.hook or not async_quorum
    fsdp2 = _fsdp2_sync(tmp_path, transport, case)
    (tmp_path / "ours").mkdir()
    ours = run_heal("vescale", transport, tmp_path / "ours", "crash", async_quorum=async_quorum, case=case)
    check_heal(ours, tmp_path / "ours", final_equal)
    if final_equal:
        for key, value in fsdp2[(0, 0)]["full"].items():
            torch.testing.assert_close(ours[(0, 0)]["full"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    if not async_quorum:  # the same heals: ours sends at most FSDP2's bytes
        sent = {name: sum(r[(0, k)]["bytes"] for k in range(2)) for name, r in (("ours", ours), ("fsdp2", fsdp2))}
        assert sent["ours"] <= sent["fsdp2"], sent
