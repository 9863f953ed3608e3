"""R-KV policies: VaSE's re-implementation (`rkv`, spec 3.2a) and the official score (`rkv_official`, 3.2b).

`rkv` (VaSE mode `attn_rkv`, the paper's "R-KV" column):

    z_j = lambda * s_j - (1 - lambda) * red_j,   kept = top-K(z)

with s the VaSE window score (W = all valid window queries, avg-pool 5, GQA mean) and red the closed-form
redundancy softmax over the candidates (no "retain last" rule).

`rkv_official` scores like Zefan-Cai/R-KV's `R1KV._compute_scores`: importance from the last `rkv_window`
(alpha) valid queries, GQA *max of logits* before the softmax, mean over those queries, max-pool `rkv_pool`
with -inf padding; redundancy with the threshold-`rkv_threshold` "retain last" rule
(`scores.rkv_official_redundancy`) over the candidates and the alpha window keys; z = lambda * I - (1 - lambda) * R;
kept = top-K(z), in score order as in R-KV.

Redundancy window. The original computes the redundancy over ALL cached keys, its alpha-key window included
(spec 3.2b: the mean over rows i, the "last similar" search and the softmax run over candidates + window, then the
window columns are sliced off), while its importance softmax runs over the candidates only. Here the alpha newest
buffer slots (`inputs.buffer_keys[:, :, -alpha:]`, the keys of the alpha window queries) join the candidates in
the redundancy exactly so: with B == alpha the kept set is the original's for the same cache.

What remains different when B > alpha: the original's window is only alpha tokens, so its framework would also
score the older B - alpha buffer tokens as candidates (they would enter the importance softmax, the max-pool,
the redundancy rows and columns, and could be evicted). The VaSE framework always keeps the newest B slots, so
those B - alpha tokens are not candidates here and are left out of every term (putting them in the redundancy
only would match neither framework). The scores of the candidates then equal the original's on the cache
"candidates + alpha newest keys".

Other differences from the original, inside this framework:
- Trigger: the original compresses every `divide_length` (128) tokens down to `budget` including its
  alpha-query window. Here the VaSE framework triggers every B steps and the alpha queries are the newest of the
  B-query ring.
- "Last similar" uses slot order (as the original does after its first compression); when no key is similar
  the original zeroes column 0, here the first valid candidate slot (the same slot when there is no padding).
- lambda is the option `rkv_lambda` (default 0.5, VaSE's setting). The original defaults are lambda = 0.1 (README
  and newer scripts; 0.07 in the class), alpha = 8, kernel 7, threshold 0.5.
- Scores in float32 (the original pools in the model dtype); the option `score_temperature` scales the logits as
  in the VaSE score (1.0 everywhere, as in the original which has no temperature).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from vase_jax.eviction import scores
from vase_jax.eviction.attention import WindowScoreOptions, attention_score
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import EvictionInputs, register


def _check_lambda(value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"EvictionConfig.rkv_lambda={value} must lie in [0, 1]")


@dataclasses.dataclass(frozen=True)
class RKVOptions(WindowScoreOptions):
    """`rkv`: the window-score options and the mixing weight lambda."""

    rkv_lambda: float = 0.5

    def validate(self, config: EvictionConfig) -> None:
        super().validate(config)
        _check_lambda(self.rkv_lambda)


@dataclasses.dataclass(frozen=True)
class RKVOfficialOptions:
    """`rkv_official`: R-KV's own scoring parameters (lambda 0.5 as VaSE runs R-KV; the R-KV repo uses 0.1)."""

    rkv_lambda: float = 0.5
    rkv_window: int = 8  # alpha: queries in the observation window (and window keys in the redundancy)
    rkv_pool: int = 7  # max-pool kernel
    rkv_threshold: float = 0.5  # cosine-similarity threshold of the "retain last" rule
    score_temperature: float = 1.0

    def validate(self, config: EvictionConfig) -> None:
        _check_lambda(self.rkv_lambda)
        if not 1 <= self.rkv_window <= config.buffer:
            raise ValueError(f"EvictionConfig.rkv_window={self.rkv_window} must lie in [1, buffer={config.buffer}]")
        if self.rkv_pool < 1 or self.rkv_pool % 2 == 0:
            raise ValueError(f"EvictionConfig.rkv_pool={self.rkv_pool} must be a positive odd number")
        if not -1.0 <= self.rkv_threshold <= 1.0:
            raise ValueError(f"EvictionConfig.rkv_threshold={self.rkv_threshold} must lie in [-1, 1]")
        if self.score_temperature <= 0:
            raise ValueError(f"EvictionConfig.score_temperature={self.score_temperature} must be > 0")


@register("rkv", options=RKVOptions, needs_queries=True, stochastic=False)
def rkv(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """VaSE's R-KV (mode `attn_rkv`): top-K of lambda * s - (1 - lambda) * redundancy."""
    del key
    s = attention_score(inputs, config)  # [b, h, L]
    red = scores.rkv_redundancy(inputs.keys, inputs.valid)  # [b, h, L]
    lam = config.options.rkv_lambda
    return scores.masked_top_k(lam * s - (1.0 - lam) * red, inputs.valid, config.kept)


def rkv_official_score(inputs: EvictionInputs, config: EvictionConfig) -> jax.Array:
    """z [b, h, L] = lambda * I - (1 - lambda) * R of the official R-KV (module docstring), 0 on invalid.

    I over the candidates; R over the candidates and the `rkv_window` newest buffer keys, sliced to the candidates.
    """
    opts = config.options
    window = scores.last_valid_queries(inputs.query_valid, opts.rkv_window)  # [b, W]
    importance = scores.rkv_official_importance(
        inputs.queries,
        window,
        inputs.keys,
        inputs.valid,
        pool=opts.rkv_pool,
        temperature=opts.score_temperature,
    )  # [b, h, L]
    length = inputs.keys.shape[2]
    alpha = opts.rkv_window
    keys = jnp.concatenate([inputs.keys, inputs.buffer_keys[:, :, -alpha:].astype(inputs.keys.dtype)], axis=2)
    valid = jnp.concatenate([inputs.valid, inputs.buffer_valid[:, :, -alpha:]], axis=2)  # [b, h, L + alpha]
    red = scores.rkv_official_redundancy(keys, valid, opts.rkv_threshold)[:, :, :length]  # [b, h, L]
    lam = opts.rkv_lambda
    return jnp.where(inputs.valid, lam * importance - (1.0 - lam) * red, 0.0)


@register("rkv_official", options=RKVOfficialOptions, needs_queries=True, stochastic=False)
def rkv_official(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """Official R-KV scoring (max-pool 7, GQA max, retain-last redundancy over candidates + window keys)."""
    del key
    return scores.masked_top_k(rkv_official_score(inputs, config), inputs.valid, config.kept)
