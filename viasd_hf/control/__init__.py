"""Online decisions while decoding: the tier controller and its cost ledgers, draft lengths, the speculation switch, per-model memory."""
