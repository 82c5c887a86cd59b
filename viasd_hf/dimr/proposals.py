"""Where DIMR's next candidate mask comes from: Bayesian optimisation or random search."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence

from viasd_hf.extras import require

_FEATURE = "DIMR's Bayesian optimisation (viasd search)"


class Proposals:
    """Where the next candidate mask comes from: Bayesian optimisation or random search.

    BO runs over one score in [0, 1] per skippable layer; a point becomes a mask by skipping the
    k highest-scoring layers. Random search proposes uniform k-subsets at first and later mostly
    swaps one or two layers of the incumbent (the paper does not say which random search it
    uses; swaps spend a small evaluation budget better). Randomly proposed masks are told to
    the GP as their 0/1 indicator, a point that maps back to the same mask. The GP's linear
    algebra is tiny, so it runs single-threaded: extra BLAS threads only fight torch's.
    """

    BO_RETRIES = 3
    UNIFORM_SHARE = 0.3

    def __init__(self, layers: Sequence[int], k: int, seed: int, initial_points: int = 6):
        self.layers = list(layers)
        self.k = k
        self.total = math.comb(len(self.layers), k)
        self.rng = random.Random(seed)
        skopt = require("skopt", "search", _FEATURE)
        self._threadpool_limits = require("threadpoolctl", "search", _FEATURE).threadpool_limits
        self.optimizer = skopt.Optimizer(
            [skopt.space.Real(0.0, 1.0) for _ in self.layers],
            base_estimator="GP",
            n_initial_points=initial_points,
            acq_optimizer="sampling",
            acq_optimizer_kwargs={"n_points": 2000},
            random_state=seed,
        )

    def mask_of(self, scores: Sequence[float]) -> tuple[int, ...]:
        order = sorted(range(len(self.layers)), key=lambda i: (-scores[i], i))
        return tuple(sorted(self.layers[i] for i in order[: self.k]))

    def indicator(self, skip: tuple[int, ...]) -> list[float]:
        return [1.0 if layer in skip else 0.0 for layer in self.layers]

    def bayesian(self, seen: Mapping[tuple[int, ...], float]) -> tuple[tuple[int, ...], list[float]] | None:
        """A new mask from the GP, or ``None`` if it keeps proposing masks already evaluated."""
        for _ in range(self.BO_RETRIES):
            point = [float(v) for v in self.optimizer.ask()]
            skip = self.mask_of(point)
            if skip not in seen:
                return skip, point
            with self._threadpool_limits(1):
                self.optimizer.tell(point, seen[skip])  # teach it the known value; ask again
        return None

    def random(
        self, seen: Mapping[tuple[int, ...], float], incumbent: tuple[int, ...] | None
    ) -> tuple[tuple[int, ...], list[float]]:
        if incumbent is not None and self.rng.random() >= self.UNIFORM_SHARE:
            for _ in range(20):
                skip = self._swap(incumbent, self.rng.choice((1, 1, 2)))
                if skip not in seen:
                    return skip, self.indicator(skip)
        skip = self._uniform(seen)
        return skip, self.indicator(skip)

    def observe(self, point: list[float], value: float, fit: bool) -> None:
        """Record an evaluation; ``fit`` refits the GP (only needed before a BO proposal)."""
        with self._threadpool_limits(1):
            self.optimizer.tell(point, value, fit=fit)

    def _swap(self, incumbent: tuple[int, ...], count: int) -> tuple[int, ...]:
        kept = [layer for layer in self.layers if layer not in incumbent]
        count = min(count, len(kept), self.k)
        out = set(self.rng.sample(list(incumbent), count))
        new = set(self.rng.sample(kept, count))
        return tuple(sorted((set(incumbent) - out) | new))

    def _uniform(self, seen: Mapping[tuple[int, ...], float]) -> tuple[int, ...]:
        if self.total <= 5000:  # small space: draw among the unseen masks exactly
            unseen = [skip for skip in itertools.combinations(self.layers, self.k) if skip not in seen]
            return self.rng.choice(unseen)
        while True:
            skip = tuple(sorted(self.rng.sample(self.layers, self.k)))
            if skip not in seen:
                return skip
