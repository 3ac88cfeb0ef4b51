"""Structure-aware optimizers for sharded parameters.

``Muon``: torch.optim.Muon's math on RaggedShard matrices, each orthogonalised once on a
load-balanced root rank; ``muon_param_groups`` sends the parameters Muon is not for to AdamW.
"""

from .muon import Muon
from .param_split import muon_param_groups, split_muon_params
from .root_assignment import assign_roots, newton_schulz_flops

__all__ = ["Muon", "muon_param_groups", "split_muon_params", "assign_roots", "newton_schulz_flops"]
