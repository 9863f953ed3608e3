"""The periodic fixed-budget eviction framework (spec section 2), run inside the compiled decode loop.

After each decode step, with `n` the real tokens held by the longest row (the reference's `cur_len`):

    if n > N and n % B == 0:                      # N = budget, B = buffer
        candidates = slots [0, length - B)        # all but the newest B
        kept       = policy(candidates)           # K = N - B per (row, layer, kv head)
        slots [0, K)  <- candidates[kept]         # in the policy's order (the reference does not sort)
        slots [K, N)  <- the newest B slots
        length = n = N

A policy sees its layer's candidates, the newest B slots (`buffer_keys`, `buffer_values`, `buffer_pos`), the query
ring (if it declares `needs_queries`) and its per-slot state (`inputs.state`, if it declares any); `run_policy`
checks the shared preconditions once. Per-slot state arrays move with their slots like `k`, `v` and `pos`.

Padding: our cache holds left padding (the reference's does not). Padding slots have `pos = -1`, are invalid
candidates, and are never kept while a valid candidate is left out, so the first eviction drops them; the trigger
counts real tokens, so padding does not shift the schedule. Rows of a batch evict on the longest row's schedule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention import DEFAULT_BLOCK_SIZE
from vase_jax.cache import KVCache, layer_of, ordered_queries
from vase_jax.eviction import scores
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import METHODS, EvictionInputs, SlotState

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


def slot_state(eviction: EvictionConfig) -> tuple[SlotState, ...]:
    """The per-slot state arrays the cache keeps for this configuration (none for "full")."""
    return METHODS[eviction.method].state if eviction.evicts else ()


def check_policy_inputs(num_candidates: int, eviction: EvictionConfig) -> None:
    """The shared, static preconditions of every policy (ValueError naming the method)."""
    scores.check_candidates(num_candidates, eviction.kept, eviction.method)


def run_policy(inputs: EvictionInputs, eviction: EvictionConfig, key: jax.Array) -> jax.Array:
    """The shared checks, the policy's selection and the optional sort by position: kept [batch, kv_heads, K]."""
    check_policy_inputs(inputs.keys.shape[2], eviction)
    kept = METHODS[eviction.method].select(inputs, eviction, key).astype(jnp.int32)  # [batch, kv_heads, K]
    if eviction.sort_kept_by_position:  # the reference's initial commit; invalid slots go last
        kept_pos = jnp.take_along_axis(inputs.pos, kept, axis=2)
        order = jnp.argsort(jnp.where(kept_pos < 0, jnp.iinfo(jnp.int32).max, kept_pos), axis=2)
        kept = jnp.take_along_axis(kept, order, axis=2)
    return kept


def select_layer(
    cache: KVCache, layer, eviction: EvictionConfig, key: jax.Array, layer_key: jax.Array, row_ids: jax.Array,
    attention_impl: str = "auto",
) -> jax.Array:
    """Run the policy on one layer's candidates -> kept [batch, kv_heads, K] (indices into slots [0, L))."""
    method = METHODS[eviction.method]
    buffer = eviction.buffer
    num_candidates = cache.capacity - buffer  # static L
    slot = jnp.arange(num_candidates)
    keys = layer_of(cache.k, layer)  # [batch, kv_heads, capacity, head_dim]
    values = layer_of(cache.v, layer)
    layer_pos = layer_of(cache.pos, layer)  # [batch, kv_heads, capacity]
    pos = jnp.where(slot < cache.length - buffer, layer_pos[:, :, :num_candidates], -1)

    def newest(x: jax.Array) -> jax.Array:  # slots [length - B, length)
        return jax.lax.dynamic_slice_in_dim(x, cache.length - buffer, buffer, axis=2)

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
        buffer_keys=newest(keys),
        buffer_values=newest(values),
        buffer_pos=newest(layer_pos),
        state={s.name: layer_of(cache.state[s.name], layer)[:, :, :num_candidates] for s in method.state},
        attention_impl=attention_impl,
    )
    return run_policy(inputs, eviction, key)


def evict_per_device(cache: KVCache, eviction: EvictionConfig, key: jax.Array, row_ids: jax.Array,
                     attention_impl: str = "auto") -> KVCache:
    """`evict`, run per device inside `shard_map` when a mesh is set for tracing (`generate` under a mesh).

    Eviction is per (row, kv head), so each device evicts its own rows and kv heads with no communication (the
    SPMD partitioner would gather the candidates' scores of all rows and heads around `top_k` and scatters). Keys
    are replicated; random streams are keyed by row id (`row_ids` is split like the rows) and global kv-head index
    (`sharding.local_kv_heads`), so every mesh evicts exactly what one device does. Without a mesh: `evict`.
    """
    from vase_jax.sharding import cache_specs

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return evict(cache, eviction, key, row_ids, attention_impl)
    specs = cache_specs(cache, mesh)
    rows = jax.sharding.PartitionSpec("data" if "data" in mesh.axis_names else None)

    def local(c, k, r):
        return evict(c, eviction, k, r, attention_impl)

    return jax.shard_map(local, mesh=mesh, in_specs=(specs, jax.sharding.PartitionSpec(), rows), out_specs=specs,
                         check_vma=False)(cache, key, row_ids)


def evict(cache: KVCache, eviction: EvictionConfig, key: jax.Array, row_ids: jax.Array,
          attention_impl: str = "auto") -> KVCache:
    """One eviction event over every layer. `key` is the generate call's eviction key; `attention_impl` picks the
    scoring kernels (`GenerateConfig.attention_impl`).

    A `fori_loop` over layers with the stacked cache in its carry: each iteration reads one layer, selects,
    compacts it and writes it back in place, so the event holds one layer's candidates and scores at a time.
    """
    budget, buffer = eviction.budget, eviction.buffer
    stale = jnp.arange(cache.capacity) >= budget  # slots >= N hold nothing after the event

    def one_layer(layer, c: KVCache) -> KVCache:
        layer_key = jax.random.fold_in(key, layer)
        event_key = jax.random.fold_in(layer_key, c.evictions)
        kept = select_layer(c, layer, eviction, event_key, layer_key, row_ids, attention_impl)

        def update(x: jax.Array, fill=None) -> jax.Array:
            new = _compact(layer_of(x, layer), kept, c.length, budget, buffer)
            if fill is not None:
                new = jnp.where(stale, fill, new)
            return jax.lax.dynamic_update_index_in_dim(x, new, layer, axis=0)

        state = {name: update(x, 0.0) for name, x in c.state.items()}
        return c.replace(k=update(c.k), v=update(c.v), pos=update(c.pos, -1), state=state)

    cache = jax.lax.fori_loop(0, cache.num_layers, one_layer, cache)
    return cache.replace(length=jnp.int32(budget), seen=jnp.int32(budget), evictions=cache.evictions + 1)
