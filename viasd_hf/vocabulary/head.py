"""Only the chosen rows of the LM head: the model's body, then ``hidden · W[ids]ᵀ``, spread over a row of −inf.

With a 151,936-token vocabulary the LM head is a large share of a small model's pass (the
0.5B drafter's untied head is 151,936 × 896). ``SubsetHead`` runs the decoder body as the
model's own ``forward`` would, then multiplies by the vocabulary's rows of the head weight only
(tied or untied alike; Gemma's final logit soft-capping applied as the model applies it) and
writes the result into a full-width row of −inf. Everything downstream (logits processors,
softmax, rejection sampling) keeps working on full rows and sees zero mass outside the
vocabulary. The sliced weight is made once per head weight and vocabulary and kept while the
model lives (it costs ``V / vocab_size`` of the head's memory).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import nn

from viasd_hf.masks.architectures import base_model, is_encoder_decoder, model_config
from viasd_hf.vocabulary.store import DraftVocabularyError

_slices: WeakKeyDictionary[nn.Module, dict[tuple, tuple[torch.Tensor, torch.Tensor | None]]] = WeakKeyDictionary()
_lock = threading.Lock()


class SubsetHead:
    """A model's logits restricted to ``token_ids``: computed for those rows of the LM head, −inf elsewhere."""

    def __init__(self, model: nn.Module, token_ids: Sequence[int]) -> None:
        if is_encoder_decoder(model):
            raise DraftVocabularyError(
                "a draft vocabulary is not supported for encoder-decoder models yet; pass ViaSDConfig(vocabulary=None)"
            )
        head = base_model(model).get_output_embeddings()
        if type(head) is not nn.Linear or not head.weight.is_floating_point():
            raise DraftVocabularyError(
                f"cannot slice the LM head of {getattr(model_config(model), '_name_or_path', '?')}: it is a "
                f"{type(head).__name__}, not a plain floating-point nn.Linear (quantised or adapted heads are not "
                "supported); pass ViaSDConfig(vocabulary=None)"
            )
        self.head = head
        self.rows = head.weight.shape[0]
        self.ids = torch.tensor(sorted(token_ids), dtype=torch.long, device=head.weight.device)
        self.key = hashlib.sha256(self.ids.cpu().numpy().tobytes()).hexdigest()
        self.softcap = getattr(model_config(model), "final_logit_softcapping", None)

    def weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The vocabulary's rows of the head weight (and bias), sliced once and cached for this weight."""
        weight, bias = self.head.weight, self.head.bias
        key = (self.key, weight.data_ptr(), weight._version, weight.dtype, weight.device)
        with _lock:
            cached = _slices.get(self.head, {}).get(key)
        if cached is None:
            ids = self.ids.to(weight.device)
            cached = (weight.detach()[ids].contiguous(), None if bias is None else bias.detach()[ids].contiguous())
            with _lock:
                _slices[self.head] = {key: cached}  # a changed weight (or another vocabulary) replaces the old slice
        return cached

    def logits(self, model: nn.Module, tokens: torch.Tensor, cache: Any, keep: int, **inputs: Any) -> torch.Tensor:
        """Logits of the last ``keep`` of ``tokens`` (one sequence), one full-width row per token, −inf outside the
        vocabulary."""
        return self.spread(self.hidden(model, tokens, cache, **inputs)[0, -keep:])

    @staticmethod
    def hidden(model: nn.Module, tokens: torch.Tensor, cache: Any, **inputs: Any) -> torch.Tensor:
        """The decoder body's last hidden states ``[rows, columns, hidden size]`` for ``tokens`` fed after ``cache``:
        the model's pass without its LM head."""
        return base_model(model).get_decoder()(input_ids=tokens, cache=cache, use_cache=True, **inputs).last_hidden_state

    def spread(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head on ``hidden`` (positions × hidden size) for the vocabulary's rows, in full-width rows."""
        weight, bias = self.weight()
        chosen = F.linear(hidden.to(weight.dtype), weight, bias)
        if self.softcap is not None:
            chosen = torch.tanh(chosen / self.softcap) * self.softcap
        logits = chosen.new_full((chosen.shape[0], self.rows), float("-inf"))
        logits[:, self.ids.to(logits.device)] = chosen
        return logits
