"""Released CPU buffers are kept by the root's pool and reused by the next gathers.

The pool moves memory between storages (views survive), serves a buffer only from blocks of
its own kind and size, holds at most ``MAX_PER_KEY`` of each, and holds nothing at the end of
forward. Training with it matches the unsharded model (W=2, 3).
"""

import pytest
import torch
import torch.distributed as dist

from models import clone, make_decoder, reference_step
from test_fully_shard import TOL, adamw, assert_matches, shard_decoder, sharded_step, step_and_zero
from vescale_plugins.dbuffer.buffer import _StorageToggle
import vescale_plugins.dbuffer.storage_pool as storage_pool
from vescale_plugins.dbuffer.storage_pool import MAX_PER_KEY, StoragePool


@pytest.fixture(autouse=True)
def _pool_enabled(monkeypatch):
    monkeypatch.setattr(storage_pool, "ENABLED", True)


def _toggle(pool, numel=1000, kind="unsharded_params"):
    toggle = _StorageToggle(numel, torch.float32, torch.device("cpu"), kind)
    toggle.pool = pool
    return toggle


def test_a_released_block_moves_into_the_next_buffer_and_views_survive():
    pool = StoragePool()
    a, b = _toggle(pool), _toggle(pool)
    a.allocate().fill_(3.0)
    b.allocate()
    view_a, view_b = a.tensor[10:20], b.tensor[5:7]  # cut once, as DBuffer's views are
    b.release()
    pool.clear()
    block = a.tensor.data_ptr()
    a.release()
    assert not a.allocated and pool.held_bytes == a.nbytes
    b.allocate()
    assert b.tensor.data_ptr() == block and pool.held_bytes == 0 and pool.reused == 1
    view_b.fill_(7.0)  # a view cut before the swap writes into the pooled block
    assert b.tensor[5:7].tolist() == [7.0, 7.0]
    a.allocate()  # nothing pooled: fresh memory, and the old views see it
    assert a.tensor.data_ptr() != block
    view_a.fill_(1.0)
    assert a.tensor[10:20].sum().item() == 10.0


def test_only_same_kind_and_size_is_reused_and_the_pool_is_bounded():
    pool = StoragePool()
    params = [_toggle(pool) for _ in range(MAX_PER_KEY + 1)]
    for t in params:
        t.allocate()
    for t in params:
        t.release()
    assert pool.held_bytes == MAX_PER_KEY * params[0].nbytes  # the third was freed
    assert all(t.tensor.untyped_storage().size() == 0 for t in params)
    _toggle(pool, kind="unsharded_grads").allocate()
    _toggle(pool, numel=999).allocate()
    assert pool.reused == 0
    pool.clear()
    assert pool.held_bytes == 0
    params[0].allocate()
    assert pool.reused == 0 and params[0].allocated


def _pool_reuse_and_parity():
    storage_pool.ENABLED = True  # off by default (see storage_pool); this worker only
    try:
        return _train_with_pool()
    finally:
        storage_pool.ENABLED = False


def _train_with_pool():
    world = dist.get_world_size()
    reference = make_decoder()
    model = shard_decoder(clone(reference), reshard_after_forward=True)
    opt, ref_opt = adamw(model), adamw(reference)
    pool = None
    for step in range(3):
        ref_loss = reference_step(reference, step, world)
        loss = sharded_step(model, step)
        pool = model._vescale_fsdp_unit._storage_pool
        torch.testing.assert_close(loss, ref_loss, **TOL)
        assert_matches(model, reference, "grad")
        step_and_zero(opt, ref_opt)
        assert_matches(model, reference, "param")
    # Every unit uses the root's pool, and later gathers got memory earlier units released.
    for layer in model.layers:
        assert all(b._unsharded.pool is pool for b in layer._vescale_fsdp_unit.dbuffers)
    assert pool.reused > 0
    # End of forward: the pool is emptied before the loss (the usual peak); end of backward too.
    held_at_loss = []
    model.register_forward_hook(lambda *_: held_at_loss.append(pool.held_bytes), always_call=True)
    sharded_step(model, 3)
    assert held_at_loss == [0] and pool.held_bytes == 0
    return pool.reused


@pytest.mark.parametrize("world", [2, 3])
def test_training_with_the_pool_matches_the_unsharded_model(dist_run, world):
    reused = dist_run(_pool_reuse_and_parity, world)
    assert all(r > 0 for r in reused)
