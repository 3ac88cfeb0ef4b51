"""Structure-aware optimizers over sharded parameters.

* :func:`tile_rows`: the ``block_size_fn`` that keeps 32x32 tiles whole on one rank.
* :class:`AdamW8bit` / :class:`Adam8bit`: block-wise 8-bit moments on whole tiles.
* :class:`AdamW`: fp32 AdamW stepped once per contiguous run of parameters (fused).
* :func:`clip_grad_norm_`: ``torch.nn.utils.clip_grad_norm_`` on flat gradient runs.
"""

from .adam8bit import Adam8bit, AdamW8bit
from .adamw import AdamW
from .clip import clip_grad_norm_
from .tiles import TILE, tile_rows

__all__ = ["TILE", "Adam8bit", "AdamW", "AdamW8bit", "clip_grad_norm_", "tile_rows"]
