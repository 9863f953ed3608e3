"""The fixed-shape KV cache pytree and its pure update functions.

Layout (DESIGN.md), stacked over layers, every axis named in `CACHE_AXES`: `k`, `v` [layers, batch, kv_heads,
capacity, head_dim] (keys post-RoPE, never re-rotated) and `pos` [layers, batch, kv_heads, capacity] int32 (the
absolute position a slot holds, -1 when empty; after an eviction every (layer, row, kv head) holds its own
selection). Attention-scored eviction policies also need `queries`, a ring buffer of the post-RoPE queries of the
newest `window` tokens, [layers, batch, kv_heads, group, window, head_dim]; a row's real token t sits in ring slot
t % window. Policies with per-slot state (`vase_jax.eviction.SlotState`, e.g. H2O's accumulated attention) add
`state`, a dict of float32 arrays [layers, batch, kv_heads, capacity] (`STATE_AXES`), updated from the attention
weights at the prefill and at every decode step (`prefill_state`, `update_state`); `state` is empty, and costs
nothing, for every other policy.

Every row is its own sequence (the reference's batch of one): per-row [batch] counters `length` (slots in use),
`seen` (the reference's `cur_len`, which drives the row's eviction trigger), `prompt_length` (P_b), `row_pos`
(the next token's RoPE position = real tokens written so far, also the row's ring clock), `evictions` (the row's
eviction count, which keys its eviction randomness) and `active` (the row takes a token at the next decode step;
a waiting or finished row's step writes nothing and counts nothing). A prompt is stored without its padding: row
b's real tokens sit in slots [0, P_b), whatever bucket the batch was padded to, so a row's cache never depends on
the other rows.

Decode writes are per-row scatters at slot `length[b]` (in place inside the loop; an inactive row's write goes to
an out-of-range slot and is dropped). The decode attention reads each row's slots [0, length[b]) (the kernels
loop over a row's own used blocks; the XLA path loops to the longest row's and masks the others).

Storage: the target (`vase_jax.target.Target.storage`) decides. On CPU a 16-bit float cache (`k`, `v`,
`queries`) is stored as its bits, uint16 (`dtype` keeps the float dtype). XLA:CPU has no bfloat16
dynamic-update-slice: it converts the whole operand to float32 and back around each write, so a bf16 decode step
would rewrite every stacked cache array once per layer (in a microbenchmark of a [4, 4, 8, 2048, 128] stack: 62 ms
per step of four one-token writes in bf16, 0.4 ms in uint16). Reads go through `layer_keys` / `layer_values` /
`ordered_queries` (one layer, bitcast back), the decode kernels read the bits directly
(`pallas_kernels.decode_attention.stored_as`), and `as_floats` gives the cache in its float dtype. GPUs and TPUs
store floats.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental.layout import Layout, with_layout_constraint

from vase_jax.attention import chunk_attention, decode_attention
from vase_jax.config import Qwen3Config
from vase_jax.target import Target

if TYPE_CHECKING:
    from vase_jax.eviction.config import EvictionConfig

# Logical axis names of every cache array (sharding maps names to mesh axes; `init_cache` reads sizes off them).
CACHE_AXES = {
    "k": ("layers", "batch", "kv_heads", "slots", "head_dim"),
    "v": ("layers", "batch", "kv_heads", "slots", "head_dim"),
    "pos": ("layers", "batch", "kv_heads", "slots"),
    "queries": ("layers", "batch", "kv_heads", "group", "window", "head_dim"),
    "query_valid": ("batch", "window"),
    "row_pos": ("batch",),
    "length": ("batch",),
    "seen": ("batch",),
    "prompt_length": ("batch",),
    "evictions": ("batch",),
    "active": ("batch",),
}
STATE_AXES = ("layers", "batch", "kv_heads", "slots")  # every per-slot state array


def as_bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array viewed as uint16; other dtypes unchanged. Writing into or gathering from a bf16 array
    through this view keeps XLA:CPU from converting all of it to float32 first (it has no bf16 dynamic-update-slice
    or gather; `vase_jax.target`)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 and _is_float(x) else x


def from_bits(bits: jax.Array, dtype) -> jax.Array:
    """The inverse of `as_bits` for an array of `dtype`."""
    return jax.lax.bitcast_convert_type(bits, dtype) if bits.dtype != dtype else bits


def view_as(x: jax.Array, dtype) -> jax.Array:
    """x's bits as the same-width `dtype` (a bitcast); x itself when it is of `dtype`."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def _is_float(x: jax.Array) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def stored(x: jax.Array, cache: KVCache) -> jax.Array:
    """x as the cache stores its keys, values and queries: cast to its float dtype, as bits if it keeps bits."""
    x = x.astype(cache.float_dtype)
    return as_bits(x) if cache.k.dtype == jnp.uint16 else x


