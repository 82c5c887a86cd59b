"""The decode loop and what it is made of: block policies, acceptance, the verifier, state and KV cache, sampling, stats."""
