"""Batched VIA-SD: a batch of left-padded prompts decoded at once, lossless or tiered, greedily or sampling
(docs/design.md, "Batches").

- ``loop``: the decode loop, one short step per decision of the paper's algorithm;
- ``ragged_cache``: one rectangular KV cache per model, each row ragged inside it (the scheme, and why);
- ``position_masks``: attention masks by token position, for models with sliding-window layers;
- ``acceptance``: each row verified on its own by the single-sequence rules;
- ``drafting``: the assistant model, prompt lookup, the two together and the self-drafter, for every row at once;
- ``translating``: an assistant model of another tokenizer, its drafts translated to the target's tokens;
- ``rows``: each prompt's committed sequence, its stopping criteria and the padded output;
- ``stats``: totals and one ``ViaSDStats`` per row;
- ``preconditions``: what a batch may ask for, and the reason and fix for the rest.
"""

from viasd_hf.engine.batch.drafting import batch_drafter
from viasd_hf.engine.batch.loop import BatchedDecoder
from viasd_hf.engine.batch.preconditions import check_batch_supported
from viasd_hf.engine.batch.ragged_cache import RaggedCache
from viasd_hf.engine.batch.stats import BatchViaSDStats

__all__ = ["BatchViaSDStats", "BatchedDecoder", "RaggedCache", "batch_drafter", "check_batch_supported"]
