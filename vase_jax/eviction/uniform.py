"""Score-free policies: `random` (uniform eviction, the paper's "Evict Random") and `full` (no eviction).

`random` keeps K candidates drawn uniformly without replacement among the valid ones, in draw order. The noise
is keyed by (row id, absolute position), so the draw does not depend on padding or on the other rows.
`full` is registered so that `EvictionConfig(method="full")` validates; the generate loop never evicts
with it.
"""

from __future__ import annotations

import jax

from vase_jax.eviction import scores
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import EvictionInputs, register


@register("random", needs_queries=False, stochastic=True)
def uniform_random(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """Uniform eviction: K valid candidates drawn uniformly without replacement."""
    scores.check_candidates(inputs.keys.shape[2], config.kept, "random")
    noise = scores.position_gumbel(key, inputs.row_ids, inputs.pos)  # [b, h, L]
    return scores.masked_top_k(noise, inputs.valid, config.kept)


@register("full", needs_queries=False, stochastic=False)
def full(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """No eviction: the full cache is kept (this selection function is never called)."""
    raise ValueError(
        "EvictionConfig.method='full' keeps the whole cache and has no selection function; "
        "allowed: call select only for evicting methods (config.evicts is True)"
    )