def layer_of(x: jax.Array, layer) -> jax.Array:
    """One layer of a stacked cache array, `[layers, ...] -> [...]` (a traced index works)."""
    return jax.lax.dynamic_index_in_dim(x, layer, axis=0, keepdims=False)


@struct.dataclass
class KVCache:
    k: jax.Array  # [layers, batch, kv_heads, capacity, head_dim]
    v: jax.Array  # [layers, batch, kv_heads, capacity, head_dim]
    pos: jax.Array  # [layers, batch, kv_heads, capacity] int32, -1 = empty
    queries: jax.Array  # [layers, batch, kv_heads, group, window, head_dim]; window 0 if unused
    query_valid: jax.Array  # [batch, window] bool: ring slot holds a real token's query
    row_pos: jax.Array  # [batch] int32: next RoPE position = real tokens written (the ring's clock)
    length: jax.Array  # [batch] int32: slots in use
    seen: jax.Array  # [batch] int32: the reference's cur_len (trigger counter)
    prompt_length: jax.Array  # [batch] int32: the row's real prompt tokens P_b (positions [0, P_b))
    evictions: jax.Array  # [batch] int32: evictions of the row so far
    active: jax.Array  # [batch] bool: the row takes a token at the next decode step
    state: dict[str, jax.Array] = struct.field(default_factory=dict)  # name -> [layers, batch, kv_heads, capacity] f32
    state_specs: tuple[Any, ...] = struct.field(pytree_node=False, default=())  # the `SlotState`s of `state`
    dtype: Any = struct.field(pytree_node=False, default=None)  # float dtype of k, v, queries (None: k's dtype)
    target: Target | None = struct.field(pytree_node=False, default=None)  # what it is stored for (`init_cache`)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def window(self) -> int:
        return self.query_valid.shape[1]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def float_dtype(self):
        """The float dtype of `k`, `v` and `queries` (which may be stored as its bits)."""
        return self.k.dtype if self.dtype is None else jnp.dtype(self.dtype)

    def layer_keys(self, layer) -> jax.Array:
        """Keys of one layer in the float dtype: [batch, kv_heads, capacity, head_dim]."""
        return from_bits(layer_of(self.k, layer), self.float_dtype)

    def layer_values(self, layer) -> jax.Array:
        """Values of one layer in the float dtype: [batch, kv_heads, capacity, head_dim]."""
        return from_bits(layer_of(self.v, layer), self.float_dtype)

    def as_floats(self) -> KVCache:
        """The same cache with `k`, `v` and `queries` in the float dtype (a copy when they are stored as bits)."""
        dtype = self.float_dtype
        return self.replace(k=from_bits(self.k, dtype), v=from_bits(self.v, dtype),
                            queries=from_bits(self.queries, dtype))

    def axes(self) -> dict[str, Any]:
        """Field name -> the logical names of its axes (a tuple per array; a pytree of them for a nested field),
        from which `sharding.cache_specs` shards the cache; `state` arrays have `STATE_AXES`."""
        return CACHE_AXES

    # ---- the cache interface: `tiers.TieredCache` has the same methods, and the model, the decode loop, the
    # eviction framework and the continuous engine call only these (none of them asks which kind it holds) -------
    def start_prompt(self, token_mask: jax.Array) -> KVCache:
        """Before the layers write a left-padded prompt of `token_mask` [batch, seq]: positions and counters."""
        return start_prompt(self, token_mask)

    def write_prompt(self, layer, k: jax.Array, v: jax.Array, q: jax.Array, token_mask: jax.Array,
                     slot_weights: jax.Array | None = None) -> KVCache:
        """One layer of the prompt (`write_prompt`); `slot_weights` [batch, kv_heads, seq]: the prompt's attention
        weights per key summed over the group and the queries, for the per-slot state (None: no state)."""
        new = write_prompt(self, layer, k, v, q, token_mask)
        return new if slot_weights is None else prefill_state(new, layer, slot_weights, token_mask)

    def attend_chunk(self, layer, k: jax.Array, v: jax.Array, q: jax.Array, start) -> tuple[jax.Array, KVCache]:
        """One layer of a chunk of a prompt (the chunked prefill, after `start_prompt`): the chunk's keys and values
        to slots [start, start + C) (`write_chunk`), then its queries attend over slots [0, start + C) causally
        (`chunk_attention`). The prompt is unpadded: a token's slot is its position. A per-slot state adds the
        chunk's attention weights (the sums `finish_prompt` turns into the state).
        k, v [batch, kv_heads, C, head_dim], q [batch, kv_heads, group, C, head_dim] -> (out like q, cache)."""
        cache = write_chunk(self, layer, k, v, q, start)
        query_valid = start + jnp.arange(k.shape[2])[None] < cache.prompt_length[:, None]  # [batch, C]

        def read_block(first, size):  # slots [first, first + size) of the layer, read from the stacks in place
            def part(x):
                return jax.lax.dynamic_slice_in_dim(layer_of(x, layer), first, size, axis=2)
            return from_bits(part(cache.k), cache.float_dtype), from_bits(part(cache.v), cache.float_dtype), \
                part(cache.pos)

        out, sums = chunk_attention(q, read_block, cache.capacity, start, query_valid, column_sums=bool(cache.state))
        if sums is not None:
            cache = cache.replace(state={name: x.at[layer].add(sums) for name, x in cache.state.items()})
        return out, cache

    def finish_prompt(self) -> KVCache:
        """After the last chunk: state <- update(0, the prompt's summed attention weights), as `prefill_state`."""
        return self.replace(state={spec.name: spec.update(jnp.zeros_like(self.state[spec.name]),
                                                          self.state[spec.name]).astype(jnp.float32)
                                   for spec in self.state_specs})

    def start_token(self) -> KVCache:
        """Before the layers write one token per active row: its position and the counters (`start_token`)."""
        return start_token(self)

    def attend_token(self, layer, k: jax.Array, v: jax.Array, q: jax.Array,
                     attention_impl: str = "auto") -> tuple[jax.Array, KVCache]:
        """Write the token of every active row into `layer` and attend over the row's live slots:
        k, v [batch, kv_heads, 1, head_dim], q [batch, kv_heads, group, 1, head_dim] -> (out like q, cache)."""
        cache = write_token(self, layer, k, v, q)
        # Each row's own length: the kernels read a row's used blocks only (rows of a continuous batch differ),
        # and nothing of a row that takes no token this step (finished, or waiting for its first tick).
        lengths = jnp.where(cache.active, cache.length, 0)  # [batch]
        out = decode_attention(q[:, :, :, 0], cache.k, cache.v, cache.pos, lengths, attention_impl,
                               layer=layer)[:, :, :, None]  # [batch, kv_heads, group, 1, head_dim]
        if cache.state:
            cache = update_state(cache, layer, q[:, :, :, 0])
        return out, cache

    @property
    def slot_count(self) -> int:
        """The slots a policy's view runs over (`candidates`): the capacity."""
        return self.capacity

    @property
    def kv_stacks(self) -> tuple[jax.Array, ...]:
        """The arrays that hold the cached keys and values (the ones a program must never copy)."""
        return (self.k, self.v)

    def has_events(self, eviction: EvictionConfig) -> bool:
        """Whether the decode loop ever runs an event on this cache: with eviction."""
        return eviction.evicts

    def rows_due(self, eviction: EvictionConfig) -> jax.Array:
        """[batch] bool: the rows whose event is due after this step: their eviction trigger fires."""
        return self.active & eviction.fires(self.seen)

    def phase_wait(self, seen, step, eviction: EvictionConfig):
        """The steps a row waits before its first decode step so that its events fall on the batch's ticks."""
        return eviction.phase_wait(seen, step)

    def flush(self, rows: jax.Array, attention_impl: str = "auto") -> KVCache:
        """The event of the due rows that do not evict: none here (every due row evicts)."""
        return self

    def pinned(self, attention_impl: str = "auto") -> KVCache:
        """The cache as the eviction's layer loop carries it: as it is."""
        return self

    def candidates(self, layer, recent: int) -> SlotView:
        """What a policy sees of one layer: row b's candidates are its slots [0, length[b] - R) (R = `recent`,
        the newest slots that are kept unscored), padded to the static L = capacity - R."""
        num_candidates = self.capacity - recent  # static L
        slot = jnp.arange(num_candidates)
        keys = self.layer_keys(layer)  # [batch, kv_heads, capacity, head_dim]
        values = self.layer_values(layer)
        layer_pos = layer_of(self.pos, layer)  # [batch, kv_heads, capacity]
        pos = jnp.where(slot < (self.length - recent)[:, None, None], layer_pos[:, :, :num_candidates], -1)
        return SlotView(keys=keys[:, :, :num_candidates], values=values[:, :, :num_candidates], pos=pos,
                        buffer_keys=newest_slots(keys, self.length, recent),
                        buffer_values=newest_slots(values, self.length, recent),
                        buffer_pos=newest_slots(layer_pos, self.length, recent),
                        state={name: layer_of(x, layer)[:, :, :num_candidates] for name, x in self.state.items()})

    def keep(self, layer, view: SlotView, kept: jax.Array, rows: jax.Array, eviction: EvictionConfig) -> KVCache:
        """Layer `layer` after the eviction of the `rows` [batch] bool: the policy's `kept` [batch, kv_heads, K]
        candidates to slots [0, K), each row's newest R slots to [K, N), slots >= N emptied; other rows as
        they are. Each array is gathered straight from its stack (the layer index is part of the gather) and
        written back in place: no copy of the old layer."""
        budget, recent, capacity = eviction.budget, eviction.recent, self.capacity
        src = compacted_slots(kept, self.length, capacity, budget, recent)  # [batch, kv_heads, capacity]
        src = jnp.where(rows[:, None, None], src, jnp.arange(capacity))  # rows not evicted: every slot stays
        cleared = (jnp.arange(capacity) >= budget) & rows[:, None, None]  # [batch, 1, capacity]
        b_idx = jnp.arange(src.shape[0])[:, None, None]
        h_idx = jnp.arange(src.shape[1])[None, :, None]

        def update(x: jax.Array, fill=None) -> jax.Array:
            new = x[layer, b_idx, h_idx, src]  # [batch, kv_heads, capacity, ...]
            if fill is not None:
                new = jnp.where(cleared.reshape(cleared.shape + (1,) * (new.ndim - 3)), fill, new)
            return jax.lax.dynamic_update_index_in_dim(x, new, layer, axis=0)

        state = {name: update(x, 0.0) for name, x in self.state.items()}
        return self.replace(k=update(self.k), v=update(self.v), pos=update(self.pos, -1), state=state)

    def evicted(self, rows: jax.Array, eviction: EvictionConfig) -> KVCache:
        """The counters after the eviction of the `rows` [batch] bool: N slots, N seen, one more event."""
        budget = eviction.budget
        return self.replace(length=jnp.where(rows, budget, self.length), seen=jnp.where(rows, budget, self.seen),
                            evictions=self.evictions + rows.astype(jnp.int32))

    def first_slots(self, slots: int) -> KVCache:
        """The cache of its first `slots` slots per (layer, row, kv head) (after a prompt compression: N + B)."""
        if slots >= self.capacity:
            return self
        return self.replace(k=self.k[:, :, :, :slots], v=self.v[:, :, :, :slots], pos=self.pos[..., :slots],
                            state={name: x[..., :slots] for name, x in self.state.items()})

    def take_row(self, j, like: KVCache) -> KVCache:
        """Row `j` (traced) as a batch-1 cache with the slots of `like` (the continuous engine's staged prompt
        moving into its batch: the slots past this cache's empty, as `init_cache` makes them)."""
        state = {name: take_row(x, j, STATE_AXES, like.capacity, 0) for name, x in self.state.items()}
        return self.replace(**row_fields(self, j, like.capacity), state=state)

    def put_row(self, one: KVCache, row) -> KVCache:
        """The batch-1 cache `one` written into row `row` (every array along its "batch" axis)."""
        return self.replace(**{name: put_row(getattr(self, name), getattr(one, name), row, batch_axis(name))
                               for name in CACHE_AXES},
                            state={name: put_row(x, one.state[name], row, batch_axis("state"))
                                   for name, x in self.state.items()})


