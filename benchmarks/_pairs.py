"""Two variants timed side by side: alternated in pairs, compared by pair ratios.

On a busy CPU host the load drifts over minutes; running the two variants back
to back, the first one first in one pair and second in the next, lets the
drift hit both alike, and the ratio within each pair shares its noise.
"""

import statistics
from collections.abc import Iterator, Sequence

__all__ = ["alternating", "median_pair_ratio"]


def alternating(variants: Sequence, pairs: int) -> Iterator[Sequence]:
    """``variants`` once per pair, in reverse order every other pair."""
    for pair in range(pairs):
        yield variants if pair % 2 == 0 else variants[::-1]


def median_pair_ratio(
    numerators: Sequence[float], denominators: Sequence[float]
) -> tuple[float, list[float]]:
    """Median and [first, third] quartiles of the pairs' ratios."""
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), [quartiles[0], quartiles[2]]
