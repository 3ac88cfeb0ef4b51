"""The error a failed collective raises: it names the unit and the collective, and survives
pickling (launchers and process pools send errors between processes)."""

import pickle

import vescale_plugins


def test_collective_error_names_unit_and_collective_and_pickles():
    error = vescale_plugins.CollectiveError("layers.3", "all-gather in backward", "rank 1 saw RuntimeError: gone")
    assert isinstance(error, RuntimeError)
    assert str(error).startswith("all-gather in backward of unit 'layers.3' failed: rank 1 saw RuntimeError: gone;")
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.unit, copy.collective) == (
        type(error),
        str(error),
        "layers.3",
        "all-gather in backward",
    )