def take_row(x: jax.Array, j, axes: tuple[str, ...], slots: int, fill) -> jax.Array:
    """Row j of an array whose axes are named `axes`, its "slots" axis (if any) padded to `slots` with `fill`."""
    x = jax.lax.dynamic_slice_in_dim(x, j, 1, axes.index("batch"))
    return pad_axis(x, axes.index("slots"), slots, fill) if "slots" in axes else x


def put_row(x: jax.Array, y: jax.Array, row, axis: int) -> jax.Array:
    """x with its entry `row` of `axis` replaced by y (of size 1 there)."""
    return jax.lax.dynamic_update_slice_in_dim(x, y, row, axis)


def row_fields(cache: KVCache, j, slots: int) -> dict[str, jax.Array]:
    """Row j of every `CACHE_AXES` array of `cache`, its slots padded to `slots` (`pos` with -1, else 0)."""
    return {name: take_row(getattr(cache, name), j, axes, slots, -1 if name == "pos" else 0)
            for name, axes in CACHE_AXES.items()}


@struct.dataclass
class SlotView:
    """One layer of a cache as an eviction policy sees it (`KVCache.candidates`): the candidates' keys and
    values [batch, kv_heads, L, head_dim] and positions [batch, kv_heads, L] (-1: not a candidate), the newest
    R slots kept unscored (`buffer_*`, [batch, kv_heads, R, ...], oldest first), the per-slot state name ->
    [batch, kv_heads, L] and, where the cache records it at write, Range(v) [batch, kv_heads, L] (None: computed
    from `values`)."""

    keys: jax.Array
    values: jax.Array
    pos: jax.Array
    buffer_keys: jax.Array
    buffer_values: jax.Array
    buffer_pos: jax.Array
    state: dict[str, jax.Array]
    value_range: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The static size of a 16-bit cache: `slots` per (layer, row, kv head). `tiers.TierLayout` is the
    mixed-precision cache's; both make their cache with `init`."""

    slots: int

    def for_prompts(self, prompt_slots: int) -> CacheLayout:
        """The layout of a cache that only holds prompts of `prompt_slots` (the continuous engine's staging)."""
        return CacheLayout(prompt_slots)

    def init(self, cfg: Qwen3Config, batch: int, window: int, dtype, state: tuple = (),
             target: Target | None = None) -> KVCache:
        """An empty cache of this layout (`init_cache`)."""
        return init_cache(cfg, batch, self.slots, window, dtype, state, target)

    def chunk_staging(self, prompt_slots: int) -> CacheLayout:
        """The layout a chunked prefill writes the prompt into (`generate.chunked_prefill`): this one."""
        return self

    def from_chunks(self, staged: KVCache, token_mask: jax.Array, cfg: Qwen3Config) -> KVCache:
        """The cache after a chunked prefill into `chunk_staging`'s cache: `staged` itself, its state finished."""
        return staged.finish_prompt()


