"""The fixed-shape KV cache pytree and its pure update functions.

Layout (DESIGN.md): per layer `k`, `v` [batch, kv_heads, capacity, head_dim] (keys post-RoPE, never re-rotated) and
`pos` [batch, kv_heads, capacity] int32 (the absolute position a slot holds, -1 when empty or padding; after an
eviction every (row, kv head) holds its own selection, hence both axes). Rows advance in lock-step: `length` slots
are in use in every row. Attention-scored eviction policies also need `queries`, a ring buffer of the post-RoPE
queries of the newest `window` tokens, per layer [batch, kv_heads, group, window, head_dim]; the token written at
time t sits in ring slot t % window.

Scalars: `length` (slots in use), `seen` (the reference's `cur_len`: real tokens held by the longest row, which
drives the eviction trigger and is not shifted by padding), `time` (tokens written so far, padding included),
`evictions` (eviction events so far). `row_pos` [batch] is each row's next RoPE position (its real tokens so far).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from vase_jax.config import Qwen3Config


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [batch, kv_heads, capacity, head_dim]
    v: tuple[jax.Array, ...]  # per layer [batch, kv_heads, capacity, head_dim]
    pos: tuple[jax.Array, ...]  # per layer [batch, kv_heads, capacity] int32, -1 = empty
    queries: tuple[jax.Array, ...]  # per layer [batch, kv_heads, group, window, head_dim]; () if unused
    query_valid: jax.Array  # [batch, window] bool: ring slot holds a real token's query
    row_pos: jax.Array  # [batch] int32
    length: jax.Array  # int32 scalar
    seen: jax.Array  # int32 scalar
    time: jax.Array  # int32 scalar
    evictions: jax.Array  # int32 scalar

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def window(self) -> int:
        return self.query_valid.shape[1]


def prefill_cache(
    cfg: Qwen3Config,
    keys: list[jax.Array],
    values: list[jax.Array],
    queries: list[jax.Array] | None,
    attention_mask: jax.Array,
    capacity: int,
    window: int,
) -> KVCache:
    """A cache of `capacity` slots holding a left-padded prompt (slots [0, seq)).

    keys/values: per layer [batch, kv_heads, seq, head_dim]; queries: per layer [batch, kv_heads, group, seq,
    head_dim] or None when no policy needs them; attention_mask: [batch, seq].
    """
    b, t = attention_mask.shape
    mask = attention_mask.astype(bool)
    positions = jnp.where(mask, jnp.cumsum(mask, axis=1) - 1, -1).astype(jnp.int32)  # [batch, seq]
    pad = capacity - t

    def grow(x):  # [batch, kv_heads, seq, ...] -> [batch, kv_heads, capacity, ...]
        widths = [(0, 0)] * x.ndim
        widths[2] = (0, pad)
        return jnp.pad(x, widths)

    pos = jnp.pad(jnp.broadcast_to(positions[:, None, :], (b, cfg.num_kv_heads, t)), ((0, 0), (0, 0), (0, pad)),
                  constant_values=-1)
    # Ring slot r holds the newest prompt token whose time index t' satisfies t' % window == r.
    r = jnp.arange(window)
    t_r = (t - 1) - ((t - 1 - r) % window)  # [window]; negative when the prompt is shorter than the window
    query_valid = (t_r >= 0)[None, :] & jnp.take(mask, jnp.clip(t_r, 0, t - 1), axis=1)  # [batch, window]
    ring = ()
    if queries is not None:
        ring = tuple(
            jnp.where(query_valid[:, None, None, :, None], jnp.take(q, jnp.clip(t_r, 0, t - 1), axis=3), 0)
            for q in queries
        )
    pos_layers = tuple(pos for _ in keys)
    real = mask.sum(axis=1).astype(jnp.int32)  # [batch]
    return KVCache(
        k=tuple(grow(k) for k in keys),
        v=tuple(grow(v) for v in values),
        pos=pos_layers,
        queries=ring,
        query_valid=query_valid,
        row_pos=real,
        length=jnp.int32(t),
        seen=real.max(),
        time=jnp.int32(t),
        evictions=jnp.int32(0),
    )


def write_token(
    k_cache: jax.Array, v_cache: jax.Array, pos_cache: jax.Array, k: jax.Array, v: jax.Array,
    row_pos: jax.Array, slot: jax.Array,
):
    """Write one token per row at `slot` in place. k, v: [batch, kv_heads, 1, head_dim]; row_pos: [batch]."""
    b, h = pos_cache.shape[:2]
    new_pos = jnp.broadcast_to(row_pos[:, None, None], (b, h, 1)).astype(jnp.int32)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, 0, slot, 0))
    v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, 0, slot, 0))
    pos_cache = jax.lax.dynamic_update_slice(pos_cache, new_pos, (0, 0, slot))
    return k_cache, v_cache, pos_cache


def write_query(ring: jax.Array, q: jax.Array, time: jax.Array) -> jax.Array:
    """ring: [batch, kv_heads, group, window, head_dim]; q: [batch, kv_heads, group, 1, head_dim]."""
    return jax.lax.dynamic_update_slice(ring, q.astype(ring.dtype), (0, 0, 0, time % ring.shape[3], 0))


def ordered_queries(cache: KVCache, layer: int) -> tuple[jax.Array, jax.Array]:
    """The ring of `layer` rolled so the oldest query comes first: ([b, kv_heads, group, window, d], [b, window])."""
    w = cache.window
    order = (cache.time + jnp.arange(w)) % w  # oldest ring slot first
    return jnp.take(cache.queries[layer], order, axis=3), jnp.take(cache.query_valid, order, axis=1)


def cache_bytes(cache: KVCache) -> int:
    """Bytes held by the cache arrays (static: depends only on shapes and dtypes)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
