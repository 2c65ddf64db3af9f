"""Decoding: the device's four verbs (prefill, insert, decode, free over a KV cache), sampling, requests and their
checks, the prefix cache, and the engine that schedules requests over slots. Built on `gpt.model`."""
