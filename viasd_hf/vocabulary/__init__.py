"""Frequency-ranked draft vocabularies: the drafter and the slim verifier compute only the LM-head rows of
the tokens a target mostly writes (``store``: the vocabulary and its Hub folder; ``head``: the sliced LM head;
``build``: counting, coverage and cost, ``viasd vocab``; ``lookup``: which vocabulary a ``generate`` call uses)."""

from viasd_hf.vocabulary.store import DraftVocabulary, DraftVocabularyError

__all__ = ["DraftVocabulary", "DraftVocabularyError"]
