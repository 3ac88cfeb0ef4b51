"""Which unit to gather next, in forward and in backward, and when."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn

if TYPE_CHECKING:
    from vescale_plugins.runtime.fsdp_unit import FSDPUnit

__all__ = ["UnitPrefetch"]


class UnitPrefetch:
    """Mixin of ``FSDPUnit``: forward and backward prefetch (one unit ahead)."""

    def _forward_prefetch_targets(self: "FSDPUnit") -> list["FSDPUnit"]:
        """The units set by ``set_modules_to_forward_prefetch``, else the unit that ran next
        in the previous training forward.

        On CUDA, FSDP2 overlaps the next all-gather with compute implicitly (the CPU runs
        ahead of the GPU and issues it early); a CPU backend has no run-ahead, so the next
        unit is gathered explicitly. It costs one more unit's parameters during forward.
        """
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        order = self.root._previous_forward_order
        if self not in order:
            return []
        position = order.index(self) + 1
        return [order[position]] if position < len(order) and order[position] is not self else []

    def _prefetch_for_backward(self: "FSDPUnit") -> None:
        """Start gathering the unit(s) whose backward comes next.

        A unit with gradients does this at its first gradient rather than at its pre-backward
        (where FSDP2 does): the backward ops before that gradient have then released the
        activation gradients they consumed (for an output head, the logits' gradient, often the
        largest tensor of the step), so the prefetched parameters do not add to that moment.
        """
        if self._iteration.backward_prefetched:
            return
        self._iteration.backward_prefetched = True
        for unit in self._backward_prefetch_targets():
            unit.unshard(async_op=True)

    def _backward_prefetch_targets(self: "FSDPUnit") -> list["FSDPUnit"]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.root._forward_order
        if self not in order:
            return []
        position = order.index(self)
        for earlier in reversed(order[:position]):
            if earlier is not self and not earlier._iteration.pre_backward_done:
                return [earlier]
        return []

    def _after_gradient(self: "FSDPUnit", param: nn.Parameter) -> None:
        """At the unit's first gradient: finish the previous unit's reduce-scatter, then start
        gathering the unit whose backward comes next.

        The reduce-scatter has overlapped this unit's backward up to here; finishing it frees
        its gradient buffer before the prefetch allocates, so the two are never alive at once.
        """
        if not self._iteration.backward_prefetched:
            self.root.wait_for_reduces()
        self._prefetch_for_backward()
