"""What a run did: the run record, the one-line sharding summary, and the allocation tracker
that counts live tensor bytes from the allocator's own events."""