def as_layout(capacity: int | CacheLayout | Any) -> Any:
    """A cache layout: `capacity` itself, or `CacheLayout(capacity)` for a slot count."""
    return CacheLayout(capacity) if isinstance(capacity, int) else capacity


def pad_axis(x: jax.Array, axis: int, size: int, fill) -> jax.Array:
    """x padded at the end of `axis` to `size` entries of `fill`."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=jnp.asarray(fill, x.dtype))


def gather_slots(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x: [batch, kv_heads, L, ...]; idx: [batch, kv_heads, K] -> [batch, kv_heads, K, ...]."""
    idx = idx.reshape(idx.shape + (1,) * (x.ndim - 3))
    return jnp.take_along_axis(x, idx, axis=2)


def newest_slots(x: jax.Array, length: jax.Array, count: int) -> jax.Array:
    """Each row's slots [length[b] - count, length[b]): x [batch, kv_heads, capacity, ...] ->
    [batch, kv_heads, count, ...]."""
    idx = jnp.clip(length[:, None] - count + jnp.arange(count), 0, x.shape[2] - 1)  # [batch, count]
    return gather_slots(x, jnp.broadcast_to(idx[:, None], x.shape[:2] + (count,)))


def compacted_slots(kept: jax.Array, length: jax.Array, capacity: int, budget: int, recent: int) -> jax.Array:
    """[batch, kv_heads, capacity] source slot of every slot after an eviction: the kept candidates to [0, K),
    each row's newest `recent` slots to [K, N) (K = N - recent), slots >= N unchanged (stale)."""
    k = budget - recent
    slot = jnp.arange(capacity)
    newest = length[:, None, None] - budget + slot  # slot j in [K, N) <- length - R + (j - K)
    kept_full = jnp.pad(kept, ((0, 0), (0, 0), (0, capacity - k)))  # [batch, kv_heads, capacity]
    src = jnp.where(slot < k, kept_full, jnp.where(slot < budget, newest, slot))
    return jnp.clip(src, 0, capacity - 1)


