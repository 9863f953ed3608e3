"""Attention-scored policies: SnapKV (VaSE's `attn`), VaSE-AttnV and the ablations of spec 3.6.

All use the VaSE window score s (spec 3.0, `scores.window_attention_score`). Value-protecting modes first keep
Nv = `config.num_value_slots` slots by value magnitude, then fill the remaining K - Nv from the other valid
candidates by top-k or by sampling proportional to s (Gumbel-top-k, i.e. torch.multinomial without
replacement). Kept order follows the reference: protected slots first (descending magnitude, sinks first),
then the rest in top-k / draw order.

| name | reference mode | rule |
|---|---|---|
| snapkv | attn | top-K of s |
| attn_sample | attn_sample | sample K proportional to s |
| range_attn | range_attn | top-Nv Range(v), then top-(K-Nv) of s over the rest |
| range_sample_attn | range_sample_attn | top-Nv Range(v), then sample K-Nv proportional to s |
| vase_attnv | range_sink_sample_attn | range_sample_attn, magnitude `config.magnitude`, sinks at +inf |
| attn_random | attn_random | Nv uniformly random valid slots, then top-(K-Nv) of s |
| evict_large_range | evict_large_range | keep the K smallest Range(v) |

`range_attn`, `range_sample_attn` and `evict_large_range` always use Range (their reference names say so);
only `vase_attnv` has the option `magnitude` (the reference's `l2_sink_sample_attn` / `var_sink_sample_attn`).
Sinks are the `sink_slots` valid candidates with the smallest positions (`scores.sink_mask`).

Options (`WindowScoreOptions`): `smooth` (avg-pool 5, True) and `score_temperature` (1.0) of the score s;
`vase_attnv` adds `magnitude`; `evict_large_range` has none. The scoring kernel follows
`GenerateConfig.attention_impl` (`inputs.attention_impl`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from vase_jax.eviction import scores
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import EvictionInputs, register


@dataclasses.dataclass(frozen=True)
class WindowScoreOptions:
    """Options of the VaSE window score s (spec 3.0)."""

    smooth: bool = True  # avg-pool 5 over slot order
    score_temperature: float = 1.0  # the reference's eviction `temperature` (attention-logit scale)

    def validate(self, config: EvictionConfig) -> None:
        if self.score_temperature <= 0:
            raise ValueError(f"EvictionConfig.score_temperature={self.score_temperature} must be > 0 "
                             f"(method {config.method!r})")


@dataclasses.dataclass(frozen=True)
class VaseAttnVOptions(WindowScoreOptions):
    """`vase_attnv`: the window-score options and the value magnitude of the protected slots."""

    magnitude: str = "range"  # range | l2 | var

    def validate(self, config: EvictionConfig) -> None:
        super().validate(config)
        if self.magnitude not in scores.MAGNITUDES:
            raise ValueError(f"EvictionConfig.magnitude={self.magnitude!r}; allowed: {', '.join(scores.MAGNITUDES)}")


def attention_score(inputs: EvictionInputs, config: EvictionConfig) -> jax.Array:
    """s [b, h, L] for these inputs and config (spec 3.0); options `smooth`, `score_temperature`."""
    return scores.window_attention_score(
        inputs.queries,
        inputs.query_valid,
        inputs.keys,
        inputs.valid,
        temperature=config.options.score_temperature,
        smooth=config.options.smooth,
        impl=inputs.attention_impl,
    )


def _magnitude(inputs: EvictionInputs, magnitude: str) -> jax.Array:
    """Per-candidate value magnitude [b, h, L]: the cache's recorded Range(v) where it keeps one
    (`inputs.value_range`, a mixed-precision cache), else computed from the values."""
    if magnitude == "range" and inputs.value_range is not None:
        return inputs.value_range
    return scores.value_magnitude(inputs.values, magnitude)


def _protect_then_fill(
    inputs: EvictionInputs,
    config: EvictionConfig,
    key: jax.Array,
    *,
    magnitude: str,
    sinks: bool,
    sample: bool,
) -> jax.Array:
    """Top-Nv magnitude (sinks at +inf if `sinks`), then K - Nv by top-k or sampling of s. [b, h, K]"""
    length = inputs.keys.shape[2]
    kept, nv = config.kept, config.num_value_slots
    valid = inputs.valid  # [b, h, L]
    m = _magnitude(inputs, magnitude)  # [b, h, L]
    if sinks:
        m = jnp.where(scores.sink_mask(inputs.pos, config.sink_slots), jnp.inf, m)
    protected_ids = scores.masked_top_k(m, valid, nv)  # [b, h, Nv]
    free = ~scores.scatter_mask(protected_ids, length)  # [b, h, L]
    s = attention_score(inputs, config)  # [b, h, L]
    if sample:
        noise = scores.position_gumbel(key, inputs.row_ids, inputs.pos)  # [b, h, L]
        rest = scores.gumbel_top_k(s, noise, valid & free, kept - nv, allowed=free)  # [b, h, K - Nv]
    else:
        rest = scores.masked_top_k(s, valid & free, kept - nv, allowed=free)  # [b, h, K - Nv]
    return jnp.concatenate([protected_ids, rest], axis=-1)


@register("snapkv", options=WindowScoreOptions, needs_queries=True, stochastic=False)
def snapkv(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """SnapKV as VaSE runs it (mode `attn`): the K candidates with the largest window score s."""
    del key
    return scores.masked_top_k(attention_score(inputs, config), inputs.valid, config.kept)


@register("attn_sample", options=WindowScoreOptions, needs_queries=True, stochastic=True)
def attn_sample(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """Sample K candidates without replacement, proportional to s (mode `attn_sample`)."""
    s = attention_score(inputs, config)
    noise = scores.position_gumbel(key, inputs.row_ids, inputs.pos)
    return scores.gumbel_top_k(s, noise, inputs.valid, config.kept)


@register("range_attn", options=WindowScoreOptions, needs_queries=True, stochastic=False)
def range_attn(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """Top-Nv Range(v) (no sinks), then top-(K - Nv) of s over the other candidates (mode `range_attn`)."""
    del key
    return _protect_then_fill(inputs, config, None, magnitude="range", sinks=False, sample=False)


@register("range_sample_attn", options=WindowScoreOptions, needs_queries=True, stochastic=True)
def range_sample_attn(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """Top-Nv Range(v) (no sinks), then sample K - Nv proportional to s (mode `range_sample_attn`)."""
    return _protect_then_fill(inputs, config, key, magnitude="range", sinks=False, sample=True)


@register("vase_attnv", options=VaseAttnVOptions, needs_queries=True, stochastic=True)
def vase_attnv(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """VaSE-AttnV (mode `range_sink_sample_attn`, spec 3.4): top-Nv magnitude with the sinks forced to +inf,
    then K - Nv sampled without replacement proportional to s among the others."""
    return _protect_then_fill(inputs, config, key, magnitude=config.options.magnitude, sinks=True, sample=True)


@register("attn_random", options=WindowScoreOptions, needs_queries=True, stochastic=True)
def attn_random(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """Nv uniformly random valid candidates, then top-(K - Nv) of s over the others (mode `attn_random`)."""
    length = inputs.keys.shape[2]
    kept, nv = config.kept, config.num_value_slots
    valid = inputs.valid
    noise = scores.position_gumbel(key, inputs.row_ids, inputs.pos)  # [b, h, L]
    random_ids = scores.masked_top_k(noise, valid, nv)  # [b, h, Nv] uniform subset, random order
    free = ~scores.scatter_mask(random_ids, length)
    rest = scores.masked_top_k(attention_score(inputs, config), valid & free, kept - nv, allowed=free)
    return jnp.concatenate([random_ids, rest], axis=-1)


@register("evict_large_range", needs_queries=False, stochastic=False)
def evict_large_range(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> jax.Array:
    """Keep the K candidates with the smallest Range(v), ascending (`evict_large_range`, "Evict Large")."""
    del key
    m = _magnitude(inputs, "range")
    return scores.masked_top_k(-m, inputs.valid, config.kept)
