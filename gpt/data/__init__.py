"""Text to token shards and batches: reading corpora of any format, preparing them in flat memory, loading
batches and prefetching them. Imports nothing from the rest of the package but its base modules."""
