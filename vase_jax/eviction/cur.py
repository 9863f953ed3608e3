"""CUR leverage policies (spec 3.3, 3.5): CurDKV (`cur_fixed_gauss`) and VaSE-DKV (`cur_resample_gauss`).

    G ~ N(0, 1)/sqrt(r), [D, r] per batch row, shared by the row's kv heads (r = config.projection_rank)
    sc_j = ||k_j G||^2 ||v_j G||^2 / sum_j' ||k_j' G||^2 ||v_j' G||^2,   sinks := 1.0,   kept = top-K(sc)

Option (`CurOptions`): `projection_rank` r (20).

CurDKV draws G once per layer and keeps it: here G comes from fold_in(inputs.layer_key, row_id), the same at
every eviction of the layer (equivalent to drawing it at the first eviction and storing it). VaSE-DKV redraws
G at every eviction: from fold_in(key, row_id) of the eviction key. No queries are needed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from vase_jax.eviction import scores
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import EvictionInputs, register


@dataclasses.dataclass(frozen=True)
class CurOptions:
    projection_rank: int = 20  # r, columns of the Gaussian projection G

    def validate(self, config: EvictionConfig) -> None:
        if self.projection_rank < 1:
            raise ValueError(f"EvictionConfig.projection_rank={self.projection_rank} must be >= 1")


def cur_select(inputs: EvictionInputs, config: EvictionConfig, projection_key: jax.Array) -> jax.Array:
    """top-K of the leverage product with G drawn per row from `projection_key`, sinks forced to 1.0."""
    rank = config.options.projection_rank
    g = scores.gaussian_projection(projection_key, inputs.row_ids, inputs.keys.shape[-1], rank)  # [b, D, r]
    sc = scores.cur_leverage(inputs.keys, inputs.values, g, inputs.valid)  # [b, h, L]
    sc = jnp.where(scores.sink_mask(inputs.pos, config.sink_slots), 1.0, sc)
    return scores.masked_top_k(sc, inputs.valid, config.kept)


@register("curdkv", options=CurOptions, needs_queries=False, stochastic=True)
def curdkv(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """CurDKV as VaSE runs it (mode `cur_fixed_gauss`): G fixed per (layer, row)."""
    del key
    return cur_select(inputs, config, inputs.layer_key)


@register("vase_dkv", options=CurOptions, needs_queries=False, stochastic=True)
def vase_dkv(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """VaSE-DKV (mode `cur_resample_gauss`): G redrawn per row at every eviction."""
    return cur_select(inputs, config, key)
