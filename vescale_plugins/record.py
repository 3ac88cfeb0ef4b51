"""The run record (public name): ``with record_run(model, optimizer) as record: ...``.

Implemented in :mod:`vescale_plugins.observe.record`.
"""

from vescale_plugins.observe.record import CollectiveEvent, RunRecord, record_run

__all__ = ["RunRecord", "record_run", "CollectiveEvent"]
