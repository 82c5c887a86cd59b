"""Drafters beside the decode loop's own (``engine.batch.drafting`` drafts with an assistant model, prompt lookup,
both, or the target routed with a heavier mask, for every row at once):

- ``precision``: the unquantised or quantised form an assistant model drafts fastest in on this machine;
- ``translation``: how a drafter of another tokenizer reads the target's text and hands its drafts over in the
  target's tokens;
- ``translating``: that drafter for every row of a batch.
"""
