"""The periodic fixed-budget eviction framework (spec section 2), run inside the compiled decode loop.

Every row runs the reference's schedule for its own sequence. After each decode step, for each row b that took a
token, with `n` its own `seen` (the reference's `cur_len`):

    if n > N and n % B == 0:                      # N = budget, B = buffer
        candidates = slots [0, length[b] - B)     # all but the newest B
        kept       = policy(candidates)           # K = N - B per (layer, kv head)
        slots [0, K)  <- candidates[kept]         # in the policy's order (the reference does not sort)
        slots [K, N)  <- the newest B slots
        length[b] = n = N

A policy may keep R = `recent_slots` newest slots instead of B (`EvictionConfig.recent`: TriAttention's reference
keeps none, R = 0, and lets the newest tokens compete); then the candidates are slots [0, length[b] - R) and
K = N - R. A policy that combines its scores over layers (`Policy.layer_combine`) selects once per event and every
layer keeps the same slots (`shared_selection`).

One event evicts exactly the rows whose trigger fires; the other rows keep their slots untouched. A policy sees
its layer's candidates, the newest B slots (`buffer_keys`, `buffer_values`, `buffer_pos`), the query ring (if it
declares `needs_queries`) and its per-slot state (`inputs.state`, if it declares any); `run_policy` checks the
shared preconditions once. Per-slot state arrays move with their slots like `k`, `v` and `pos`.

Randomness: row b's event key is fold_in(fold_in(evict_key[b], layer), evictions[b]), its own eviction count, so
a row's kept sets depend only on its own key, row id and sequence. Rows of one batch share the ticks of the
batch (`vase_jax.generate`: a row starts decoding at a step that puts its trigger phase on them), so a batch runs
at most one eviction event per B steps. Prompts are stored without padding (`vase_jax.cache`), so a cache of
max(P, N) + B slots never overflows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention import DEFAULT_BLOCK_SIZE
from vase_jax.cache import KVCache, SlotView, ordered_queries
from vase_jax.eviction import scores
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import METHODS, EvictionInputs, SlotState
from vase_jax.sampling import fold_rows, typed_key
from vase_jax.sharding import cache_specs

CAPACITY_ALIGN = DEFAULT_BLOCK_SIZE


def capacity_for(eviction: EvictionConfig, prompt_slots: int, max_new_tokens: int) -> int:
    """Static cache capacity, rounded up to a multiple of the attention block (`CAPACITY_ALIGN`).

    `full`: prompt_slots + max_new_tokens. Eviction: max(prompt_slots, budget) + buffer (the reference's
    `max(P, N) + B`): a row's first trigger comes at most B tokens after max(P, N), and prompts hold no padding
    slots; with `compress_prompt`, budget + buffer (`compress_prompt` evicts a longer prompt to N). Memory does
    not depend on `max_new_tokens`.

    The rounding keeps the attention's blocks aligned the same way whatever the capacity, so a method that never
    evicts (budget above the total length) computes bit-identically to `full`.
    """
    if not eviction.evicts:
        slots = prompt_slots + max_new_tokens
    elif eviction.compress_prompt:
        slots = eviction.budget + eviction.buffer
    else:
        slots = max(prompt_slots, eviction.budget) + eviction.buffer
    return -(-slots // CAPACITY_ALIGN) * CAPACITY_ALIGN


def compress_prompt(cache, eviction: EvictionConfig, key: jax.Array, row_ids: jax.Array, attention_impl: str,
                    slots: int):
    """Prompt compression (`EvictionConfig.compress_prompt`), right after the prefill: every row whose prompt
    holds more than N slots evicts to N as at a decode event (`evict` with these rows: candidates all but the
    newest R, the policy's own selection, its own keys; the row's `seen` becomes N and its eviction count 1), then
    the cache keeps its first `slots` (N + B, aligned) slots."""
    rows = cache.length > eviction.budget  # [batch]
    return evict_per_device(cache, eviction, key, row_ids, attention_impl, rows).first_slots(slots)


def trigger(seen, eviction: EvictionConfig):
    """The reference trigger on `seen` real tokens: `n > N and n % B == 0` (`EvictionConfig.fires`)."""
    return eviction.fires(seen)


def rows_to_evict(cache, eviction: EvictionConfig) -> jax.Array:
    """[batch] bool: the rows whose trigger fires after this step (rows that took a token at it)."""
    return cache.active & eviction.fires(cache.seen)


def should_evict(cache, eviction: EvictionConfig) -> jax.Array:
    """Whether an eviction event runs after this step: some row's trigger fires."""
    return rows_to_evict(cache, eviction).any()


