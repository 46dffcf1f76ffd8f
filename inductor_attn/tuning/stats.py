"""Statistics for deciding on timings: paired bootstrap CI of a speedup.

Samples are paired by round: the tuner times every candidate once per round, so sample i of the
default and sample i of a candidate were taken close in time and share clock/thermal drift. Seed 000's
lesson: decide on the CI, not on a point estimate.
"""

from __future__ import annotations

import statistics

import torch

BOOTSTRAP_RESAMPLES = 2000
CONFIDENCE = 0.95


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def paired_bootstrap_speedup(baseline: list[float], candidate: list[float], *, seed: int = 0,
                             resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float, float]:
    """Speedup of ``candidate`` over ``baseline`` (ratio of median times) with a 95% bootstrap CI.

    Rounds are resampled with replacement, keeping each pair together. The generator is seeded so two
    tunes over the same timings report the same interval.

    >>> s, lo, hi = paired_bootstrap_speedup([2.0, 2.1, 1.9, 2.0] * 5, [1.0, 1.05, 0.95, 1.0] * 5)
    >>> round(s, 2), lo > 1.5
    (2.0, True)
    """
    n = min(len(baseline), len(candidate))
    if n == 0:
        raise ValueError("paired_bootstrap_speedup needs at least one paired sample")
    # medians as ``median`` takes them (the midpoint of an even count, as the tables' times are): torch.median
    # takes the lower middle sample, which put a ratio beside two times it was not the ratio of
    point = median(baseline[:n]) / median(candidate[:n])
    base = torch.tensor(baseline[:n], dtype=torch.float64)
    cand = torch.tensor(candidate[:n], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (resamples, n), generator=gen)
    ratios = base[idx].quantile(0.5, dim=1) / cand[idx].quantile(0.5, dim=1)
    alpha = (1 - CONFIDENCE) / 2
    lo, hi = torch.quantile(ratios, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    return point, lo, hi
