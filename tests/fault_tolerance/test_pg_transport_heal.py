"""Healing a restarted replica group over torchft's ``PGTransport``: our engine and FSDP2 side by
side, counting what the transport sends (see :mod:`.heal`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchft")

from tests.fault_tolerance.heal import heal_over_pg_transport, pickled_sizes

pytestmark = pytest.mark.timeout(300)


def _check_healed(results: list[dict]) -> None:
    """Ranks 0, 1 are replica 0's; 2, 3 replica 1's: each healed rank holds its peer's state
    bit for bit, and the step after the heal agrees too."""
    for live, healed in ((results[0], results[2]), (results[1], results[3])):
        assert (live["replica"], healed["replica"]) == (0, 1)
        assert live["healed"].keys() == healed["healed"].keys()
        for key in live["healed"]:
            assert torch.equal(live["healed"][key], healed["healed"][key]), key
            assert torch.equal(live["after"][key], healed["after"][key]), key
        assert live["loss"] == healed["loss"]


def _sent(results: list[dict]) -> tuple[int, int]:
    return sum(r["messages"] for r in results), sum(r["bytes"] for r in results)


@pytest.mark.parametrize("in_place", [False, True], ids=["allocated", "in_place"])
@pytest.mark.parametrize("transport", ["torchft", "vescale"])
def test_heal_sends_no_more_than_fsdp2(dist_run, transport, in_place):
    """Healing our sharded 4-block transformer over ``PGTransport`` sends at most what FSDP2's
    heal over torchft's sends, and the healed group equals the live one bit for bit, then
    trains on identically: over torchft's own ``PGTransport`` with plain ``model.state_dict()``
    and ``optimizer.state_dict()`` (each shard owns exactly its bytes; before, each sent its
    unit's whole buffer), and over ours."""
    ours = dist_run(heal_over_pg_transport, 4, "vescale", transport, in_place=in_place)
    fsdp2 = dist_run(heal_over_pg_transport, 4, "torch", "torchft", in_place=in_place)
    _check_healed(fsdp2)
    _check_healed(ours)
    (our_messages, our_bytes), (fsdp2_messages, fsdp2_bytes) = _sent(ours), _sent(fsdp2)
    print(f"PGTransport heal: ours {our_bytes} B in {our_messages} sends, FSDP2 {fsdp2_bytes} B in {fsdp2_messages}")
    assert our_bytes <= fsdp2_bytes


def test_one_saved_entry_writes_its_own_shard(dist_run):
    """``torch.save`` of one state-dict entry writes that shard's bytes, not its unit's whole
    flat buffer (before: every parameter of a unit wrote the same whole buffer)."""
    for rank_sizes in dist_run(pickled_sizes, 2, "vescale"):
        for name, (written, copy_written) in rank_sizes.items():
            assert written <= copy_written + 256, (name, written, copy_written)  # framing varies a little


@pytest.mark.parametrize("engine", ["vescale", "torch"])
def test_flat_buffer_heal_sends_fewer_messages(dist_run, engine):
    """``FlatBufferTransport`` heals bit for bit in fewer messages than torchft's
    ``PGTransport`` (one per DBuffer for our units, small states packed into one), with no
    more bytes than FSDP2's heal over torchft's."""
    flat = dist_run(heal_over_pg_transport, 4, engine, "flat")
    fsdp2 = dist_run(heal_over_pg_transport, 4, "torch", "torchft")
    _check_healed(flat)
    (flat_messages, flat_bytes), (fsdp2_messages, fsdp2_bytes) = _sent(flat), _sent(fsdp2)
    print(
        f"flat heal ({engine}): {flat_bytes} B in {flat_messages} sends; FSDP2 over torchft's: {fsdp2_bytes} B in {fsdp2_messages}"
    )
    assert flat_bytes <= fsdp2_bytes
    assert flat_messages * 4 <= fsdp2_messages


@pytest.mark.parametrize(
    ("optim", "transport"),
    [("adamw8bit", "torchft"), ("adamw8bit", "flat"), ("muon", "torchft"), ("flat_adamw", "torchft")],
)
def test_our_optimizer_states_heal_bit_for_bit(dist_run, optim, transport):
    """AdamW8bit's 8-bit codes and scales, Muon's momenta (with its AdamW group's moments) and
    flat AdamW's moments heal bit for bit, and the step after the heal agrees. Over torchft's
    ``PGTransport`` with plain state dicts, the tensors sent are exactly the state's own bytes
    (before: a flat optimizer's state sent its run's whole buffer per parameter); over
    ``FlatBufferTransport`` (spans of the flat buffers, padding included) in a quarter of the
    messages."""
    results = dist_run(heal_over_pg_transport, 4, "vescale", transport, optim=optim)
    _check_healed(results)
    for live in results[:2]:
        print(
            f"{optim} over {transport}: {live['payload']} B of tensors in {live['messages']} sends, "
            f"for {live['own_bytes']} B of state in {live['tensors']} tensors"
        )
        if transport == "torchft":
            assert live["payload"] == live["own_bytes"]
        else:
            assert live["messages"] * 4 <= live["tensors"]


def test_hsdp_group_heals_with_no_more_than_fsdp2(dist_run):
    """Each replica group an HSDP job (1 replica x 2 shards: state-dict entries placed
    ``[Replicate(), RaggedShard]``): the heal over torchft's ``PGTransport`` and over
    ``FlatBufferTransport`` is bit for bit, the step after it agrees, and ours sends at most
    FSDP2's bytes over torchft's ``PGTransport``."""
    fsdp2 = dist_run(heal_over_pg_transport, 4, "torch", "torchft", hsdp=True)
    _check_healed(fsdp2)
    fsdp2_messages, fsdp2_bytes = _sent(fsdp2)
    for transport in ("torchft", "flat"):
        ours = dist_run(heal_over_pg_transport, 4, "vescale", transport, hsdp=True)
        _check_healed(ours)
        our_messages, our_bytes = _sent(ours)
        print(
            f"HSDP heal over {transport}: ours {our_bytes} B in {our_messages} sends, FSDP2 {fsdp2_bytes} B in {fsdp2_messages}"
        )
        assert our_bytes <= fsdp2_bytes
