"""The tests' models: the uneven decoder with its batches and reference step (from
``vescale_plugins.tools.parity_model``, which the GPU check shares), and two linear blocks under
a head."""

import torch
import torch.nn as nn

from vescale_plugins.tools.parity_model import (  # noqa: F401  (re-exported for the tests)
    HEADS,
    HIDDEN,
    LAYERS,
    MLP,
    SEQ,
    VOCAB,
    Attention,
    Block,
    Decoder,
    batch,
    clone,
    local_batch,
    loss_fn,
    make_decoder,
    reference_step,
)

PER_RANK = 2  # sequences per rank and step (parity_model's default)


class TwoBlocks(nn.Module):
    """Two 6-wide linear blocks (a ``ModuleList``) and a head: 3 units when each block is one."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)
