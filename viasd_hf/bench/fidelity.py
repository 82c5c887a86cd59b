"""How often a method's tokens are the full model's own greedy choice after the method's own prefix.

Agreement with greedy's output, position by position, says little in bf16: the first near-tie
that flips with a pass's shape shifts everything after it, so even lossless methods score well below 1
there (docs/results.md, "Tiered mode"). Here each generated token is judged on its own, teacher-forced: one
pass of the full model over the prompt and the method's output gives its greedy choice at every position. A lossless
method scores 1.0 up to rounding (greedy's own score is that noise floor); a lossy tier (the slim
verifier, a cascade) scores below it by the share of tokens the full model would not have chosen.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm


@torch.no_grad()
def full_model_choices(model: Any, prompt: torch.Tensor, tokens: list[int]) -> int:
    """How many of ``tokens`` (generated after ``prompt``, shape (1, P)) are the full model's greedy choice there."""
    if not tokens:
        return 0
    generated = prompt.new_tensor([tokens])
    sequence = torch.cat([prompt, generated[:, :-1]], dim=-1).to(model.device)
    logits = model(sequence, logits_to_keep=len(tokens)).logits[0]
    return int((logits.argmax(-1).cpu() == generated[0].cpu()).sum())


def full_model_agreement(model: Any, prompts: list[torch.Tensor], outputs: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    """Per method, per prompt: how many generated tokens the full model would have chosen (one pass per distinct output)."""
    if model.config.is_encoder_decoder:
        raise ValueError("full-model agreement is measured for decoder-only targets only")
    judged: dict[tuple[int, tuple[int, ...]], int] = {}
    distinct = {(index, tuple(tokens)) for runs in outputs.values() for index, tokens in enumerate(runs)}
    for index, tokens in tqdm(sorted(distinct), desc="full-model agreement", unit="output"):
        judged[index, tokens] = full_model_choices(model, prompts[index], list(tokens))
    return {name: [judged[index, tuple(tokens)] for index, tokens in enumerate(runs)] for name, runs in outputs.items()}
