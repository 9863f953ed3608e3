"""Score-free policy: `random` (uniform eviction, the paper's "Evict Random").

`random` keeps K candidates drawn uniformly without replacement among the valid ones, in draw order. The noise
is keyed by (row id, absolute position), so the draw does not depend on padding or on the other rows.
(`full`, no eviction, is not a policy: `EvictionConfig("full")` just turns the framework off.)
"""

from __future__ import annotations

import jax

from vase_jax.eviction import scores
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import EvictionInputs, register


@register("random", needs_queries=False, stochastic=True)
def uniform_random(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """Uniform eviction: K valid candidates drawn uniformly without replacement."""
    noise = scores.position_gumbel(key, inputs.row_ids, inputs.pos)  # [b, h, L]
    return scores.masked_top_k(noise, inputs.valid, config.kept)

