"""A collective of a unit that failed: the error that names it, and the groups it broke.

A peer that dies (or hangs past the backend's timeout, or whose communicator is aborted)
while a unit's all-gather or reduce-scatter is in flight makes the backend raise where the
collective is issued or waited on, with a message about sockets and ranks. This is where
that error is turned into a :class:`CollectiveError` that says which collective of which
unit failed, chained to the backend's (``raise ... from err``).

A failed collective leaves its process group unusable (gloo's pairs to the dead peer are
closed; an aborted NCCL communicator stays aborted), so the group is remembered as broken,
weakly, per group object: later collectives on it fail at once, naming the first failure,
instead of each waiting for the backend's timeout, and what is still in flight on it is
dropped without a wait (:meth:`~.handles.ReduceScatterHandle.abandon`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist

__all__ = ["BROKEN", "CollectiveError", "CollectiveSite", "broken_by", "check_usable", "collective_faults"]

# Each group an earlier failure broke (weakly, per group object), with that failure. The
# collective paths ask ``site.group in BROKEN`` before each collective and call in here only on
# a failure: a healthy step enters no function of this module.
BROKEN: weakref.WeakKeyDictionary[dist.ProcessGroup, str] = weakref.WeakKeyDictionary()

REJOIN_HINT = (
    "the process group is unusable: call reset_iter_state() on the root module, destroy the process group "
    "and rejoin (docs/fault_tolerance.md, 'A peer dying inside our collectives')"
)


class CollectiveError(RuntimeError):
    """A unit's collective failed (a peer died, timed out or was aborted).

    ``unit``: the unit's module name from its root (``"layers.3"``, ``"<root>"``);
    ``collective``: what failed (``"all-gather in forward"``, ``"reduce-scatter"``,
    ``"all-reduce across replicas (HSDP)"``). The backend's error is its ``__cause__``.
    """

    def __init__(self, unit: str, collective: str, detail: str) -> None:
        super().__init__(f"{collective} of unit {unit!r} failed: {detail}; {REJOIN_HINT}")
        self.unit, self.collective, self.detail = unit, collective, detail

    def __reduce__(self) -> tuple[type[CollectiveError], tuple[str, str, str]]:
        # Pickled with its own arguments (launchers send errors between processes).
        return type(self), (self.unit, self.collective, self.detail)


def broken_by(groups: Iterable[dist.ProcessGroup | None]) -> str | None:
    """The first failure that broke one of ``groups``, or None if none is broken."""
    for group in groups:
        if group is not None and group in BROKEN:
            return BROKEN[group]
    return None


def check_usable(groups: Iterable[dist.ProcessGroup | None], unit: str, collective: str) -> None:
    """Refuse a collective on a group an earlier failure broke (it would only time out)."""
    earlier = broken_by(groups)
    if earlier is not None:
        raise CollectiveError(unit, collective, f"not run, its process group failed earlier ({earlier})")


def _rank_in(group: dist.ProcessGroup) -> str:
    try:
        return f"rank {group.rank()} of its {group.size()}-rank process group"
    except RuntimeError:  # a destroyed group
        return "a rank"


def _translate(group: dist.ProcessGroup, unit: str, collective: str, err: BaseException | None) -> None:
    """Raise the :class:`CollectiveError` a backend's ``RuntimeError`` (gloo's and NCCL's:
    DistBackendError, DistNetworkError, ...) over ``group`` stands for, marking the group
    broken; anything else is left to propagate."""
    if isinstance(err, RuntimeError) and not isinstance(err, CollectiveError):
        BROKEN.setdefault(group, f"{collective} of unit {unit!r}")
        detail = f"{_rank_in(group)} saw {type(err).__name__}: {err}"
        raise CollectiveError(unit, collective, detail) from err


@contextlib.contextmanager
def collective_faults(group: dist.ProcessGroup, unit: str, collective: str) -> Iterator[None]:
    """Turn the backend's error inside the block (issuing or waiting on a collective over
    ``group``) into a :class:`CollectiveError` naming ``unit`` and ``collective``, and mark
    ``group`` broken."""
    try:
        yield
    except RuntimeError as err:
        _translate(group, unit, collective, err)
        raise


@dataclass(frozen=True)
class CollectiveSite:
    """One collective of a unit: its process ``group``, the ``unit``'s name and what the
    collective is (``collective``), for its error."""

    group: dist.ProcessGroup
    unit: str
    collective: str

    @property
    def broken(self) -> bool:
        """Whether an earlier failure broke its group."""
        return broken_by([self.group]) is not None

    def check_usable(self) -> None:
        check_usable([self.group], self.unit, self.collective)

    def translate(self, err: BaseException) -> None:
        """Raise the :class:`CollectiveError` that ``err`` (caught issuing or waiting on this
        collective) stands for, marking the group broken; return if it is not a backend's."""
        _translate(self.group, self.unit, self.collective, err)

    def faults(self) -> CollectiveSite:
        """:func:`collective_faults` for this site: the site itself is the context (two calls,
        not a generator's six: every collective of every unit enters one)."""
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> Literal[False]:
        _translate(self.group, self.unit, self.collective, err)
        return False
