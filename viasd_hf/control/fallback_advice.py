"""The words for a fallback: why VIA-SD decodes plainly on this machine, and what the user could change.

The speculation switch (``speculation_switch``) decides; this module only words its verdict for the user, naming
emulated bf16 where the measured cost of verifying points there (docs/results.md, "AVX2-only hardware").
"""

from __future__ import annotations

# a 6-token pass costing this many one-token passes or more is what emulated bf16 does (docs/results.md, "AVX2-only
# hardware"); a native kernel verifies 6 tokens for about the price of one
EMULATED_VERIFY_RATIO = 2.0


def fallback_advice(verify_ratio: float | None, emulated_bf16: bool) -> str:
    """What to tell a user whose decoding fell back to plain: the measured cost of verifying, and what to change.

    ``verify_ratio``: what a pass over 6 new tokens costs relative to a one-token pass, as measured. Emulated
    bf16 (``emulated_bf16``: a bf16 model on a CPU without native bf16) is blamed only where verifying was measured
    to cost several one-token passes (or was not measured)."""
    measured = f"; a pass over 6 new tokens costs {verify_ratio:.1f}x a one-token pass here" if verify_ratio else ""
    advice = "a cheaper or better-matched drafter may let speculation pay"
    costly_verify = verify_ratio is None or verify_ratio >= EMULATED_VERIFY_RATIO
    if emulated_bf16 and costly_verify:
        advice = ("this CPU has no native bf16, so bf16 matrix products are emulated and verifying k tokens costs about "
                  "k one-token passes: a float32 target verifies several tokens for little more than one, but its "
                  "one-token passes are slower (`viasd profile --target NAME --precision` shows both here); plain bf16 "
                  "decoding may be the fastest this machine allows")  # fmt: skip
    return f"speculation does not pay for this model on this machine, so VIA-SD decodes plainly{measured}: {advice}"