def cache_shapes(cfg: Qwen3Config, batch: int, capacity: int, window: int) -> dict[str, tuple[int, ...]]:
    """Shape of every cache array, from `CACHE_AXES` and the sizes of `cfg`."""
    sizes = cfg.axis_sizes() | {"batch": batch, "slots": capacity, "window": window}
    return {name: tuple(sizes[a] for a in axes) for name, axes in CACHE_AXES.items()}


def init_cache(cfg: Qwen3Config, batch: int, capacity: int, window: int, dtype, state: tuple = (),
               target: Target | None = None) -> KVCache:
    """An empty cache of `capacity` slots (every `pos` -1, length 0); `window` > 0 keeps a query ring; `state`: the
    policy's `SlotState`s, each a zero float32 array [layers, batch, kv_heads, capacity]. Keys, values and
    queries are stored as `target.storage(dtype)` says (None: as `dtype`)."""
    shapes = cache_shapes(cfg, batch, capacity, window)
    stored = jnp.dtype(dtype) if target is None else target.storage(dtype)  # zero bits are +0.0
    return KVCache(
        state={spec.name: jnp.zeros(shapes["pos"], jnp.float32) for spec in state},
        state_specs=tuple(state),
        dtype=jnp.dtype(dtype),
        target=target,
        k=jnp.zeros(shapes["k"], stored),
        v=jnp.zeros(shapes["v"], stored),
        pos=jnp.full(shapes["pos"], -1, jnp.int32),
        queries=jnp.zeros(shapes["queries"], stored),
        query_valid=jnp.zeros(shapes["query_valid"], bool),
        row_pos=jnp.zeros(shapes["row_pos"], jnp.int32),
        length=jnp.zeros(shapes["length"], jnp.int32),
        seen=jnp.zeros(shapes["seen"], jnp.int32),
        prompt_length=jnp.zeros(shapes["prompt_length"], jnp.int32),
        evictions=jnp.zeros(shapes["evictions"], jnp.int32),
        active=jnp.ones(shapes["active"], bool),
    )


