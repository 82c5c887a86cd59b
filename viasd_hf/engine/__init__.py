"""Verification and the decode loop: block policies, decisions, acceptance, sampling, stats, the KV cache, attention;
``batch``, the one decode loop for every batch size."""
