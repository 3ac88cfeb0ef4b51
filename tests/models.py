"""The tests' decoder, its batches and the reference step: ``vescale_plugins.tools.parity_model``."""

from vescale_plugins.tools.parity_model import (  # noqa: F401
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