def ring_times(real: jax.Array, window: int) -> jax.Array:
    """Ring slot r holds the newest real token t < real[b] with t % window == r: [batch, window] t (negative when
    the row has fewer than `window` real tokens: no query)."""
    r = jnp.arange(window)
    last = real[:, None] - 1  # [batch, 1]
    return last - ((last - r) % window)


def left_padding(token_mask: jax.Array) -> jax.Array:
    """[batch] left-padding columns of each row of `token_mask` [batch, seq]."""
    return token_mask.shape[1] - token_mask.sum(axis=1).astype(jnp.int32)


def unpad(x: jax.Array, pad: jax.Array, axis: int) -> jax.Array:
    """Shift each row of a left-padded x [batch, ..., seq (at `axis`), ...] left by pad[b]: its real entries
    come first (the tail repeats the last entry; the caller masks it)."""
    seq = x.shape[axis]
    idx = jnp.minimum(jnp.arange(seq)[None] + pad[:, None], seq - 1)  # [batch, seq]
    idx = idx.reshape(idx.shape[:1] + (1,) * (axis - 1) + (seq,) + (1,) * (x.ndim - axis - 1))
    return jnp.take_along_axis(x, idx, axis=axis)


def _as_written(x: jax.Array, cache: KVCache) -> jax.Array:
    """A block of keys or values as the cache stores it (`stored`), in row-major layout where the target pins the
    cache's layout (`Target.pins_cache_layout`: XLA:TPU lays the projected prompt out with the head axis minor,
    and would otherwise build the whole cache in that layout and copy it once to the decode loop's)."""
    x = stored(x, cache)
    if cache.target is not None and cache.target.pins_cache_layout:
        x = with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))
    return x


def write_prompt(cache: KVCache, layer, k: jax.Array, v: jax.Array, q: jax.Array, token_mask: jax.Array) -> KVCache:
    """Write one layer of a left-padded prompt into an empty cache (after `start_prompt`): row b's real tokens
    go to slots [0, P_b) (its padding is dropped), the queries of its newest `window` real tokens to the ring.

    k, v: [batch, kv_heads, seq, head_dim]; q: [batch, kv_heads, group, seq, head_dim]; token_mask [batch, seq].
    """
    pad = left_padding(token_mask)  # [batch]
    new = cache.replace(
        k=jax.lax.dynamic_update_slice(cache.k, _as_written(unpad(k, pad, 2)[None], cache), (layer, 0, 0, 0, 0)),
        v=jax.lax.dynamic_update_slice(cache.v, _as_written(unpad(v, pad, 2)[None], cache), (layer, 0, 0, 0, 0)),
    )
    return write_query_ring(new, layer, q, token_mask)


def write_query_ring(cache: KVCache, layer, q: jax.Array, token_mask: jax.Array) -> KVCache:
    """The prompt's part of `write_prompt` for the query ring (a no-op without one): the queries of each row's
    newest `window` real tokens. q: [batch, kv_heads, group, seq, head_dim]; token_mask [batch, seq]."""
    if not cache.window:
        return cache
    pad = left_padding(token_mask)  # [batch]
    t = q.shape[3]
    t_r = ring_times(t - pad, cache.window)  # [batch, window] real-token times
    src = jnp.clip(t_r + pad[:, None], 0, t - 1)  # their columns in the padded prompt
    ring = jnp.take_along_axis(q, src[:, None, None, :, None], axis=3)  # [batch, kv_heads, group, window, d]
    ring = jnp.where((t_r >= 0)[:, None, None, :, None], ring, 0)
    return cache.replace(queries=jax.lax.dynamic_update_slice(cache.queries, stored(ring[None], cache),
                                                              (layer, 0, 0, 0, 0, 0)))


def write_chunk(cache: KVCache, layer, k: jax.Array, v: jax.Array, q: jax.Array, start) -> KVCache:
    """Write one layer of a chunk of an unpadded prompt: k, v [batch, kv_heads, C, head_dim] to slots [start,
    start + C) (slots past the capacity dropped; a row's slots past its prompt keep pos -1 and are never read),
    and the queries q [batch, kv_heads, group, C, head_dim] of the row's newest `window` prompt tokens that fall
    in the chunk to the ring (as `write_query_ring` puts them)."""
    c = k.shape[2]
    slots = start + jnp.arange(c)

    def put(x, block):  # x [layers, batch, kv_heads, capacity, d] <- block [batch, kv_heads, C, d] at `slots`
        return x.at[layer, :, :, slots].set(jnp.moveaxis(stored(block, cache), 2, 0), mode="drop")

    cache = cache.replace(k=put(cache.k, k), v=put(cache.v, v))
    if not cache.window:
        return cache
    t_r = ring_times(cache.prompt_length, cache.window)  # [batch, window] the ring's real-token times
    column = t_r - start  # their columns in the chunk
    hit = (t_r >= 0) & (column >= 0) & (column < c)
    ring = jnp.take_along_axis(q, jnp.clip(column, 0, c - 1)[:, None, None, :, None], axis=3)  # [b, h, g, W, d]
    old = layer_of(cache.queries, layer)
    ring = jnp.where(hit[:, None, None, :, None], stored(ring, cache), old)
    return cache.replace(queries=jax.lax.dynamic_update_index_in_dim(cache.queries, ring, layer, axis=0))


