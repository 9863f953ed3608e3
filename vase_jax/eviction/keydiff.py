"""KeyDiff (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction", arXiv 2504.15364), attention-free.

The formula follows NVIDIA kvpress's `KeyDiffPress.score` (kvpress/presses/keydiff_press.py):

    anchor = mean_{j valid} k_j / max(||k_j||_2, 1e-12)                        # mean of the unit candidate keys
    cos_j  = k_j . anchor / (max(||k_j||_2, 1e-8) * max(||anchor||_2, 1e-8))     # cosine similarity to the anchor
    score_j = -cos_j ,   kept = top-K(score)                                      # keep the most distinctive keys

per (row, kv head), in float32, over the valid candidates of one layer (kvpress scores every key of the prompt;
here the candidates of an eviction event, so the newest B slots, always kept, are not in the anchor). Invalid
candidates are masked out of the anchor and of the top-K.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from vase_jax.eviction import scores
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import EvictionInputs, register


def keydiff_score(keys: jax.Array, valid: jax.Array) -> jax.Array:
    """-cos(k_j, anchor) (module docstring), float32 [batch, kv_heads, L]; 0 on invalid candidates."""
    k = jnp.where(valid[..., None], keys.astype(jnp.float32), 0.0)  # [b, h, L, D]
    norm = jnp.sqrt(jnp.sum(k * k, axis=-1))  # [b, h, L]
    n = jnp.maximum(valid.sum(-1).astype(jnp.float32), 1.0)[..., None]  # [b, h, 1]
    anchor = jnp.sum(k / jnp.maximum(norm, 1e-12)[..., None], axis=2) / n  # [b, h, D]
    anchor_norm = jnp.sqrt(jnp.sum(anchor * anchor, axis=-1, keepdims=True))  # [b, h, 1]
    cos = jnp.einsum("bhld,bhd->bhl", k, anchor) / (jnp.maximum(norm, 1e-8) * jnp.maximum(anchor_norm, 1e-8))
    return jnp.where(valid, -cos, 0.0)


@register("keydiff", needs_queries=False, stochastic=False)
def keydiff(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """KeyDiff: keep the K candidates whose keys are least similar (cosine) to the mean unit candidate key."""
    del key
    return scores.masked_top_k(keydiff_score(inputs.keys, inputs.valid), inputs.valid, config.kept)
