"""pass@1 and its standard error over problems (reference: `summary_results.py`, `plots/calculate_se.py`).

With R samples of problem i graded c_ij in {0, 1}, a_i = mean_j c_ij is the problem's accuracy and

    pass@1 = mean_i a_i,        SE = std(a, ddof=1) / sqrt(n)   over the n problems.

With the same R for every problem this equals the reference's mean over runs of per-run accuracy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def pass_at_1(correct_by_problem: Mapping[str, Sequence[bool]]) -> tuple[float, float]:
    """(pass@1, standard error) from each problem's list of per-sample correctness.

    The SE is NaN for a single problem (no spread to estimate). Raises ValueError on an empty mapping or a
    problem with no samples.
    """
    if not correct_by_problem:
        raise ValueError("correct_by_problem is empty; pass at least one problem with graded samples")
    acc = []
    for pid, samples in correct_by_problem.items():
        if len(samples) == 0:
            raise ValueError(f"correct_by_problem[{pid!r}] has no samples")
        acc.append(sum(bool(c) for c in samples) / len(samples))
    n = len(acc)
    mean = sum(acc) / n
    if n == 1:
        return mean, math.nan
    var = sum((a - mean) ** 2 for a in acc) / (n - 1)
    return mean, math.sqrt(var / n)