def start_prompt(cache: KVCache, token_mask: jax.Array) -> KVCache:
    """Before a prompt of `token_mask` [batch, seq] is written: slot j of row b holds position j for j < P_b
    (every layer; -1 beyond), the query ring's validity and the per-row counters (length = seen = row_pos = P_b)."""
    t = token_mask.shape[1]
    real = token_mask.sum(axis=1).astype(jnp.int32)  # [batch]
    slot = jnp.arange(t, dtype=jnp.int32)
    positions = jnp.where(slot[None] < real[:, None], slot[None], -1)  # [batch, seq]
    pos = jnp.broadcast_to(positions[None, :, None, :], cache.pos.shape[:3] + (t,))  # [layers, batch, kv_heads, seq]
    return cache.replace(pos=jax.lax.dynamic_update_slice(cache.pos, pos, (0, 0, 0, 0)),
                         query_valid=ring_times(real, cache.window) >= 0, row_pos=real, length=real, seen=real,
                         prompt_length=real, evictions=jnp.zeros_like(real), active=jnp.ones(real.shape, bool))


def _write_slots(cache: KVCache) -> jax.Array:
    """[batch] the slot each row's token of this step goes to: length - 1 (after `start_token`), or the
    out-of-range `capacity` for an inactive row (the scatter drops it)."""
    return jnp.where(cache.active, cache.length - 1, cache.capacity)


def write_token(cache: KVCache, layer, k: jax.Array, v: jax.Array, q: jax.Array) -> KVCache:
    """Write one token per active row of one layer at slot `length[b] - 1` (after `start_token`), in place.

    k, v: [batch, kv_heads, 1, head_dim]; q: [batch, kv_heads, group, 1, head_dim] (into the query ring, if any).
    Each (row, kv head) is its own scatter index, so an update is one head_dim vector: XLA:TPU then keeps the
    cache in its own layout (with [kv_heads, head_dim] updates it moved the kv-head axis minor and copied the
    whole cache at every step to and from that layout).
    """
    b, h = k.shape[:2]
    rows, heads = jnp.arange(b)[:, None], jnp.arange(h)[None, :]  # [batch, 1], [1, kv_heads]
    slot = _write_slots(cache)[:, None]  # [batch, 1]
    new = cache.replace(
        k=cache.k.at[layer, rows, heads, slot].set(stored(k[:, :, 0], cache), mode="drop"),
        v=cache.v.at[layer, rows, heads, slot].set(stored(v[:, :, 0], cache), mode="drop"),
    )
    if cache.window:
        ring_slot = jnp.where(cache.active, (cache.row_pos - 1) % cache.window, cache.window)  # [batch]
        groups = jnp.arange(q.shape[2])[None, None, :]
        new = new.replace(queries=cache.queries.at[layer, rows[..., None], heads[..., None], groups,
                                                   ring_slot[:, None, None]].set(stored(q[:, :, :, 0], cache),
                                                                                 mode="drop"))
    return new


def start_token(cache: KVCache) -> KVCache:
    """Before one token per active row is written: its position at slot `length[b]` in every layer (the same
    for all layers, so written once, before any layer reads `pos`), the query ring's validity and the counters.
    Inactive rows (`active` False) are left as they are. One scatter index per (layer, row, kv head), as in
    `write_token`."""
    l, b, h, _ = cache.pos.shape
    layers, rows, heads = jnp.arange(l)[:, None, None], jnp.arange(b)[None, :, None], jnp.arange(h)[None, None, :]
    slot = jnp.where(cache.active, cache.length, cache.capacity)[None, :, None]  # [1, batch, 1]; out of range: dropped
    new_pos = jnp.broadcast_to(cache.row_pos[None, :, None], (l, b, h)).astype(jnp.int32)  # [layers, batch, heads]
    pos = cache.pos.at[layers, rows, heads, slot].set(new_pos, mode="drop")
    query_valid = cache.query_valid
    if cache.window:
        ring_slot = jnp.where(cache.active, cache.row_pos % cache.window, cache.window)
        query_valid = query_valid.at[jnp.arange(b), ring_slot].set(True, mode="drop")
    step = cache.active.astype(jnp.int32)
    return cache.replace(pos=pos, query_valid=query_valid, row_pos=cache.row_pos + step,
                         length=cache.length + step, seen=cache.seen + step)


