"""The speedup and its interval are ratios of the medians that the tables print beside them."""

import statistics

from inductor_attn.tuning.stats import paired_bootstrap_speedup


def test_an_even_count_of_samples_takes_the_midpoint_median_as_the_tables_do():
    # torch.median's lower middle sample gave 1.00x beside times whose medians are 2.0 and 1.0
    baseline, candidate = [1.0, 1.0, 3.0, 3.0] * 5, [1.0] * 20
    point, low, high = paired_bootstrap_speedup(baseline, candidate)
    assert point == statistics.median(baseline) / statistics.median(candidate) == 2.0
    assert low <= point <= high
