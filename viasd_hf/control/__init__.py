"""Online decisions while decoding: the tier controller and its cost ledgers, draft lengths, the mask chooser, the speculation switch, per-model memory."""
