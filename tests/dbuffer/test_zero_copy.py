"""DBuffer's point: a steady-state fp32 step copies nothing into or out of the collectives.

Two detectors:
- ``torch.profiler`` over a whole step: no ``split_with_sizes_copy`` or ``_chunk_cat``
  anywhere (FSDP2's copy-out and copy-in). The same detector run on torch's FSDP2
  finds them, so this test can fail.
- A ``TorchDispatchMode`` around the library's all-gather and reduce-scatter paths records
  every op *our code* dispatches there, and none may be a copy. Ops inside the collective
  call itself are its own work and are not counted: NCCL's, or on gloo the point-to-point
  version in ``inplace_collectives`` (the local write of this rank's own chunk, which any
  all-gather makes, and the sums of the received chunks); ``tests/dbuffer/test_inplace_collectives.py``
  checks that it allocates no full-size staging, where gloo's own collectives do.
"""

from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import vescale_plugins.dbuffer.buffer as dbuffer_module
import vescale_plugins.dbuffer.handles as handles_module
from tests.support.models import local_batch, loss_fn, make_decoder
from tests.support.parity import adamw, shard_decoder
from vescale_plugins import fully_shard

# FSDP2's copy-out and copy-in. (``aten::cat`` also appears in any step of this model: the
# backward of the attention's qkv ``unbind`` is a ``stack``; it is checked in our paths below.)
REORDERING_COPIES = {"aten::split_with_sizes_copy", "aten::_chunk_cat"}
COPY_OPS = {"aten.copy_", "aten._to_copy", "aten.clone", "aten.cat", "aten._chunk_cat", "aten.split_with_sizes_copy"}


def _train_step(model, opt, step):
    tokens, targets = local_batch(step)
    loss_fn(model(tokens), targets).backward()
    opt.step()
    opt.zero_grad()


def _profiled_steady_step(shard):
    model = shard_decoder(make_decoder(), shard=shard)
    opt = adamw(model)
    for step in range(2):
        _train_step(model, opt, step)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _train_step(model, opt, 2)
    return {e.name for e in prof.events()}


class _LibraryOps(TorchDispatchMode):
    """Records the aten ops dispatched by our code; pauses inside torch.distributed calls."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, set[str]] = {}
        self.path: str | None = None
        self.entered: set[str] = set()  # the paths that ran (the all-gather's may dispatch no op)
        self.in_collective = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.path is not None and not self.in_collective:
            self.ops.setdefault(self.path, set()).add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _record_library_paths(recorder, monkeypatch_targets):
    """Wrap DBuffer's collective paths and the collectives they call."""
    originals = {name: getattr(obj, name) for obj, name in monkeypatch_targets if name != "wait"}
    originals.update({f"{obj.__name__}.wait": obj.wait for obj, name in monkeypatch_targets if name == "wait"})

    def setting(attribute, value, reset, fn):
        """``fn`` with ``recorder.<attribute>`` set to ``value`` while it runs, ``reset`` after."""

        def wrapped(*args, **kwargs):
            setattr(recorder, attribute, value)
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(recorder, attribute, reset)

        return wrapped

    def path(name, fn):
        recording = setting("path", name, None, fn)

        def entered(*args, **kwargs):
            recorder.entered.add(name)
            return recording(*args, **kwargs)

        return entered

    def collective(fn):
        return setting("in_collective", True, False, fn)

    DBuffer = dbuffer_module.DBuffer
    DBuffer.all_gather = path("all_gather", originals["all_gather"])
    DBuffer.reduce_scatter = path("reduce_scatter", originals["reduce_scatter"])
    handles_module.GatherHandle.wait = path("all_gather", originals["GatherHandle.wait"])
    handles_module.ReduceScatterHandle.wait = path("reduce_scatter", originals["ReduceScatterHandle.wait"])
    dbuffer_module.all_gather_into = collective(originals["all_gather_into"])
    dbuffer_module.reduce_scatter_into = collective(originals["reduce_scatter_into"])
    handles_module.wait_collective = collective(originals["wait_collective"])
    return originals


def _ours_copy_nothing():
    everywhere = _profiled_steady_step(fully_shard)
    assert not everywhere & REORDERING_COPIES, everywhere & REORDERING_COPIES

    model = shard_decoder(make_decoder())
    opt = adamw(model)
    _train_step(model, opt, 0)
    recorder = _LibraryOps()
    targets = [
        (dbuffer_module.DBuffer, "all_gather"),
        (dbuffer_module.DBuffer, "reduce_scatter"),
        (handles_module.GatherHandle, "wait"),
        (handles_module.ReduceScatterHandle, "wait"),
        (dbuffer_module, "all_gather_into"),
        (dbuffer_module, "reduce_scatter_into"),
        (handles_module, "wait_collective"),
    ]
    originals = _record_library_paths(recorder, targets)
    try:
        with recorder:
            _train_step(model, opt, 1)
    finally:
        for obj, name in targets:
            setattr(obj, name, originals[f"{obj.__name__}.wait" if name == "wait" else name])
    # Both paths ran; the all-gather's dispatches no op at all when no profiler runs (its scope
    # is marked only under one), the reduce-scatter's its division and output.
    assert recorder.entered == {"all_gather", "reduce_scatter"}, recorder.entered
    assert "reduce_scatter" in recorder.ops, recorder.ops
    assert set(recorder.ops) <= {"all_gather", "reduce_scatter"}, recorder.ops
    for path, ops in recorder.ops.items():
        assert not ops & COPY_OPS, (path, sorted(ops))


def test_steady_state_step_has_no_copies_around_collectives(dist_run):
    dist_run(_ours_copy_nothing, 2)


def _fsdp2_copies_are_visible():
    names = _profiled_steady_step(torch_fully_shard)
    assert names & REORDERING_COPIES, sorted(n for n in names if "copy" in n or "cat" in n)


def test_the_detector_sees_fsdp2s_copy_in_and_copy_out(dist_run):
    dist_run(_fsdp2_copies_are_visible, 2)
