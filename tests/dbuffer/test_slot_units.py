"""A DBuffer slot's per-rank units, computed from the tensor's interval alone, are the
planner's per-rank units (``Layout.local_units``, one entry per rank)."""

import random

from vescale_plugins.dbuffer.buffer import slot_units
from vescale_plugins.planner import plan_layout


def test_slot_units_are_the_planners_local_units():
    rng = random.Random(0)
    for _ in range(60):
        world = rng.choice([1, 2, 3, 4, 7, 16])
        rows = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
        row = [rng.choice([1, 3, 8]) for _ in rows]
        block_rows = [rng.choice([1, 2, 5]) for _ in rows]
        numels = [r * c for r, c in zip(rows, row)]
        blocks = [min(b, r) * c for b, r, c in zip(block_rows, rows, row)]
        layout = plan_layout(numels, blocks, world)
        for index in range(len(numels)):
            assert slot_units(layout, index, blocks[index]) == layout.local_units(index), (numels, blocks, world)
