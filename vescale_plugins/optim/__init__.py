"""Structure-aware optimizers for sharded parameters.

* :class:`Muon`: torch.optim.Muon's math on RaggedShard matrices, each orthogonalised once on a
  load-balanced root rank; :func:`muon_param_groups` sends the parameters Muon is not for to AdamW.
* :func:`tile_rows`: the ``block_size_fn`` that keeps 32x32 tiles whole on one rank.
* :class:`AdamW8bit` / :class:`Adam8bit`: block-wise 8-bit moments on whole tiles.
* :class:`AdamW`: fp32 AdamW stepped once per contiguous run of parameters (fused).
* :func:`clip_grad_norm_`: ``torch.nn.utils.clip_grad_norm_`` on flat gradient runs.
"""

from vescale_plugins.optim.adam8bit import Adam8bit, AdamW8bit
from vescale_plugins.optim.adamw import AdamW
from vescale_plugins.optim.clip import clip_grad_norm_
from vescale_plugins.optim.muon import Muon
from vescale_plugins.optim.param_split import muon_param_groups, split_muon_params
from vescale_plugins.optim.root_assignment import assign_roots, newton_schulz_flops
from vescale_plugins.optim.tiles import TILE, tile_rows

__all__ = [
    "TILE",
    "Adam8bit",
    "AdamW",
    "AdamW8bit",
    "Muon",
    "assign_roots",
    "clip_grad_norm_",
    "muon_param_groups",
    "newton_schulz_flops",
    "split_muon_params",
    "tile_rows",
]
