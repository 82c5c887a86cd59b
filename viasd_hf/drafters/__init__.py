"""Drafters: whatever proposes the next few tokens, behind one small protocol.

A drafter sees only the committed token ids; what it keeps between blocks is its own business.

- ``AssistantDrafter``: a smaller model sharing the target's tokenizer, with its own KV cache
  cropped back to the committed prefix after each block.
- ``SelfDrafter``: the target routed with a heavier mask. It drafts on the target's own cache
  (``TargetCache.provisional``), so it costs no memory or extra weights and leaves nothing behind.
- ``PromptLookupDrafter``: copies the continuation of the last n-gram's earlier occurrence.
- ``HybridDrafter``: prompt lookup where the context repeats itself (its drafts are free) and
  copying has paid (``hybrid_choice``), a model drafter elsewhere.
- ``translation``: how a drafter of another tokenizer reads the target's text and hands its drafts over in the
  target's tokens (the batched engine's ``TranslatingDrafter`` drafts with it).
"""

from viasd_hf.drafters.lookup import HybridDrafter, PromptLookupDrafter, model_drafter_of
from viasd_hf.drafters.model import ATTENTION_SINK_TOKENS, AssistantDrafter, SelfDrafter, drafted_token, kept_prefix
from viasd_hf.drafters.protocol import Drafter, KeepDrafting, through_first_end

__all__ = [
    "ATTENTION_SINK_TOKENS",
    "AssistantDrafter",
    "Drafter",
    "HybridDrafter",
    "KeepDrafting",
    "PromptLookupDrafter",
    "SelfDrafter",
    "drafted_token",
    "kept_prefix",
    "model_drafter_of",
    "through_first_end",
]