def phase_wait(seen, step, eviction: EvictionConfig):
    """`EvictionConfig.phase_wait`: the steps a row waits so that it fires on the batch's ticks."""
    return eviction.phase_wait(seen, step)


def slot_state(eviction: EvictionConfig) -> tuple[SlotState, ...]:
    """The per-slot state arrays the cache keeps for this configuration (none for "full")."""
    return METHODS[eviction.method].state if eviction.evicts else ()


def check_model(eviction: EvictionConfig, cfg) -> None:
    """The policy's checks against the model (`options.check_model(cfg)`, e.g. TriAttention's statistics must be
    of its shape), before anything compiles."""
    check = getattr(eviction.options, "check_model", None)
    if check is not None:
        check(cfg)


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


def layer_inputs(
    cache, layer, eviction: EvictionConfig, layer_key: jax.Array, row_ids: jax.Array,
    attention_impl: str = "auto", view: SlotView | None = None,
) -> EvictionInputs:
    """What a policy sees of one layer: the cache's view of its candidates (`candidates(layer, R)`, R =
    `eviction.recent`; `view` if the caller has it), the query ring if the policy reads it, the row's counters."""
    method = METHODS[eviction.method]
    view = cache.candidates(layer, eviction.recent) if view is None else view
    if method.needs_queries:
        queries, query_valid = ordered_queries(cache, layer)
    else:
        b, h = view.pos.shape[:2]
        queries = jnp.zeros((b, h, 1, 0, view.keys.shape[-1]), view.keys.dtype)
        query_valid = jnp.zeros((b, 0), bool)
    return EvictionInputs(
        keys=view.keys,
        values=view.values,
        queries=queries,
        query_valid=query_valid,
        pos=view.pos,
        layer_key=layer_key,
        row_ids=row_ids,
        buffer_keys=view.buffer_keys,
        buffer_values=view.buffer_values,
        buffer_pos=view.buffer_pos,
        state={s.name: view.state[s.name] for s in method.state},
        value_range=view.value_range,
        layer=layer,
        prompt_length=cache.prompt_length,
        next_position=cache.row_pos,
        attention_impl=attention_impl,
    )


def select_layer(
    cache: KVCache, layer, eviction: EvictionConfig, key: jax.Array, layer_key: jax.Array, row_ids: jax.Array,
    attention_impl: str = "auto",
) -> jax.Array:
    """Run the policy on one layer's candidates (`layer_inputs`) -> kept [batch, kv_heads, K] (indices into
    slots [0, L)). `key`, `layer_key`: one key, or one per row [batch]."""
    return run_policy(layer_inputs(cache, layer, eviction, layer_key, row_ids, attention_impl), eviction, key)


def shared_selection(cache: KVCache, eviction: EvictionConfig, key: jax.Array, layer_key: jax.Array,
                     row_ids: jax.Array, layers, attention_impl: str = "auto") -> jax.Array:
    """One kept set [batch, kv_heads, K] for every layer, for a policy that combines its per-layer scores
    (`Policy.layer_combine`): S = mean or max over the `layers` (a traced count: 0 when no row is due) of
    `layer_score(layer l's inputs)`, then the policy's `select` on layer 0's inputs with `shared_score` = S.
    Slot j holds the same token in every layer, since every eviction before this one was shared too."""
    policy = METHODS[eviction.method]
    combine = policy.layer_combine(eviction)

    def add(layer, total):
        score = policy.layer_score(layer_inputs(cache, layer, eviction, layer_key, row_ids, attention_impl),
                                   eviction).astype(jnp.float32)  # [batch, kv_heads, L]
        return total + score if combine == "mean" else jnp.maximum(total, score)

    first = layer_inputs(cache, 0, eviction, layer_key, row_ids, attention_impl)
    start = 0.0 if combine == "mean" else -jnp.inf
    total = jax.lax.fori_loop(0, layers, add, jnp.full(first.pos.shape, start, jnp.float32))
    if combine == "mean":
        total = total / cache.num_layers
    return run_policy(first.replace(shared_score=total), eviction, key)


