"""The decode loop for every batch size (a single prompt is a batch of one): left-padded prompts decoded at once,
lossless or tiered, greedily or sampling (docs/design.md, "Batches").

- ``loop``: the decode loop, one short step per decision of the paper's algorithm;
- ``learning``: what each block teaches the planner, the speculation switch, the tier controller and hybrid drafting,
  fed in one place;
- ``ragged_cache``: one rectangular KV cache per model, each row ragged inside it (the scheme, and why);
- ``position_masks``: attention masks by token position, for models with sliding-window layers in a batch;
- ``acceptance``: the target's passes over every row, and each row verified on its own by ``engine.policies``;
- ``drafting``: the assistant model, prompt lookup, the two together and the self-drafter, for every row at once;
- ``model_drafts``, ``lookup``: the drafted token, the prefix a drafter's cache keeps, the window of a long prompt it
  reads; prompt lookup's copy;
- ``rows``: each prompt's committed sequence, its stopping criteria, its streamer and the padded output;
- ``stats``: totals and one ``ViaSDStats`` per row;
- ``preconditions``: what more than one prompt may ask for, and the reason and fix for the rest.
"""

from viasd_hf.engine.batch.loop import BatchedDecoder
from viasd_hf.engine.batch.preconditions import check_batch_supported
from viasd_hf.engine.batch.ragged_cache import RaggedCache
from viasd_hf.engine.batch.stats import BatchViaSDStats

__all__ = ["BatchViaSDStats", "BatchedDecoder", "RaggedCache", "check_batch_supported"]
