"""pass@k, the unbiased estimator of Chen et al. (2021): the chance that at least one of k completions drawn
without replacement from n sampled ones (c of them correct) is correct, ``1 - C(n-c, k) / C(n, k)``."""

from __future__ import annotations

from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k of one prompt with ``n`` completions of which ``c`` are correct; needs ``1 <= k <= n``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every draw of k holds a correct one
    return 1.0 - comb(n - c, k) / comb(n, k)


def reported_ks(samples_per_prompt: int) -> list[int]:
    """The k reported by an evaluation: 1, and the number of samples when there are more."""
    return [1] if samples_per_prompt <= 1 else [1, samples_per_prompt]
