"""``DrafterRead``: a call's drafter reading what it has not read before its first draft, priced for the speculation
switch (``speculation_switch``, whose docstring says when a read pays)."""

from __future__ import annotations

from dataclasses import dataclass

from viasd_hf.control.speculation_switch import SpeculationSwitch


@dataclass
class DrafterRead:
    """A call's drafter reading what it has not read before its first draft, priced for the switch.

    The read is priced against the target's prefill (seconds per token the target reads): this call's once the target
    has read the prompt, else the faded mean of earlier calls' (where the first block carries the prompts, the drafter reads
    before the target's first pass). ``pays`` says whether a read of ``tokens`` is worth it with ``left`` tokens to decode
    (``SpeculationSwitch.reading_pays``) and, the first time it is not, why (``verdict``). Without a switch (timings
    may not steer) every read pays."""

    switch: SpeculationSwitch | None
    done: bool = False  # whether the drafter has read
    prefill_per_token: float | None = None  # the target's seconds per token read, in this call
    unpriced: tuple[float, int] | None = None  # a read (seconds, tokens) made before the target's prefill was timed
    verdict: str | None = None  # why the drafter has not read: its read would not pay

    def __post_init__(self) -> None:
        if self.switch is not None:
            self.switch.drafter_has_read = self.done

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        """The target's prefill in this call: ``seconds`` for ``tokens`` (columns of a batched pass)."""
        if self.switch is None or seconds <= 0 or tokens <= 0:
            return
        self.prefill_per_token = seconds / tokens
        self.switch.observe_prefill(self.prefill_per_token)
        self._price()

    def observe_read(self, seconds: float, tokens: int) -> None:
        """The drafter read ``tokens`` in ``seconds``."""
        self.done, self.verdict = True, None
        if self.switch is None:
            return
        self.switch.drafter_has_read = True
        if tokens > 0:
            self.unpriced = (seconds, tokens)
            self._price()

    def pays(self, tokens: int, left: int) -> bool:
        """Whether reading ``tokens`` before drafting is expected to be earned back over the ``left`` tokens the call
        may still decode; the first time it is not, ``verdict`` says why."""
        if self.switch is None:
            return True
        prefill = self.prefill_per_token or self.switch.prefill.mean()
        read = self.switch.reading_cost(prefill, tokens) if prefill else None
        if self.switch.reading_pays(read, left):
            return True
        if self.verdict is None:
            tail = self.switch.tail_cost()
            apart = f" and rows finishing apart would lose about {tail:.1f} s more" if tail >= 0.05 else ""
            self.verdict = (f"plain decoding: the drafter would first read {tokens} tokens (about {read:.1f} s){apart}, "
                            f"more than speculating can save over the {left} tokens left ({self.switch.describe()})")
        return False

    def _price(self) -> None:
        if self.unpriced is not None and self.prefill_per_token:
            seconds, tokens = self.unpriced
            self.switch.observe_reading(seconds / tokens, self.prefill_per_token)
            self.unpriced = None
