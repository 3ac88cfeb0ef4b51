"""The side-by-side benchmarks against FSDP2: ``python -m vescale_plugins.bench`` (``make bench``)
and its subcommands (``step``, ``collectives``, ``adam8bit``, ``muon``, ``init-memory``)."""
