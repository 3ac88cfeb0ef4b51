"""The side-by-side benchmark against FSDP2: ``python -m vescale_plugins.bench`` (``make bench``)."""
