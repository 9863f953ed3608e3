"""The periodic fixed-budget eviction framework (spec section 2), run inside the compiled decode loop.

After each decode step, with `n` the real tokens held by the longest row (the reference's `cur_len`):

    if n > N and n % B == 0:                      # N = budget, B = buffer
        candidates = slots [0, length - B)        # all but the newest B
        kept       = policy(candidates)           # K = N - B per (row, layer, kv head)
        slots [0, K)  <- candidates[kept]         # in the policy's order (the reference does not sort)
        slots [K, N)  <- the newest B slots
        length = n = N

Padding: our cache holds left padding (the reference's does not). Padding slots have `pos = -1`, are invalid
candidates, and are never kept while a valid candidate is left out, so the first eviction drops them; the trigger
counts real tokens, so padding does not shift the schedule. Rows of a batch evict on the longest row's schedule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention import DEFAULT_BLOCK_SIZE
from vase_jax.cache import KVCache, as_bits, from_bits, layer_of, ordered_queries
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import METHODS, EvictionInputs

CAPACITY_ALIGN = DEFAULT_BLOCK_SIZE


def capacity_for(eviction: EvictionConfig, prompt_slots: int, bucket_slack: int, max_new_tokens: int) -> int:
    """Static cache capacity, rounded up to a multiple of the attention block (`CAPACITY_ALIGN`).

    `full`: prompt_slots + max_new_tokens. Eviction: max(prompt_slots, budget + bucket_slack) + buffer, where
    `bucket_slack` is the padding added to reach the prompt bucket: before the first eviction the longest row's
    real tokens sit behind that padding, so the first trigger (at most `budget + buffer` real tokens, or at most
    `prompt + buffer` for prompts longer than the budget) needs that many extra slots; afterwards `budget + buffer`
    slots suffice. Memory does not depend on `max_new_tokens`.

    The rounding keeps the attention's blocks aligned the same way whatever the capacity, so a method that never
    evicts (budget above the total length) computes bit-identically to `full`.
    """
    if not eviction.evicts:
        slots = prompt_slots + max_new_tokens
    else:
        slots = max(prompt_slots, eviction.budget + bucket_slack) + eviction.buffer
    return -(-slots // CAPACITY_ALIGN) * CAPACITY_ALIGN


def trigger(seen, length, capacity, eviction: EvictionConfig):
    """The reference trigger on `seen` real tokens (`n > N and n % B == 0`), plus a guard that fires only if the
    cache of `capacity` slots, `length` in use, would otherwise overflow (possible only when every row of the
    caller's input starts with padding, which shifts real tokens right). Python ints or int32 arrays."""
    return ((seen > eviction.budget) & (seen % eviction.buffer == 0)) | (length >= capacity)


def should_evict(cache: KVCache, eviction: EvictionConfig) -> jax.Array:
    """`trigger` on the cache's counters: whether an eviction runs after this step."""
    return trigger(cache.seen, cache.length, cache.capacity, eviction)


def _gather_slots(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x: [batch, kv_heads, L, ...]; idx: [batch, kv_heads, K] -> [batch, kv_heads, K, ...]."""
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 3))
    return jnp.take_along_axis(x, idx, axis=2)


def _compact(x: jax.Array, kept: jax.Array, length: jax.Array, budget: int, buffer: int) -> jax.Array:
    """Write the kept candidates to slots [0, K) and the newest `buffer` slots to [K, N)."""
    k = budget - buffer
    recent = jax.lax.dynamic_slice_in_dim(x, length - buffer, buffer, axis=2)  # [batch, kv_heads, B, ...]
    chosen = _gather_slots(x, kept)  # [batch, kv_heads, K, ...]
    x = jax.lax.dynamic_update_slice_in_dim(x, chosen, 0, axis=2)
    return jax.lax.dynamic_update_slice_in_dim(x, recent, k, axis=2)


def select_layer(
    cache: KVCache, layer, eviction: EvictionConfig, key: jax.Array, layer_key: jax.Array, row_ids: jax.Array
) -> jax.Array:
    """Run the policy on one layer's candidates -> kept [batch, kv_heads, K] (indices into slots [0, L))."""
    method = METHODS[eviction.method]
    num_candidates = cache.capacity - eviction.buffer  # static L
    slot = jnp.arange(num_candidates)
    keys = layer_of(cache.k, layer)  # [batch, kv_heads, capacity, head_dim]
    values = layer_of(cache.v, layer)
    pos = jnp.where(slot < cache.length - eviction.buffer, layer_of(cache.pos, layer)[:, :, :num_candidates], -1)
    if method.needs_queries:
        queries, query_valid = ordered_queries(cache, layer)
    else:
        b, h = pos.shape[:2]
        queries = jnp.zeros((b, h, 1, 0, keys.shape[-1]), keys.dtype)
        query_valid = jnp.zeros((b, 0), bool)
    inputs = EvictionInputs(
        keys=keys[:, :, :num_candidates],
        values=values[:, :, :num_candidates],
        queries=queries,
        query_valid=query_valid,
        pos=pos,
        layer_key=layer_key,
        row_ids=row_ids,
    )
    kept = method.select(inputs, eviction, key).astype(jnp.int32)  # [batch, kv_heads, K]
    if eviction.sort_kept_by_position:  # the reference's initial commit; invalid slots go last
        kept_pos = jnp.take_along_axis(pos, kept, axis=2)
        order = jnp.argsort(jnp.where(kept_pos < 0, jnp.iinfo(jnp.int32).max, kept_pos), axis=2)
        kept = jnp.take_along_axis(kept, order, axis=2)
    return kept


def evict(cache: KVCache, eviction: EvictionConfig, key: jax.Array, row_ids: jax.Array) -> KVCache:
    """One eviction event over every layer. `key` is the generate call's eviction key.

    A `fori_loop` over layers with the stacked cache in its carry: each iteration reads one layer, selects,
    compacts it and writes it back in place, so the event holds one layer's candidates and scores at a time.
    """
    budget, buffer = eviction.budget, eviction.buffer
    stale = jnp.arange(cache.capacity) >= budget  # slots >= N hold nothing after the event

    def one_layer(layer, c: KVCache) -> KVCache:
        layer_key = jax.random.fold_in(key, layer)
        event_key = jax.random.fold_in(layer_key, c.evictions)
        kept = select_layer(c, layer, eviction, event_key, layer_key, row_ids)

        def update(x: jax.Array, fill=None) -> jax.Array:  # moves bits only: on the `as_bits` view
            bits = as_bits(x)
            new = _compact(jax.lax.dynamic_index_in_dim(bits, layer, axis=0, keepdims=False), kept, c.length,
                           budget, buffer)
            if fill is not None:
                new = jnp.where(stale, fill, new)
            return from_bits(jax.lax.dynamic_update_index_in_dim(bits, new, layer, axis=0), x.dtype)

        return c.replace(k=update(c.k), v=update(c.v), pos=update(c.pos, -1))

    cache = jax.lax.fori_loop(0, cache.num_layers, one_layer, cache)
    return cache.replace(length=jnp.int32(budget), seen=jnp.int32(budget), evictions=cache.evictions + 1)
