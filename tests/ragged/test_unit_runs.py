"""RaggedShard's per-rank units kept as runs: the same sequence, equality, hash and pickling
as the tuple users write, at a cost that does not grow with the ranks."""

import pickle
import random

import pytest

from vescale_plugins.ragged import RaggedShard, ragged_layout
from vescale_plugins.ragged.units import UnitRuns

_SEQUENCES = [(3,), (0, 0, 5), (2, 2, 0, 1, 1, 1), (0, 4, 4, 4, 4, 1, 0, 0), (7, 0, 7)]


@pytest.mark.parametrize("units", _SEQUENCES)
def test_runs_are_the_sequence(units):
    runs = UnitRuns.of(units)
    assert tuple(runs) == units
    assert runs == units
    assert runs == list(units)
    assert len(runs) == len(units)
    assert [runs[i] for i in range(-len(units), len(units))] == [*units, *units]
    assert runs[1:] == units[1:]
    assert runs.total == sum(units)
    assert [runs.prefix(r) for r in range(len(units) + 1)] == [sum(units[:r]) for r in range(len(units) + 1)]
    assert pickle.loads(pickle.dumps(runs)) == runs
    assert repr(runs) == repr(units)
    with pytest.raises(IndexError):
        runs[len(units)]


def test_one_form_per_sequence():
    assert UnitRuns([(1, 2), (1, 3), (0, 0), (2, 1)]).runs == ((1, 5), (2, 1))
    assert UnitRuns([(1, 2), (2, 1)]) != UnitRuns([(1, 1), (2, 2)])
    assert hash(UnitRuns.of((0, 1, 1))) == hash(UnitRuns([(0, 1), (1, 2)]))


def test_placement_equality_hash_and_pickle_match_the_tuple_form():
    world = 1 << 20
    compact = RaggedShard((0,), UnitRuns([(0, 7), (3, 1), (8, world - 9), (1, 1)]))
    expanded = RaggedShard((0,), (0,) * 7 + (3,) + (8,) * (world - 9) + (1,))
    assert compact == expanded
    assert hash(compact) == hash(expanded)
    assert compact != RaggedShard((0,), UnitRuns([(0, 7), (3, 1), (8, world - 9), (2, 1)]))
    assert pickle.loads(pickle.dumps(compact)) == compact
    assert len(pickle.dumps(compact)) < 1000  # the runs travel, not a million counts
    old_form = pickle.dumps((RaggedShard, ((0,), (1, 2))))  # what a checkpoint held before runs
    rebuilt_cls, args = pickle.loads(old_form)
    assert rebuilt_cls(*args) == RaggedShard((0,), (1, 2))


def test_lazy_layout_matches_every_rank_of_the_explicit_one():
    rng = random.Random(0)
    for _ in range(50):
        units = tuple(rng.choice([0, 0, 1, 2, 3]) for _ in range(rng.randint(1, 9))) + (1,)
        shape = (sum(units) * rng.randint(1, 3), rng.randint(1, 4))
        layout = ragged_layout(shape, (0,), units)
        offset, explicit = 0, []
        unit_numel = shape[0] * shape[1] // sum(units)
        for u in units:
            explicit.append((offset, u * unit_numel, (u * unit_numel // shape[1], shape[1])))
            offset += u * unit_numel
        assert [(s.offset, s.length, s.local_shape) for s in layout.slices] == explicit
        assert [(s.offset, s.length, s.local_shape) for s in (layout.slices[r] for r in range(len(units)))] == explicit
        assert list(layout.slices[1:]) == list(layout.slices)[1:]


def test_a_layout_at_a_million_ranks_is_a_few_runs():
    world = 1 << 20
    layout = RaggedShard((0,), UnitRuns([(0, 5), (2, 1), (4, world - 7), (1, 1)])).layout((4 * (world - 7) + 3, 8))
    assert layout.slices[5].length == 16
    assert layout.slices[world - 1].offset == 8 * (2 + 4 * (world - 7))
    assert len(layout.local_units.runs) == 4
