"""The network: its config, layers, KV cache, loss, weight layouts and sharding rules, and GPT-2's
checkpoint format. Imports nothing from the rest of the package but its base modules."""