def evict_per_device(cache: KVCache, eviction: EvictionConfig, key: jax.Array, row_ids: jax.Array,
                     attention_impl: str = "auto", rows: jax.Array | None = None) -> KVCache:
    """`evict`, run per device inside `shard_map` when a mesh is set for tracing (`generate` under a mesh).

    Eviction is per (row, kv head), so each device evicts its own rows and kv heads with no communication (the
    SPMD partitioner would gather the candidates' scores of all rows and heads around `top_k` and scatters). A
    shared key is replicated, per-row keys are split like the rows; random streams are keyed by row id (`row_ids`
    is split like the rows) and global kv-head index (`sharding.local_kv_heads`), so every mesh evicts exactly what
    one device does. Without a mesh: `evict`. `rows`: as in `evict`.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return evict(cache, eviction, key, row_ids, attention_impl, rows)
    specs = cache_specs(cache, mesh)
    split = jax.sharding.PartitionSpec("data" if "data" in mesh.axis_names else None)

    def local(c, k, r, due):
        return evict(c, eviction, k, r, attention_impl, due)

    key_spec = split if jnp.ndim(key) == 1 else jax.sharding.PartitionSpec()  # one key per row: split like the rows
    due_spec = None if rows is None else split
    return jax.shard_map(local, mesh=mesh, in_specs=(specs, key_spec, split, due_spec), out_specs=specs,
                         check_vma=False)(cache, key, row_ids, rows)


def evict(cache, eviction: EvictionConfig, key: jax.Array, row_ids: jax.Array,
          attention_impl: str = "auto", rows: jax.Array | None = None):
    """One event over every layer, for the rows the cache says are due (`rows_due`; `rows` [batch] bool: these
    rows evict, whatever their trigger); the other rows are left untouched. `key`: the eviction key, one for the
    batch or one per row [batch]; `attention_impl` picks the scoring kernels (`GenerateConfig.attention_impl`).

    The due rows whose trigger fires evict: per layer, the policy selects from the cache's view of its candidates
    (`candidates`) and the cache keeps what it selected (`keep`); the other due rows (a mixed-precision cache's
    ticks between evictions) take the cache's own event (`flush`). The same code for every kind of cache.

    A `fori_loop` over layers with the stacked cache in its carry: each iteration reads one layer, selects,
    rewrites it in place, so the event holds one layer's candidates and scores at a time. With no row to evict
    the loop runs zero times: a caller may call this at every point where an event may be due, with no
    conditional around it (XLA:GPU copies the whole cache into and out of a conditional's branches).
    """
    if rows is None:
        due = cache.rows_due(eviction)
        evicting = due & eviction.fires(cache.seen)
        cache = cache.flush(due & ~evicting, attention_impl)
    else:
        evicting = rows
    if not eviction.evicts:
        return cache
    key = typed_key(key)
    per_row = key if key.ndim == 1 else None
    b = cache.length.shape[0]

    def keys_of(layer, c) -> tuple[jax.Array, jax.Array]:  # (event key [batch], layer key)
        if per_row is None:
            layer_key = jax.random.fold_in(key, layer)
            return fold_rows(jnp.broadcast_to(layer_key, (b,)), c.evictions), layer_key
        layer_key = fold_rows(per_row, jnp.full((b,), layer, jnp.int32))
        return fold_rows(layer_key, c.evictions), layer_key

    layers = jnp.where(jnp.any(evicting), cache.num_layers, 0)  # no row due: nothing to do
    shared = None
    if METHODS[eviction.method].layer_combine(eviction):
        with jax.named_scope("eviction_scores"):
            shared = shared_selection(cache, eviction, *keys_of(0, cache), row_ids, layers, attention_impl)

    def one_layer(layer, c):
        c = c.pinned(attention_impl)
        view = c.candidates(layer, eviction.recent)
        kept = shared
        if shared is None:
            event_key, layer_key = keys_of(layer, c)
            kept = run_policy(layer_inputs(c, layer, eviction, layer_key, row_ids, attention_impl, view), eviction,
                              event_key)
        return c.keep(layer, view, kept, evicting, eviction).pinned(attention_impl)

    with jax.named_scope("eviction"):
        cache = jax.lax.fori_loop(0, layers, one_layer, cache)
    return cache.evicted(evicting, eviction)