def ordered_queries(cache: KVCache, layer) -> tuple[jax.Array, jax.Array]:
    """The ring of `layer` rolled per row so the oldest query comes first: ([b, kv_heads, group, window, d],
    [b, window])."""
    w = cache.window
    order = (cache.row_pos[:, None] + jnp.arange(w)) % w  # [batch, window], oldest ring slot first
    ring = from_bits(layer_of(cache.queries, layer), cache.float_dtype)
    return (jnp.take_along_axis(ring, order[:, None, None, :, None], axis=3),
            jnp.take_along_axis(cache.query_valid, order, axis=1))


def _scaled_weights(q: jax.Array, k: jax.Array) -> jax.Array:
    """Attention logits in float32, q [b, h, g, ..., d] against k [b, h, slots, d] -> [b, h, g, ..., slots]."""
    return jnp.einsum("bhg...d,bhkd->bhg...k", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5


def decode_slot_weights(q: jax.Array, k: jax.Array, pos: jax.Array, length: jax.Array) -> jax.Array:
    """Each slot's decode-attention weight summed over the query group: float32 [batch, kv_heads, capacity].

        w[b, h, j] = sum_g softmax_{j live}(q[b, h, g] . k[b, h, j] / sqrt(D)),   live: pos >= 0 and j < length

    q: [batch, kv_heads, group, head_dim]; k: one layer [batch, kv_heads, capacity, head_dim]; pos [b, h, capacity];
    length [batch].
    The same weights as the decode attention (which returns only its output), recomputed over the whole layer:
    the cost follows the capacity, paid only by policies with per-slot state.
    """
    live = (pos >= 0) & (jnp.arange(k.shape[2]) < length[:, None, None])  # [b, h, capacity]
    logits = jnp.where(live[:, :, None], _scaled_weights(q, k), -jnp.inf)  # [b, h, g, capacity]
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.where(live, probs.sum(axis=2), 0.0)


def update_state(cache: KVCache, layer, q: jax.Array) -> KVCache:
    """After a decode step's write (`write_token`): state <- spec.update(state, w) for every per-slot state array
    of `layer`, w = `decode_slot_weights` of the query q [batch, kv_heads, group, head_dim]. Inactive rows keep
    their state."""
    k = cache.layer_keys(layer)
    pos = layer_of(cache.pos, layer)
    w = decode_slot_weights(q, k, pos, cache.length)  # [b, h, capacity]
    return apply_state(cache, layer, w, cache.active)


def prefill_state(cache: KVCache, layer, slot_weights: jax.Array, token_mask: jax.Array) -> KVCache:
    """After a prompt's write: state of slots [0, seq) <- spec.update(0, w), w = `slot_weights` [batch, kv_heads,
    seq], the prompt's causal attention weights of each key summed over the query group and the queries
    (padding columns 0), unpadded like the keys (`write_prompt`)."""
    pad = left_padding(token_mask)  # [batch]
    w = unpad(slot_weights, pad, 2)  # [b, h, seq], real slots first
    real = jnp.arange(w.shape[2])[None] < (w.shape[2] - pad)[:, None]  # [b, seq]
    return apply_state(cache, layer, jnp.where(real[:, None], w, 0.0), None)


def apply_state(cache: KVCache, layer, w: jax.Array, rows) -> KVCache:
    """state[layer] <- update(old, w) on the `rows` [batch] bool, w [b, h, capacity]; rows None: slots [0, n)
    <- update(0, w) with w [b, h, n]."""
    new = {}
    for spec in cache.state_specs:
        x = cache.state[spec.name]
        if rows is None:
            value = spec.update(jnp.zeros(w.shape, jnp.float32), w).astype(jnp.float32)
        else:
            old = jax.lax.dynamic_index_in_dim(x, layer, axis=0, keepdims=False)
            value = jnp.where(rows[:, None, None], spec.update(old, w).astype(jnp.float32), old)
        new[spec.name] = jax.lax.dynamic_update_slice(x, value[None], (layer, 0, 0, 0))  # value [b, h, n]
    return cache.replace(state=new)


def batch_axis(name: str) -> int:
    """The "batch" axis of cache array `name` (a `CACHE_AXES` name, or "state" for a per-slot state array)."""
    return (CACHE_AXES.get(name) or STATE_AXES).index("batch")


def first_rows(cache: KVCache, n: int) -> KVCache:
    """The cache of rows [0, n) (every array sliced along its "batch" axis)."""
    fields = {name: jax.lax.slice_in_dim(getattr(cache, name), 0, n, axis=batch_axis(name)) for name in CACHE_AXES}
    state = {name: jax.lax.slice_in_dim(x, 0, n, axis=batch_axis("state")) for name, x in cache.state.items()}
    return cache.replace(**fields, state=state)


def cache_bytes(cache: KVCache) -> int:
    """Bytes held by the cache arrays (static: depends only on shapes and dtypes)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
