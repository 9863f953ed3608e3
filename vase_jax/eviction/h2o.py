"""H2O, "Heavy-Hitter Oracle" (Zhang et al., NeurIPS 2023, arXiv 2306.14048): keep the heavy hitters, the slots
with the largest accumulated attention, under the VaSE periodic framework.

Per-slot state `attention_mass` (`SlotState`, a running sum kept in the cache):

    A_j = sum_{t : token t attended slot j} sum_{g in the kv head's group} softmax_j(q_{t,g} . k_j / sqrt(D))

over the prompt's causal attention (padding queries and keys excluded, as H2O counts the prefill) and every decode
step since slot j was written (the new token included). At an eviction, kept = top-K(A) among the valid
candidates, in score order; A travels with the kept slots. H2O's "recent window" is the framework's newest B
slots, always kept.

Differences from the paper's code: its budget splits into heavy hitters and a recent window of equal size and it
evicts one token per step; here K = N - B heavy hitters and the B recent slots are kept at every B-step eviction.
The sum runs over the query heads of each kv head (GQA), since the cache has one slot per kv head.
"""

from __future__ import annotations

import jax

from vase_jax.eviction import scores
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import EvictionInputs, SlotState, masked_state, register

ATTENTION_MASS = SlotState("attention_mass")


@register("h2o", needs_queries=False, stochastic=False, state=(ATTENTION_MASS,))
def h2o(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """H2O: keep the K candidates with the largest accumulated attention (prefill and decode steps)."""
    del key
    return scores.masked_top_k(masked_state(inputs, ATTENTION_MASS.name), inputs.valid, config.kept)
