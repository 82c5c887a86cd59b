"""Batched VIA-SD: lossless greedy decoding of a batch of left-padded prompts at once.

- ``ragged_cache``: one rectangular KV cache per model, each row ragged inside it (the scheme, and why).
"""
