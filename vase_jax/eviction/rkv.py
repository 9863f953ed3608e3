"""R-KV policies: VaSE's re-implementation (`rkv`, spec 3.2a) and the official score (`rkv_official`, 3.2b).

`rkv` (VaSE mode `attn_rkv`, the paper's "R-KV" column):

    z_j = lambda * s_j - (1 - lambda) * red_j,   kept = top-K(z)

with s the VaSE window score (W = all valid window queries, avg-pool 5, GQA mean) and red the closed-form
redundancy softmax over the candidates (no "retain last" rule).

`rkv_official` scores like Zefan-Cai/R-KV's `R1KV._compute_scores`: importance from the last `rkv_window`
(alpha) valid queries, GQA *max of logits* before the softmax, mean over those queries, max-pool `rkv_pool`
with -inf padding; redundancy with the threshold-`rkv_threshold` "retain last" rule
(`scores.rkv_official_redundancy`); z = lambda * I - (1 - lambda) * R; kept = top-K(z), in score order as in
R-KV.

How `rkv_official` differs from the original inside this framework:
- Trigger and window: the original compresses every `divide_length` (128) tokens down to `budget` including
  its alpha-query window, and scores over the keys except the window. Here the VaSE framework triggers every B
  steps, the newest B slots are always kept and are not candidates, and the alpha queries are the newest of
  the B-query ring. The softmax, the max-pool and the redundancy run over the candidates only (the original's
  redundancy also includes the alpha window keys in its mean and in the "last similar" search).
- "Last similar" uses slot order (as the original does after its first compression); when no key is similar
  the original zeroes column 0, here the first valid candidate slot (the same slot when there is no padding).
- lambda is `config.rkv_lambda` (default 0.5, VaSE's setting). The original defaults are lambda = 0.1 (README
  and newer scripts; 0.07 in the class), alpha = 8, kernel 7, threshold 0.5.
- Scores in float32 (the original pools in the model dtype); `config.score_temperature` scales the logits as
  in the VaSE score (1.0 everywhere, as in the original which has no temperature).
"""

from __future__ import annotations

import jax

from vase_jax.eviction import scores
from vase_jax.eviction.attention import attention_score
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import EvictionInputs, register


@register("rkv", needs_queries=True, stochastic=False)
def rkv(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """VaSE's R-KV (mode `attn_rkv`): top-K of lambda * s - (1 - lambda) * redundancy."""
    del key
    scores.check_candidates(inputs.keys.shape[2], config.kept, "rkv")
    s = attention_score(inputs, config)  # [b, h, L]
    red = scores.rkv_redundancy(inputs.keys, inputs.valid)  # [b, h, L]
    lam = config.rkv_lambda
    return scores.masked_top_k(lam * s - (1.0 - lam) * red, inputs.valid, config.kept)


def rkv_official_score(inputs: EvictionInputs, config: EvictionConfig) -> jax.Array:
    """z [b, h, L] = lambda * I - (1 - lambda) * R of the official R-KV (module docstring), 0 on invalid."""
    window = scores.last_valid_queries(inputs.query_valid, config.rkv_window)  # [b, W]
    importance = scores.rkv_official_importance(
        inputs.queries,
        window,
        inputs.keys,
        inputs.valid,
        pool=config.rkv_pool,
        temperature=config.score_temperature,
    )
    red = scores.rkv_official_redundancy(inputs.keys, inputs.valid, config.rkv_threshold)
    lam = config.rkv_lambda
    return lam * importance - (1.0 - lam) * red


@register("rkv_official", needs_queries=True, stochastic=False)
def rkv_official(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """Official R-KV scoring (max-pool 7, GQA max, retain-last redundancy) inside the VaSE framework."""
    del key
    scores.check_candidates(inputs.keys.shape[2], config.kept, "rkv_official")
    return scores.masked_top_k(rkv_official_score(inputs, config), inputs.valid, config.kept)
