"""Issued collectives of a DBuffer: ``wait()`` completes one and makes its result usable.

On CUDA the collective ran on a side stream and the handle makes the compute stream wait on
its event; on gloo the handle waits on the backend's ``Work``. Either way the observer (the
run record) learns how long the caller waited. A backend error in a wait becomes a
:class:`~.faults.CollectiveError` naming the unit and the collective, and the handle is
abandoned (``abandon()``: nothing of it lands); so is a handle whose process group an earlier
failure broke, without waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from vescale_plugins.dbuffer import observer
from vescale_plugins.dbuffer.faults import BROKEN, CollectiveError, CollectiveSite
from vescale_plugins.dbuffer.observer import REDUCE_SCATTER_REGION
from vescale_plugins.dbuffer.storage import set_version_counter
from vescale_plugins.dbuffer.streams import CommStreams

if TYPE_CHECKING:
    from vescale_plugins.dbuffer.reduction import GradientReduction

__all__ = [
    "AfterReduceScatter",
    "GatherHandle",
    "GradientLanding",
    "IssuedReduceScatter",
    "ReduceScatterHandle",
    "ReduceScatterSpec",
    "wait_collective",
]


def wait_collective(work: Any) -> None:
    """Complete an issued collective (gloo finishes some of its work here, on this thread:
    the point-to-point reduce-scatter's sums)."""
    work.wait()


def _wait_started(token: Any, work: Any, streams: CommStreams) -> Any:
    """A mark of when the caller started waiting: now (on CUDA, where the compute stream is),
    or None for a synchronous host collective (no work to wait on): the caller waited from
    its issue on."""
    watcher = observer.current()
    if token is None or watcher is None:
        return None
    return watcher.now() if work is not None or streams.enabled else None


def _report_done(token: Any, wait_started: Any) -> None:
    watcher = observer.current()
    if token is not None and watcher is not None:
        watcher.collective_done(token, wait_started)


class GatherHandle:
    """An issued all-gather (``site``: its group, unit and phase, for its error): ``wait()``
    completes it and hides the refill from autograd."""

    def __init__(
        self,
        unsharded: torch.Tensor,
        version: int,
        work: Any,
        token: Any,
        streams: CommStreams,
        done: Any,
        site: CollectiveSite,
    ) -> None:
        self._unsharded, self._version, self._work, self._token = unsharded, version, work, token
        self._streams, self._done, self._site = streams, done, site
        self._abandoned = False
        self.after_wait: Callable[[], None] | None = None

    def abandon(self) -> None:
        """Drop it without waiting (its group failed): the gathered buffer holds no
        parameters, and a later ``wait()`` raises."""
        self._abandoned = True
        self._work = self._done = self._token = None
        self.after_wait = None

    def wait(self) -> None:
        if self._work is not None and self._site.group in BROKEN:
            self.abandon()
        if self._abandoned:
            self._site.check_usable()
            site = self._site
            raise CollectiveError(site.unit, site.collective, "dropped unwaited after a collective failed")
        wait_started = _wait_started(self._token, self._work, self._streams)
        if self._work is not None:
            work, self._work = self._work, None
            try:
                wait_collective(work)
            except RuntimeError as err:
                self.abandon()
                self._site.translate(err)
                raise
        if self._done is not None:
            self._streams.wait(self._done)
            self._done = None
        set_version_counter(self._unsharded, self._version)
        _report_done(self._token, wait_started)
        self._token = None
        if self.after_wait is not None:
            after_wait, self.after_wait = self.after_wait, None
            after_wait()


@dataclass(frozen=True)
class AfterReduceScatter:
    """What follows a reduce-scatter before its result lands, as in FSDP2's ``foreach_reduce``:
    HSDP's all-reduce across ``replicate_group``, then the user's ``hook``
    (``set_all_reduce_hook``) on the reduce output, both on ``stream`` (None: the all-reduce
    stream). The hook sees the output before the reduction's post-divide, as FSDP2's does:
    the mean for fp32 and bf16, else (fp16, ``set_force_sum_reduction_for_comms``) the sum."""

    replicate_group: dist.ProcessGroup | None = None
    hook: Callable[[torch.Tensor], None] | None = None
    stream: Any = None


@dataclass(frozen=True)
class GradientLanding:
    """The DBuffer's side of its reduce-scatters, made once per DBuffer: its streams, its
    shard size (elements) and what it does with a reduce output, as callbacks (a handle sits
    below the DBuffer that issued it and never calls into it by name).

    ``release_input`` frees the unsharded gradient buffer; ``land(reduced, sharded_grad)``
    writes a reduce output into the sharded gradient buffer; ``keep_partial(reduced)`` and
    ``take_partial()`` hold back and hand over HSDP sums awaiting their all-reduce. ``site``:
    the reduce-scatter's group and unit, for its error."""

    streams: CommStreams
    shard_size: int
    site: CollectiveSite
    release_input: Callable[[], None]
    land: Callable[[torch.Tensor, torch.Tensor], None]
    keep_partial: Callable[[torch.Tensor], None]
    take_partial: Callable[[], torch.Tensor | None]


@dataclass(frozen=True)
class ReduceScatterSpec:
    """What a reduce-scatter was asked to do: scale as ``reduction`` says, ``accumulate``
    onto the existing sharded gradients, whether it wrote ``in_place`` into the sharded
    gradient buffer, what follows it (``after``) and whether it is ``partial`` (HSDP
    without the all-reduce this backward)."""

    reduction: GradientReduction
    accumulate: bool
    in_place: bool
    after: AfterReduceScatter | None = None
    partial: bool = False


@dataclass(frozen=True)
class IssuedReduceScatter:
    """One reduce-scatter as issued: the backend's ``work`` (gloo; ``None`` on a side
    stream), its output ``out``, the ``sharded_grad`` buffer it lands in, the observer's
    ``token``, the bytes of a temporary output (``temp_bytes``, 0 if in place) and the event
    recorded after it (``done_event``, CUDA)."""

    work: Any
    out: torch.Tensor
    sharded_grad: torch.Tensor
    token: Any
    temp_bytes: int
    done_event: Any


class ReduceScatterHandle:
    """An issued reduce-scatter, finished in two phases.

    :meth:`wait_reduce_scatter` (the next unit's post-backward): the reduce-scatter is done and
    its input, the unsharded gradient buffer, is freed; what follows it (:class:`AfterReduceScatter`)
    is issued on its own stream unless it already was (on CUDA it is issued with the
    reduce-scatter, ordered after it on the GPU). :meth:`wait` (the end of backward, where FSDP2
    waits for its post-reduce events): that is done too; the result is post-divided, lands in
    the sharded gradients and the full gradients are freed. With nothing to follow, both happen
    at once. ``partial``: HSDP without the all-reduce this backward; the shard group's sum is
    kept back.

    If either collective fails, or a group it runs on was broken by an earlier failure, the
    wait raises :class:`~.faults.CollectiveError` and the handle is abandoned
    (:meth:`abandon`): nothing lands in the sharded gradients.
    """

    def __init__(self, landing: GradientLanding, spec: ReduceScatterSpec, issued: IssuedReduceScatter) -> None:
        self._landing, self._streams = landing, landing.streams
        self._work, self._sharded_grad = issued.work, issued.sharded_grad
        self._out: torch.Tensor | None = issued.out  # dropped once done
        self._reduction, self._accumulate, self._in_place = spec.reduction, spec.accumulate, spec.in_place
        self._token, self._temp_bytes, self._done_event = issued.token, issued.temp_bytes, issued.done_event
        self._after, self._partial = spec.after, spec.partial
        self._site = landing.site
        self._after_site = (
            CollectiveSite(spec.after.replicate_group, landing.site.unit, "all-reduce across replicas (HSDP)")
            if spec.after is not None and spec.after.replicate_group is not None
            else None
        )
        self._after_issued = False
        self._after_work: Any = None  # gloo: the all-reduce in flight
        self._after_event: Any = None  # CUDA: recorded after the all-reduce and the hook
        self._kept_partial: torch.Tensor | None = None  # read by the all-reduce stream until done
        self.reduce_scatter_done = False
        self.done = False
        # Run once the sharded gradients are final (post-accumulate-grad hooks).
        self.after_wait: Callable[[], None] | None = None
        # Run if it is abandoned: the caller forgets gradients it made views of the (possibly
        # half-written) sharded gradient buffer.
        self.on_abandon: Callable[[], None] | None = None
        if self._after is not None and self._streams.enabled:
            self._issue_after_reduce_scatter()

    def abandon(self) -> None:
        """Drop it without waiting: nothing lands in the sharded gradients (whose buffer a
        failed reduce-scatter may have half written: ``on_abandon`` runs), the unsharded
        gradient buffer is freed, no hook runs."""
        if self.done:
            return
        self._work = self._after_work = None
        self._out = self._kept_partial = None
        self.after_wait = None
        if not self.reduce_scatter_done:
            self.reduce_scatter_done = True
            self._landing.release_input()
        self.done = True
        on_abandon, self.on_abandon = self.on_abandon, None
        if on_abandon is not None:
            on_abandon()

    def _raise_if_broken(self, site: CollectiveSite | None) -> None:
        if site is not None and site.group in BROKEN:
            self.abandon()
            site.check_usable()

    def _wait(self, work: Any, site: CollectiveSite) -> None:
        """Wait on the backend's ``work``; its error is raised as the unit's, abandoning this."""
        try:
            wait_collective(work)
        except RuntimeError as err:
            self.abandon()
            site.translate(err)
            raise

    @property
    def on_host(self) -> bool:
        """Whether it is a host collective (gloo's ``Work``), with no side stream."""
        return not self._streams.enabled

    def wait_reduce_scatter(self) -> None:
        """Complete the reduce-scatter and free its input; finish now if nothing follows it."""
        self._complete_reduce_scatter()
        if self._after is None:
            self.wait()

    def _complete_reduce_scatter(self) -> None:
        if not self.reduce_scatter_done:
            self._raise_if_broken(self._site)
            assert self._out is not None
            wait_started = _wait_started(self._token, self._work, self._streams)
            with observer.region(REDUCE_SCATTER_REGION):
                if self._work is not None:
                    work, self._work = self._work, None
                    self._wait(work, self._site)
                # The compute stream waits before it reads the result or frees the input.
                self._streams.wait(self._done_event)
                _report_done(self._token, wait_started)
                if self._partial:
                    self._landing.keep_partial(self._out)
                elif self._after is not None and not self._after_issued:
                    self._issue_after_reduce_scatter()
            self._landing.release_input()
            self.reduce_scatter_done = True

    def wait(self) -> None:
        """Complete everything: the sharded gradients are final."""
        if self.done:
            return
        self._complete_reduce_scatter()
        out = self._out
        assert out is not None
        with observer.region(REDUCE_SCATTER_REGION):
            if self._after is not None:
                if self._after_work is not None:
                    assert self._after_site is not None  # only HSDP's all-reduce is waited on here
                    self._raise_if_broken(self._after_site)
                    work, self._after_work = self._after_work, None
                    self._wait(work, self._after_site)
                    self._run_hook(out)  # gloo: once the all-reduce's result is here
                self._streams.wait(self._after_event)
            if not self._partial:
                self._finish_gradients(out, self._sharded_grad)
            watcher = observer.current()
            if watcher is not None:
                watcher.buffer_freed("comm_buffers", self._temp_bytes)
        # Keep the sharded gradient buffer: it is held weakly by the DBuffer, so this handle is
        # what keeps it alive until the caller has made the gradients' views of it.
        self._out = self._kept_partial = None
        self.done = True
        if self.after_wait is not None:
            after_wait, self.after_wait = self.after_wait, None
            after_wait()

    def _issue_after_reduce_scatter(self) -> None:
        """HSDP's all-reduce (with the sums kept back), then the hook, on their stream once the
        reduce-scatter is done; asynchronous on gloo, where the hook waits for :meth:`wait`."""
        after, out, streams = self._after, self._out, self._streams
        assert after is not None and out is not None
        self._after_issued = True
        stream = after.stream if after.stream is not None else streams.all_reduce
        with streams.issue_on(stream, after=self._done_event):
            if after.replicate_group is not None:
                site = self._after_site
                assert site is not None  # made for every replicate group
                self._raise_if_broken(site)
                self._kept_partial = self._landing.take_partial()
                if self._kept_partial is not None:
                    out.add_(self._kept_partial)
                op = dist.ReduceOp.AVG if self._reduction.all_reduce_average else dist.ReduceOp.SUM
                try:
                    with site.faults():
                        self._after_work = dist.all_reduce(
                            out, op=op, group=after.replicate_group, async_op=not streams.enabled
                        )
                except CollectiveError:
                    self.abandon()
                    raise
            if self._after_work is None:
                self._run_hook(out)
            self._after_event = streams.record(stream)

    def _run_hook(self, out: torch.Tensor) -> None:
        after = self._after
        assert after is not None
        if after.hook is None:
            return
        # The gradient shard with its padding (what FSDP2's reduce output holds), without the
        # presence flags that follow it.
        after.hook(out[: self._landing.shard_size])

    def _finish_gradients(self, out: torch.Tensor, sharded_grad: torch.Tensor) -> None:
        post_divide = self._reduction.post_divide
        if post_divide is not None and post_divide != 1:
            out.div_(post_divide)
        if self._accumulate:
            # CPU offload: the host adds what it has fully received (as FSDP2, a blocking copy).
            out = out.to(sharded_grad.device)
            shard_size = self._landing.shard_size
            sharded_grad[:shard_size].add_(out[:shard_size])
            sharded_grad[shard_size:].copy_(out[shard_size:])  # this reduce's presence flags
        elif not self._in_place:
            self._landing.land(out, sharded_grad)
