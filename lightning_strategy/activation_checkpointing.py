"""``activation_checkpointing_policy``, as Lightning's ``FSDPStrategy`` takes it.

Lightning's FSDP strategies (Trainer and Fabric) accept ``activation_checkpointing_policy``: a set
of layer classes (or torch's ``ModuleWrapPolicy``, or an FSDP1-style predicate
``(module, recurse, nonwrapped_numel) -> bool``) whose modules are wrapped in torch's
``checkpoint_wrapper`` (non-reentrant), so their activations are recomputed in backward. Ours
takes the same values (plus class names, as our ``auto_wrap_policy`` does) and wraps the same way,
before sharding as FSDP2 users do (torchtitan: checkpoint, then ``fully_shard``): with the default
units (every block of every ``nn.ModuleList``) the wrapper is the unit; with
``auto_wrap_policy={Block}`` the unit is the block inside it. veScale-FSDP re-gathers a unit's
parameters for the recomputation in either case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from .options import module_classes

__all__ = ["ActivationCheckpointingPolicy", "LayerCheckpointing"]

ActivationCheckpointingPolicy = (
    Iterable[type[nn.Module] | str] | ModuleWrapPolicy | Callable[[nn.Module, bool, int], bool] | None
)


@dataclass(frozen=True)
class LayerCheckpointing:
    """Which modules to wrap for recomputation: layer ``classes`` (types or names), or torch's ``auto_wrap_policy``."""

    classes: tuple[type[nn.Module] | str, ...] = ()
    auto_wrap_policy: Any = None

    @classmethod
    def from_policy(cls, policy: ActivationCheckpointingPolicy) -> LayerCheckpointing | None:
        """Check ``policy`` (at strategy construction); ``None`` when nothing is to be checkpointed."""
        if policy is None:
            return None
        if isinstance(policy, ModuleWrapPolicy) or (callable(policy) and not isinstance(policy, type)):
            return cls(auto_wrap_policy=policy)
        if isinstance(policy, (type, str, Iterable)):
            return cls(classes=module_classes(policy, "activation_checkpointing_policy"))
        raise TypeError(
            "activation_checkpointing_policy must be None, a set of nn.Module classes or class names, a "
            f"ModuleWrapPolicy, or a predicate (module, recurse, nonwrapped_numel) -> bool; got {type(policy).__name__}"
        )

    def _selects(self, module: nn.Module) -> bool:
        return any(type(module).__name__ == c if isinstance(c, str) else isinstance(module, c) for c in self.classes)

    def apply(self, model: nn.Module) -> None:
        """Wrap the selected modules of ``model`` in ``checkpoint_wrapper``, in place; call before sharding.

        As Lightning's FSDP strategies: a model that already contains checkpoint wrappers is left
        as it is (with a warning). Classes that match no module raise, naming the classes the
        model has, rather than silently training without checkpointing.
        """
        if any(isinstance(m, CheckpointWrapper) for m in model.modules()):
            from lightning.fabric.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(
                "activation_checkpointing_policy is set, but the model already contains checkpointed layers "
                "(checkpoint_wrapper); the policy is ignored."
            )
            return
        if self.auto_wrap_policy is not None:
            apply_activation_checkpointing(
                model, checkpoint_wrapper_fn=checkpoint_wrapper, auto_wrap_policy=self.auto_wrap_policy
            )
            return
        if not any(self._selects(m) for m in model.modules()):
            wanted = sorted(c if isinstance(c, str) else c.__name__ for c in self.classes)
            present = sorted({type(m).__name__ for m in model.modules() if m is not model})
            raise ValueError(
                f"activation_checkpointing_policy names {wanted}, but {type(model).__name__} contains no module of "
                f"these classes (it contains: {present}); name the classes of the model's blocks"
            )
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=self._selects)
