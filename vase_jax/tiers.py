"""The mixed-precision KV cache: each layer's slots in a 16-bit tier and a quantized tier.

Layout (static shapes, per layer, row and kv head): the 16-bit tier is the cache's usual `k`, `v`, `pos` with
F = P + 2B slots (rounded up to the attention block): P protected slots, then the B recent slots kept at the last
tick and the B written since. The quantized tier (`kq`, `vq`: `kvquant.Quantized`, `qpos`) holds the other Q
slots, each token's codes packed with one `scale` and `low` per group of channels. The virtual slot index that
the eviction policies see runs over both tiers, the 16-bit tier's F slots first: `state` and `value_range` are
laid out over it. `length` counts the 16-bit tier's slots in use (a decode step writes at `length - 1`, as in a
16-bit cache) and `qlength` the quantized tier's.

Ticks: every row, at every step where its own count of real tokens `seen` is a multiple of B (the eviction
framework's period; `full` gets the same phase alignment), re-tiers its cache, one layer at a time:

    candidates S  = the live slots of both tiers but the newest B (16-bit slots [length - B, length))
    kept          = policy(S) when the row's eviction trigger fires (seen > N), else all of S (a flush)
    16-bit part   = the P kept slots still in 16 bits with the largest protection score: Range(v) recorded
                    from the 16-bit value at write, with the sinks (the `sink_slots` smallest positions) at
                    +inf where the method forces them (VaSE-AttnV) and without eviction
    16-bit tier  <- [16-bit part (P slots, in kept order; empty slots last) | the newest B | free]
    quantized    <- every other kept slot: its codes if it was quantized, else quantized now (once)

so a token is quantized at most once and never returns to 16 bits. A quantized token's recorded Range is lowered
by one ulp, so that at equal Range a 16-bit token ranks first: then the P 16-bit slots always rank above every
quantized one, and a policy that keeps its top-Nv Range slots (P <= Nv) always keeps P slots in 16 bits; the
16-bit part never has to take a quantized slot (`overflow` counts it, and tests hold it at 0). Methods that do not
protect Range get P = 0 with eviction (every kept slot quantized, the newest B in 16 bits).

After the prefill the prompt is tiered the same way with the newest r = P_b mod B prompt tokens as the recent
slots (the row's next tick comes B - r tokens later, when they and the decoded tokens are its newest B).

Capacities: V = the 16-bit cache's slot count (`max(P_b, N) + B` with eviction, `P_b + max_new_tokens` without),
F = P + 2B and Q = max(V - P - B, P_b - P) (right after a tick the 16-bit tier holds P + B of the tokens), each
rounded up to the attention block.

Decode attention: on the XLA path one loop over the 16-bit tier's blocks, then the quantized tier's
(`quant_attention.segments_partials`: scales folded into the einsums, no dequantized copy, one online softmax);
the kernels read each tier on its own and their partials are merged by log-sum-exp. Eviction scoring sees
dequantized keys and values, one layer at a time, and Range from `value_range`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels import get_decode_partials, get_layout_pin, get_quant_decode_partials, select
from pallas_kernels.decode_attention import DEFAULT_BLOCK_SIZE
from vase_jax.cache import (
    CACHE_AXES,
    CacheLayout,
    KVCache,
    SlotView,
    apply_state,
    as_bits,
    decode_slot_weights,
    from_bits,
    init_cache,
    layer_of,
    left_padding,
    pad_axis,
    put_row,
    ring_times,
    row_fields,
    stored,
    unpad,
    write_query_ring,
)
from vase_jax.cache import write_token as write_16
from vase_jax.config import Qwen3Config
from vase_jax.eviction import scores
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import METHODS
from vase_jax.kvquant import KVBits, Quantized, dequantize, quantize, slots_first, slots_last, split_kept
from vase_jax.quant_attention import merge, quantized_partials_of_arrays, tiered_attention
from vase_jax.target import Target

# Methods whose kept set always holds their top-Nv Range candidates (with eviction, P <= Nv slots stay in 16
# bits), and whether they force the sinks into that set.
RANGE_PROTECTING = {"range_attn": False, "range_sample_attn": False, "vase_attnv": True}


def _align(n: int) -> int:
    return -(-n // DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE


@dataclasses.dataclass(frozen=True)
class TierLayout:
    """The static sizes of a mixed-precision cache (module docstring)."""

    kv_bits: KVBits
    protected: int  # P: 16-bit slots kept for their Range (sinks included)
    buffer: int  # B: the recent slots and the tick period
    sink_slots: int  # forced into the 16-bit part when `force_sinks`
    force_sinks: bool
    full_slots: int  # F
    quant_slots: int  # Q

    @property
    def virtual_slots(self) -> int:
        return self.full_slots + self.quant_slots

    @property
    def slots(self) -> int:
        """The slots the eviction policies see per (layer, row, kv head): the virtual slots of both tiers."""
        return self.virtual_slots

    def for_prompts(self, prompt_slots: int) -> TierLayout:
        """The layout of a cache that only holds prompts of `prompt_slots` (the continuous engine's staging):
        P_b - P quantized slots at most."""
        return dataclasses.replace(self, quant_slots=_align(max(prompt_slots - self.protected, 0)))

    def init(self, cfg: Qwen3Config, batch: int, window: int, dtype, state: tuple = (),
             target: Target | None = None) -> TieredCache:
        """An empty cache of this layout (`init_tiered_cache`)."""
        return init_tiered_cache(cfg, batch, self, window, dtype, state, target)

    def chunk_staging(self, prompt_slots: int) -> CacheLayout:
        """The layout a chunked prefill writes the prompt into: a 16-bit cache of the prompt's slots (the chunks
        attend to the prompt's keys in 16 bits, as the dense prefill does; `from_chunks` then tiers them)."""
        return CacheLayout(prompt_slots)

    def from_chunks(self, staged: KVCache, token_mask: jax.Array, cfg: Qwen3Config) -> TieredCache:
        """The tiered cache of a prompt prefilled in chunks into the 16-bit `staged` (unpadded; its state the
        prompt's summed attention weights): each layer tiered as `write_prompt` tiers a dense prefill's keys and
        values, the query ring copied."""
        cache = self.init(cfg, token_mask.shape[0], staged.window, staged.float_dtype, staged.state_specs,
                          staged.target).start_prompt(token_mask)
        seq = token_mask.shape[1]
        pad = left_padding(token_mask)  # [batch]
        column = jnp.clip(jnp.arange(seq)[None] - pad[:, None], 0, seq - 1)  # [batch, seq]

        def left_padded(x):  # [batch, kv_heads, slots, ...] unpadded -> [batch, kv_heads, seq, ...] left-padded
            index = column.reshape(column.shape[:1] + (1,) + column.shape[1:] + (1,) * (x.ndim - 3))
            return jnp.take_along_axis(x[:, :, :seq], index, axis=2)

        sums = next(iter(staged.state.values()), None)  # every state array holds the same sums

        def one_layer(layer, cache):
            weights = None if sums is None else left_padded(layer_of(sums, layer))
            return tier_prompt(cache, layer, left_padded(staged.layer_keys(layer)),
                               left_padded(staged.layer_values(layer)), token_mask, weights)

        cache = jax.lax.fori_loop(0, cfg.num_layers, one_layer, cache)
        return cache.replace(queries=staged.queries)


def protects_range(eviction: EvictionConfig) -> bool:
    """Whether the method keeps its top-Nv Range candidates at every eviction (so P <= Nv may stay 16-bit)."""
    if eviction.method not in RANGE_PROTECTING:
        return False
    return getattr(eviction.options, "magnitude", "range") == "range"


def default_protected(eviction: EvictionConfig, virtual_slots: int) -> int:
    """P when the caller gives none: VaSE's Nv with a Range-protecting method, 0 with another evicting method,
    a quarter of the cache without eviction."""
    if not eviction.evicts:
        return virtual_slots // 4
    return eviction.num_value_slots if protects_range(eviction) else 0


def check_protected(protected: int, eviction: EvictionConfig, virtual_slots: int) -> None:
    """ValueError naming `kv_protected` when P cannot be kept in 16 bits by this method."""
    if isinstance(protected, bool) or not isinstance(protected, int) or protected < 0:
        raise ValueError(f"GenerateConfig.kv_protected={protected!r} must be a non-negative int (or None)")
    if not eviction.evicts:
        if protected > virtual_slots:
            raise ValueError(f"GenerateConfig.kv_protected={protected} exceeds the cache's {virtual_slots} slots")
        return
    if protected and not protects_range(eviction):
        raise ValueError(
            f"GenerateConfig.kv_protected={protected} with method {eviction.method!r}: only methods that keep "
            f"their top-Nv Range slots ({', '.join(sorted(RANGE_PROTECTING))}, magnitude 'range') keep slots in "
            "16 bits under eviction; use kv_protected=0 (or None)")
    if protected > eviction.num_value_slots:
        raise ValueError(f"GenerateConfig.kv_protected={protected} must be <= the method's value_slots Nv = "
                         f"{eviction.num_value_slots}")


def tier_layout(kv_bits: KVBits, protected: int | None, eviction: EvictionConfig, prompt_slots: int,
                max_new_tokens: int) -> TierLayout:
    """The layout of a mixed-precision cache for these settings (validated; ValueError naming the parameter)."""
    buffer = eviction.buffer
    if buffer < 1:
        raise ValueError(f"EvictionConfig.buffer={buffer} must be >= 1 (the mixed-precision cache's period)")
    if eviction.evicts and not METHODS[eviction.method].mixed_precision:
        raise ValueError(f"EvictionConfig.method={eviction.method!r} does not run on the mixed-precision cache "
                         f"(key_bits={kv_bits.key_bits}, value_bits={kv_bits.value_bits}); use 16 and 16")
    virtual = (max(prompt_slots, eviction.budget) + buffer if eviction.evicts
               else prompt_slots + max_new_tokens)
    p = default_protected(eviction, virtual) if protected is None else protected
    check_protected(p, eviction, virtual)
    force = (not eviction.evicts) or RANGE_PROTECTING.get(eviction.method, False)
    # Right after a tick the 16-bit tier holds the P and the newest B, after the prefill the P and r >= 0.
    quant = max(virtual - p - buffer, prompt_slots - p, 0)
    return TierLayout(kv_bits=kv_bits, protected=p, buffer=buffer, sink_slots=eviction.sink_slots if p else 0,
                      force_sinks=force and p > 0, full_slots=_align(p + 2 * buffer),
                      quant_slots=_align(max(quant, 1)))  # at least one block: no zero-size arrays


@struct.dataclass(kw_only=True)
class TieredCache(KVCache):
    """A mixed-precision cache (module docstring): `k`, `v`, `pos` (and the counters) are the 16-bit tier, as in
    a `KVCache`; the fields below the quantized tier. `state` and `value_range` run over the virtual slots (the
    16-bit tier's F, then the quantized tier's Q). The interface is `KVCache`'s: the methods below are this
    cache's own, the others (`start_token`, `layer_keys`, `as_floats`...) act on the 16-bit tier."""

    # codes [layers, batch, kv_heads, quant_slots, bytes]; scale and low group-major (`kvquant.slots_last`)
    # [layers, batch, kv_heads, groups, quant_slots]
    kq: Quantized
    vq: Quantized
    qpos: jax.Array  # [layers, batch, kv_heads, quant_slots] int32, -1 = empty
    qlength: jax.Array  # [batch] int32: quantized slots in use
    value_range: jax.Array  # [layers, batch, kv_heads, virtual slots] f32: Range(v) at write
    layout: TierLayout = struct.field(pytree_node=False)

    def axes(self) -> dict:
        """`KVCache.axes` and the quantized tier's: per (layer, row, kv head) like the 16-bit tier, so that a mesh
        splits both tiers of a row and head onto the same device."""
        lead = ("layers", "batch", "kv_heads")

        def quantized(x: Quantized) -> Quantized:  # codes [.., slots, bytes]; scale, low [.., groups, slots]
            return x.replace(codes=lead + ("slots", "bytes"), scale=lead + ("groups", "slots"),
                             low=lead + ("groups", "slots"))

        return CACHE_AXES | {"kq": quantized(self.kq), "vq": quantized(self.vq), "qpos": lead + ("slots",),
                             "qlength": ("batch",), "value_range": lead + ("slots",)}

    def start_prompt(self, token_mask: jax.Array) -> TieredCache:
        return start_prompt(self, token_mask)

    def write_prompt(self, layer, k: jax.Array, v: jax.Array, q: jax.Array, token_mask: jax.Array,
                     slot_weights: jax.Array | None = None) -> TieredCache:
        return write_prompt(self, layer, k, v, q, token_mask, slot_weights)

    def first_slots(self, slots: int):
        raise NotImplementedError("prompt compression keeps a 16-bit cache (EvictionConfig.compress_prompt with a "
                                  "mixed-precision cache is refused by generate)")

    def attend_chunk(self, layer, k, v, q, start):
        raise NotImplementedError("a mixed-precision cache is prefilled in chunks through a 16-bit cache "
                                  "(TierLayout.chunk_staging, from_chunks)")

    def attend_token(self, layer, k: jax.Array, v: jax.Array, q: jax.Array,
                     attention_impl: str = "auto") -> tuple[jax.Array, TieredCache]:
        cache = write_token(self, layer, k, v, q)
        out = decode_attention(q[:, :, :, 0], cache, layer, attention_impl)[:, :, :, None]
        if cache.state:
            cache = update_state(cache, layer, q[:, :, :, 0])
        return out, cache

    @property
    def slot_count(self) -> int:
        return self.layout.virtual_slots

    @property
    def kv_stacks(self) -> tuple[jax.Array, ...]:
        return (self.k, self.v, *jax.tree.leaves((self.kq, self.vq)))

    def has_events(self, eviction: EvictionConfig) -> bool:
        return True  # ticks every B steps, with or without eviction

    def rows_due(self, eviction: EvictionConfig) -> jax.Array:
        """[batch] bool: the rows at a tick after this step (they took a token and `seen` is a multiple of B)."""
        return self.active & (self.seen % self.layout.buffer == 0)

    def phase_wait(self, seen, step, eviction: EvictionConfig):
        """The wait that puts the row's ticks (every B steps, with or without eviction) on the batch's:
        (seen - step) mod B."""
        return (seen - step) % self.layout.buffer

    def flush(self, rows: jax.Array, attention_impl: str = "auto") -> TieredCache:
        return flush(self, rows, attention_impl)

    def pinned(self, attention_impl: str = "auto") -> TieredCache:
        return pinned(self, attention_impl)

    def candidates(self, layer, recent: int) -> SlotView:
        return candidates(self, layer, recent)

    def keep(self, layer, view: SlotView, kept: jax.Array, rows: jax.Array,
             eviction: EvictionConfig) -> TieredCache:
        return keep(self, layer, view, kept, rows)

    def evicted(self, rows: jax.Array, eviction: EvictionConfig) -> TieredCache:
        """The counters after the eviction of the `rows`: the 16-bit tier holds P + B, the quantized tier the
        K - P other kept slots; N seen, one more event."""
        p, b_ = self.layout.protected, self.layout.buffer
        return self.replace(length=jnp.where(rows, p + b_, self.length),
                            qlength=jnp.where(rows, eviction.kept - p, self.qlength),
                            seen=jnp.where(rows, eviction.budget, self.seen),
                            evictions=self.evictions + rows.astype(jnp.int32))

    def take_row(self, j, like: TieredCache) -> TieredCache:
        """Row `j` with the slots of `like`: each tier, and the virtual slots' arrays, padded at its end."""
        def tier(x, size, fill, slot_axis=3):
            return pad_axis(jax.lax.dynamic_slice_in_dim(x, j, 1, 1), slot_axis, size, fill)

        def quantized(x, y):  # codes [.., slots, bytes]; scale and low group-major [.., groups, slots]
            return x.replace(codes=tier(x.codes, y.codes.shape[3], 0), scale=tier(x.scale, y.scale.shape[4], 0, 4),
                             low=tier(x.low, y.low.shape[4], 0, 4))

        virtual = like.value_range.shape[3]
        return self.replace(
            **row_fields(self, j, like.capacity), kq=quantized(self.kq, like.kq), vq=quantized(self.vq, like.vq),
            qpos=tier(self.qpos, like.qpos.shape[3], -1), value_range=tier(self.value_range, virtual, 0),
            qlength=jax.lax.dynamic_slice_in_dim(self.qlength, j, 1), layout=like.layout,
            state={name: tier(x, virtual, 0) for name, x in self.state.items()})

    def put_row(self, one: TieredCache, row) -> TieredCache:
        new = KVCache.put_row(self, one, row)
        tiers = {name: jax.tree.map(lambda x, y: put_row(x, y, row, 1), getattr(self, name), getattr(one, name))
                 for name in ("kq", "vq", "qpos", "value_range")}
        return new.replace(**tiers, qlength=put_row(self.qlength, one.qlength, row, 0))


# ---- storage -------------------------------------------------------------------------------------------------
def _quantize(x: jax.Array, tiers: TierLayout, which: str, cache_dtype, bits_storage: bool) -> Quantized:
    """x [..., D] in the cache's float dtype -> the quantized tier's storage of one side."""
    kv = tiers.kv_bits
    q = quantize(x, kv.bits(which), kv.group(which), refine=kv.refine, scale_dtype=cache_dtype)
    if q.bits == 16 and bits_storage:
        q = q.replace(codes=as_bits(x.astype(cache_dtype)))
    return q


def _dequantize(x: Quantized, dtype) -> jax.Array:
    """A quantized tier's codes [..., D] back to floats (`dtype`)."""
    if x.bits == 16:
        return from_bits(x.codes, dtype).astype(dtype)
    return dequantize(x, dtype)


def init_tiered_cache(cfg: Qwen3Config, batch: int, tiers: TierLayout, window: int, dtype, state: tuple = (),
                      target: Target | None = None) -> TieredCache:
    """An empty mixed-precision cache (`cache.init_cache` for the 16-bit tier, plus the quantized tier)."""
    cache = init_cache(cfg, batch, tiers.full_slots, window, dtype, (), target)
    lead = (cfg.num_layers, batch, cfg.num_kv_heads, tiers.quant_slots)
    zeros = jnp.zeros(lead + (cfg.head_dim,), dtype)
    bits_storage = cache.k.dtype == jnp.uint16
    # stored with the scales group-major (`kvquant.slots_last`)
    kq = slots_last(jax.tree.map(jnp.zeros_like, _quantize(zeros, tiers, "key", dtype, bits_storage)))
    vq = slots_last(jax.tree.map(jnp.zeros_like, _quantize(zeros, tiers, "value", dtype, bits_storage)))
    virtual = lead[:3] + (tiers.virtual_slots,)
    fields = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}
    return TieredCache(**fields | dict(
        kq=kq, vq=vq, qpos=jnp.full(lead, -1, jnp.int32), qlength=jnp.zeros((batch,), jnp.int32),
        value_range=jnp.zeros(virtual, jnp.float32), layout=tiers, state_specs=tuple(state),
        state={spec.name: jnp.zeros(virtual, jnp.float32) for spec in state}))


def _layer_quantized(x: Quantized, layer) -> Quantized:
    """One layer of a stored quantized tier as tokens: codes [b, h, Q, bytes], scale and low [b, h, Q, groups]."""
    return slots_first(jax.tree.map(lambda a: layer_of(a, layer), x))


def _set_layer(stack: jax.Array, layer, value: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stack, value.astype(stack.dtype), layer, axis=0)


def _gather(x: jax.Array, src: jax.Array) -> jax.Array:
    """x [b, h, S, ...] at slots src [b, h, T] (clipped into range) -> [b, h, T, ...]."""
    idx = jnp.clip(src, 0, x.shape[2] - 1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 3)), axis=2)


def _lower(r: jax.Array) -> jax.Array:
    """Range one ulp lower: a quantized token ranks after a 16-bit one of equal Range."""
    return jnp.nextafter(r, jnp.float32(-jnp.inf))


def value_range(v: jax.Array) -> jax.Array:
    """Range(v) = max_c v - min_c v in float32: v [..., D] -> [...]."""
    return scores.value_magnitude(v, "range")


def _protection(rng: jax.Array, pos: jax.Array, tiers: TierLayout) -> jax.Array:
    """The 16-bit part's ranking score [b, h, S]: Range, the sinks at +inf where forced."""
    if tiers.force_sinks:
        return jnp.where(scores.sink_mask(pos, tiers.sink_slots), jnp.inf, rng)
    return rng


def _top_in_order(score: jax.Array, eligible: jax.Array, p: int) -> tuple[jax.Array, jax.Array]:
    """The p eligible slots of largest score, in slot order: (idx [b, h, p], valid [b, h, p])."""
    n = score.shape[-1]
    if p == 0:
        return jnp.zeros(score.shape[:-1] + (0,), jnp.int32), jnp.zeros(score.shape[:-1] + (0,), bool)
    take = min(p, n)
    top = scores.masked_top_k(score, eligible, take)  # [b, h, take]
    ok = jnp.take_along_axis(eligible, top, axis=-1)
    top = jnp.sort(jnp.where(ok, top, n + top), axis=-1)  # eligible first, in slot order
    ok = top < n
    top = jnp.where(ok, top, -1)
    if take < p:
        pad = [(0, 0)] * (top.ndim - 1) + [(0, p - take)]
        top, ok = jnp.pad(top, pad, constant_values=-1), jnp.pad(ok, pad)
    return top, ok


def _rest_in_order(eligible: jax.Array, chosen: jax.Array, size: int) -> jax.Array:
    """The eligible slots not `chosen` ([b, h, S] bool each), in slot order, as [b, h, size] (-1 past them)."""
    n = eligible.shape[-1]
    rest = eligible & ~chosen
    order = jnp.argsort(~rest, axis=-1, stable=True)[..., :min(size, n)]  # the rest first, in slot order
    order = jnp.where(jnp.take_along_axis(rest, order, axis=-1), order, -1)
    if size > n:
        order = jnp.pad(order, [(0, 0)] * (order.ndim - 1) + [(0, size - n)], constant_values=-1)
    return order.astype(jnp.int32)


def _scatter_mask(idx: jax.Array, n: int) -> jax.Array:
    """[b, h, n] bool: the slots named in idx [b, h, k] (-1 ignored)."""
    hit = jnp.zeros(idx.shape[:-1] + (n + 1,), bool)
    hit = jnp.put_along_axis(hit, jnp.where(idx < 0, n, idx), True, axis=-1, inplace=False)
    return hit[..., :n]


def pinned(cache: KVCache, attention_impl: str = "auto") -> KVCache:
    """The cache, with its quantized tier's stacks and its per-slot arrays (`pos`, `qpos`, `value_range`, the
    policy state) held in the layout the decode kernels read where the program is lowered for TPU
    (`pallas_kernels.get_layout_pin`; elsewhere the cache itself). The ticks' loops over layers start and end their
    bodies with it, so XLA:TPU never gives their carried stacks a layout of their own and copies them whole around
    the loops at every decode step (the loops run at every step, zero times between ticks). Unpinned, the per-slot
    arrays were carried with rows and heads swapped when a batch has as many rows as kv heads. The
    prefill's loop is not pinned: its stacks are relaid once per call, which costs less memory than the pinned
    prefill's temporaries."""
    pin = get_layout_pin(attention_impl)
    return cache.replace(kq=jax.tree.map(pin, cache.kq), vq=jax.tree.map(pin, cache.vq), pos=pin(cache.pos),
                         qpos=pin(cache.qpos), value_range=pin(cache.value_range),
                         state={name: pin(x) for name, x in cache.state.items()})


# ---- writing the tiers of one layer -----------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Sources:
    """The contents new slots are taken from, for one layer: `keys`, `values` [b, h, S, D] floats, `pos`,
    `value_range` [b, h, S], `state` name -> [b, h, S] (S source slots), and `old_codes`: the quantized tier's
    (kq, vq) of this layer, or None."""

    keys: jax.Array
    values: jax.Array
    pos: jax.Array
    value_range: jax.Array
    state: dict
    old_codes: tuple | None


def _write_layer(cache: KVCache, layer, src: Sources, src16: jax.Array, srcq: jax.Array, fresh: jax.Array,
                 rows: jax.Array | None, most_fresh: int | None = None) -> KVCache:
    """Rewrite layer `layer` of both tiers.

    src16 [b, h, F]: the source slot of each 16-bit slot (-1: empty); srcq [b, h, Q]: of each quantized slot, a
    source slot where `fresh` [b, h, Q] (quantized now from the source's 16-bit value), else a slot of the old
    quantized tier whose codes it keeps (`src.old_codes`), or -1 (empty). rows [batch] bool: the rows rewritten
    (None: all; the others keep their layer as it is). `most_fresh`: a bound on the fresh slots of a (row, kv
    head) (None: Q); only that many tokens are quantized, gathered in slot order and scattered to their slots.
    """
    t = cache.layout
    f = t.full_slots
    dtype = cache.float_dtype
    bits_storage = cache.k.dtype == jnp.uint16

    def keep(new, old):
        if rows is None:
            return new
        return jnp.where(rows.reshape(rows.shape + (1,) * (new.ndim - 1)), new, old)

    def set_layer(stack, value):
        return _set_layer(stack, layer, keep(value, layer_of(stack, layer)))

    ok16 = src16 >= 0
    okq = srcq >= 0
    old_q = okq & ~fresh
    k16 = jnp.where(ok16[..., None], _gather(src.keys, src16), 0).astype(dtype)  # [b, h, F, D]
    v16 = jnp.where(ok16[..., None], _gather(src.values, src16), 0).astype(dtype)
    new = cache.replace(k=set_layer(cache.k, stored(k16, cache)), v=set_layer(cache.v, stored(v16, cache)),
                        pos=set_layer(cache.pos, jnp.where(ok16, _gather(src.pos, src16), -1)))

    # Per-slot arrays over the virtual slots [16-bit tier | quantized tier]: the old quantized tier's own slots
    # are virtual slots F + i of the old layout, which the caller's `src` arrays cover (`Sources` over V slots).
    fresh_src = jnp.where(fresh, srcq, -1)
    virtual_q = jnp.where(old_q, srcq + (f if src.old_codes is not None else 0), fresh_src)
    vsrc = jnp.concatenate([src16, virtual_q], axis=-1)  # [b, h, V]
    ok = vsrc >= 0
    rng = jnp.where(ok, _gather(src.value_range, vsrc), 0.0)
    rng = jnp.concatenate([rng[..., :f], jnp.where(fresh, _lower(rng[..., f:]), rng[..., f:])], axis=-1)
    new = new.replace(value_range=set_layer(cache.value_range, rng),
                      state={name: set_layer(x, jnp.where(ok, _gather(src.state[name], vsrc), 0.0))
                             for name, x in cache.state.items()})
    if not t.quant_slots:
        return new
    q_slots = t.quant_slots
    m = q_slots if most_fresh is None else min(most_fresh, q_slots)
    if m < q_slots:  # the fresh slots in slot order, compacted: dest [b, h, m] (Q: none)
        b, h = fresh.shape[:2]
        rank = jnp.where(fresh, jnp.cumsum(fresh, axis=-1) - 1, m)  # [b, h, Q]
        dest = jnp.full((b, h, m), q_slots, jnp.int32).at[
            jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None], rank].set(
            jnp.broadcast_to(jnp.arange(q_slots, dtype=jnp.int32), fresh.shape), mode="drop")
        fresh_src = jnp.where(dest < q_slots, _gather(fresh_src, dest), -1)  # [b, h, m]
    ok_fresh = fresh_src >= 0
    kq = _quantize(jnp.where(ok_fresh[..., None], _gather(src.keys, fresh_src), 0).astype(dtype), t, "key", dtype,
                   bits_storage)  # [b, h, m, ...]
    vq = _quantize(jnp.where(ok_fresh[..., None], _gather(src.values, fresh_src), 0).astype(dtype), t, "value",
                   dtype, bits_storage)
    if src.old_codes is not None:  # slots already quantized keep their codes
        def pick(n, o):
            kept = jnp.where(old_q.reshape(old_q.shape + (1,) * (n.ndim - 3)), _gather(o, srcq), 0).astype(n.dtype)
            if m == q_slots:
                return jnp.where(fresh.reshape(fresh.shape + (1,) * (n.ndim - 3)), n, kept)
            bi, hi = jnp.arange(n.shape[0])[:, None, None], jnp.arange(n.shape[1])[None, :, None]
            return kept.at[bi, hi, dest].set(n, mode="drop")  # [b, h, Q, ...]

        kq = jax.tree.map(pick, kq, src.old_codes[0])
        vq = jax.tree.map(pick, vq, src.old_codes[1])
    qpos = jnp.where(okq, _gather(src.pos, virtual_q), -1)
    return new.replace(kq=jax.tree.map(set_layer, cache.kq, slots_last(kq)),
                       vq=jax.tree.map(set_layer, cache.vq, slots_last(vq)), qpos=set_layer(cache.qpos, qpos))


def _sources_16(score: jax.Array, eligible: jax.Array, recent: jax.Array, tiers: TierLayout) -> tuple:
    """(src16 [b, h, F], chosen [b, h, S]): the P eligible slots of largest score in slot order, then `recent`
    [b, B] (-1: none), then empty slots; `chosen` marks the P."""
    b, h, n = score.shape
    top, _ = _top_in_order(score, eligible, tiers.protected)  # [b, h, P]
    src16 = jnp.concatenate([top, jnp.broadcast_to(recent[:, None], (b, h, recent.shape[-1]))], axis=-1)
    src16 = jnp.pad(src16, ((0, 0), (0, 0), (0, tiers.full_slots - src16.shape[-1])), constant_values=-1)
    return src16, _scatter_mask(top, n)


def start_prompt(cache: KVCache, token_mask: jax.Array) -> KVCache:
    """`cache.start_prompt` for a mixed-precision cache: the counters of the tiered prompt (`write_prompt`
    writes the positions per layer)."""
    t = cache.layout
    real = token_mask.sum(axis=1).astype(jnp.int32)  # [batch]
    recent = real % t.buffer
    quantized = jnp.maximum(real - recent - t.protected, 0)
    return cache.replace(query_valid=ring_times(real, cache.window) >= 0, row_pos=real, seen=real,
                         prompt_length=real, length=t.protected + recent, qlength=jnp.minimum(quantized, t.quant_slots),
                         evictions=jnp.zeros_like(real), active=jnp.ones(real.shape, bool))


def write_prompt(cache: KVCache, layer, k: jax.Array, v: jax.Array, q: jax.Array, token_mask: jax.Array,
                 slot_weights: jax.Array | None = None) -> KVCache:
    """Write one layer of a left-padded prompt into an empty mixed-precision cache (after `start_prompt`): its
    keys and values tiered (`tier_prompt`), its newest queries to the ring.

    k, v: [batch, kv_heads, seq, head_dim]; q: [batch, kv_heads, group, seq, head_dim]; token_mask [batch, seq].
    """
    return write_query_ring(tier_prompt(cache, layer, k, v, token_mask, slot_weights), layer, q, token_mask)


def tier_prompt(cache: KVCache, layer, k: jax.Array, v: jax.Array, token_mask: jax.Array,
                slot_weights: jax.Array | None = None) -> KVCache:
    """One layer of a left-padded prompt's keys and values, k, v [batch, kv_heads, seq, head_dim], into an empty
    mixed-precision cache: row b's real tokens but the newest r = P_b mod B are tiered (the P of largest
    protection score in 16 bits, the others quantized, in order), the newest r go to the recent slots.
    `slot_weights` [b, h, seq]: the prompt's attention weights per slot for the per-slot state
    (`cache.prefill_state`'s sums, padded), or None."""
    t = cache.layout
    pad = left_padding(token_mask)  # [batch]
    seq = k.shape[2]
    real = seq - pad  # [batch]
    recent = real % t.buffer
    k_u, v_u = unpad(k, pad, 2), unpad(v, pad, 2)  # [b, h, seq, D], real tokens first
    slot = jnp.arange(seq)
    live = slot[None] < real[:, None]  # [b, seq]
    pos = jnp.broadcast_to(jnp.where(live, slot[None], -1)[:, None], k_u.shape[:3])  # [b, h, seq]
    rng = value_range(v_u)  # [b, h, seq]
    candidate = jnp.broadcast_to((slot[None] < (real - recent)[:, None])[:, None], pos.shape)  # [b, h, seq]
    recent_src = jnp.where(jnp.arange(t.buffer)[None] < recent[:, None],
                           (real - recent)[:, None] + jnp.arange(t.buffer)[None], -1)  # [b, B]
    src16, chosen = _sources_16(_protection(rng, pos, t), candidate, recent_src, t)
    srcq = _rest_in_order(candidate, chosen, t.quant_slots)  # [b, h, Q]
    state = {}
    for spec in cache.state_specs:
        w = jnp.zeros(pos.shape, jnp.float32) if slot_weights is None else unpad(slot_weights, pad, 2)
        state[spec.name] = jnp.where(pos >= 0, spec.update(jnp.zeros(w.shape, jnp.float32), w), 0.0)
    src = Sources(k_u, v_u, pos, rng, state, None)
    return _write_layer(cache, layer, src, src16, srcq, srcq >= 0, None)


# ---- decode steps ------------------------------------------------------------------------------------------
def write_token(cache: KVCache, layer, k: jax.Array, v: jax.Array, q: jax.Array) -> KVCache:
    """`cache.write_token` into the 16-bit tier, and the token's Range(v) into `value_range`."""
    new = write_16(cache, layer, k, v, q)
    b, h = k.shape[:2]
    rows, heads = jnp.arange(b)[:, None], jnp.arange(h)[None, :]
    virtual = cache.value_range.shape[-1]
    slot = jnp.where(cache.active, cache.length - 1, virtual)[:, None]  # [batch, 1]; inactive rows: dropped
    rng = value_range(v[:, :, 0].astype(cache.float_dtype))  # [b, h]
    return new.replace(value_range=cache.value_range.at[layer, rows, heads, slot].set(rng, mode="drop"))


def _kernels_take(kv_bits: KVBits) -> bool:
    """Whether the quantized tier's kernels read this setting: 8 or 4 bits on both sides, a power of two of at
    least 16 channels per group (8 bits) or per nibble half (4 bits: the Triton dot's smallest width)."""
    for which in ("key", "value"):
        bits, group = kv_bits.bits(which), kv_bits.group(which)
        width = group if bits == 8 else (group or 0) // 2
        if bits == 16 or width < 16 or width & (width - 1):
            return False
    return True


def decode_attention(q: jax.Array, cache: KVCache, layer, attention_impl: str) -> jax.Array:
    """Decode attention of q [batch, kv_heads, group, head_dim] over both tiers of layer `layer`:
    [batch, kv_heads, group, head_dim] in q's dtype.

    The XLA path (`attention_impl` "xla", and "auto" off GPU and TPU) reads both tiers in one loop
    (`quant_attention.tiered_attention`: the 16-bit blocks, then the quantized ones, one online softmax). The
    kernels (`pallas_kernels.get_decode_partials`, `get_quant_decode_partials`: the codes unpacked in the kernel)
    read each tier on its own, merged by log-sum-exp; a setting the quantized kernels do not take
    (`_kernels_take`: a 16-bit side, groups under 16 channels) has its quantized tier read by the XLA path."""
    t = cache.layout
    lengths = jnp.where(cache.active, cache.length, 0)  # [batch]
    if not t.quant_slots:
        return merge([get_decode_partials(attention_impl)(q, cache.k, cache.v, cache.pos, lengths, layer)], q.dtype)
    qlengths = jnp.where(cache.active, cache.qlength, 0)

    def one_loop():
        return tiered_attention(q, (cache.k, cache.v, cache.pos, lengths), (cache.kq, cache.vq, cache.qpos, qlengths),
                                block=DEFAULT_BLOCK_SIZE, layer=layer)

    def kernels():
        bits = dict(key_bits=cache.kq.bits, value_bits=cache.vq.bits)
        impl = attention_impl if _kernels_take(t.kv_bits) else "xla"
        kq, vq = cache.kq, cache.vq
        return merge([get_decode_partials(attention_impl)(q, cache.k, cache.v, cache.pos, lengths, layer),
                      get_quant_decode_partials(impl, reference=quantized_partials_of_arrays, **bits)(
                          q, kq.codes, kq.scale, kq.low, vq.codes, vq.scale, vq.low, cache.qpos, qlengths, layer)],
                     q.dtype)

    # the branches read the arrays they close over (a static `layer` stays static)
    return select(attention_impl, xla=one_loop, triton=lambda _: kernels, tpu=lambda _: kernels)()


def virtual_layer(cache: KVCache, layer) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One layer over the virtual slots, floats (the quantized tier dequantized): keys, values
    [b, h, V, D] and pos [b, h, V]."""
    dtype = cache.float_dtype
    keys, values = cache.layer_keys(layer), cache.layer_values(layer)
    pos = layer_of(cache.pos, layer)
    if not cache.layout.quant_slots:
        return keys, values, pos
    kq, vq = _layer_quantized(cache.kq, layer), _layer_quantized(cache.vq, layer)
    return (jnp.concatenate([keys, _dequantize(kq, dtype)], axis=2),
            jnp.concatenate([values, _dequantize(vq, dtype)], axis=2),
            jnp.concatenate([pos, layer_of(cache.qpos, layer)], axis=2))


def update_state(cache: KVCache, layer, q: jax.Array) -> KVCache:
    """`cache.update_state` over the virtual slots (the quantized keys dequantized; one layer)."""
    keys, _, pos = virtual_layer(cache, layer)
    f = cache.layout.full_slots
    slot = jnp.arange(pos.shape[-1])
    live = jnp.where(slot < f, slot < cache.length[:, None, None], slot - f < cache.qlength[:, None, None])
    w = decode_slot_weights(q, keys, jnp.where(live, pos, -1), jnp.full_like(cache.length, pos.shape[-1]))
    return apply_state(cache, layer, w, cache.active)


# ---- ticks ---------------------------------------------------------------------------------------------------
def _newest(cache: TieredCache) -> jax.Array:
    """[batch, B] the 16-bit slots of each row's newest B tokens."""
    b_ = cache.layout.buffer
    return cache.length[:, None] - b_ + jnp.arange(b_)[None]


def flush(cache: TieredCache, rows: jax.Array, attention_impl: str = "auto") -> TieredCache:
    """The tick of the `rows` [batch] bool that do not evict, over every layer (`_flush_layer`): the P 16-bit
    candidates of largest protection score stay, the other 16-bit candidates are quantized and appended, then
    the 16-bit tier holds P + B. Other rows are untouched; with none the loop runs zero times."""
    t = cache.layout
    newest = _newest(cache)

    def flush_layer(layer, carry):
        new, count = _flush_layer(pinned(carry[0], attention_impl), layer, rows, newest)
        return pinned(new, attention_impl), count

    with jax.named_scope("flush"):
        # the flush's count comes out of the loop (read with the layer it rewrites: reading the old cache after
        # the loop would keep the old `pos` stack alive, a copy of it per tick)
        new, fresh_count = jax.lax.fori_loop(0, jnp.where(jnp.any(rows), cache.num_layers, 0), flush_layer,
                                             (cache, jnp.zeros_like(cache.length)))
    return new.replace(length=jnp.where(rows, t.protected + t.buffer, cache.length),
                       qlength=jnp.where(rows, jnp.minimum(cache.qlength + fresh_count, t.quant_slots),
                                         cache.qlength))


def _virtual_pos(cache: TieredCache, layer) -> jax.Array:
    """[b, h, V] the positions of one layer's virtual slots."""
    return jnp.concatenate([layer_of(cache.pos, layer), layer_of(cache.qpos, layer)], axis=2)


def candidates(cache: TieredCache, layer, recent: int) -> SlotView:
    """One layer as an eviction policy sees it: the live slots of both tiers but the newest B (the 16-bit slots
    [length - B, length), which stay), over the virtual slots, the quantized ones dequantized; Range as recorded
    at write."""
    t = cache.layout
    if recent != t.buffer:
        raise ValueError(f"the mixed-precision cache keeps the newest B = {t.buffer} slots at an eviction; this "
                         f"method keeps {recent} unscored")
    keys, values, vpos = virtual_layer(cache, layer)  # [b, h, V, D] x 2, [b, h, V]
    f = t.full_slots
    slot = jnp.arange(vpos.shape[-1])
    live = jnp.where(slot >= f, slot - f < cache.qlength[:, None, None], slot < cache.length[:, None, None])
    recent_slots = jnp.broadcast_to(_newest(cache)[:, None], vpos.shape[:2] + (t.buffer,))  # [b, h, B]
    candidate = live & (vpos >= 0) & ~_scatter_mask(recent_slots, vpos.shape[-1])  # [b, h, V]
    return SlotView(keys=keys, values=values, pos=jnp.where(candidate, vpos, -1),
                    buffer_keys=_gather(keys, recent_slots), buffer_values=_gather(values, recent_slots),
                    buffer_pos=_gather(vpos, recent_slots),
                    state={name: layer_of(x, layer) for name, x in cache.state.items()},
                    value_range=layer_of(cache.value_range, layer))


def keep(cache: TieredCache, layer, view: SlotView, kept: jax.Array, rows: jax.Array) -> TieredCache:
    """Layer `layer` of both tiers after the eviction of the `rows` [batch] bool, from the policy's `kept`
    [b, h, K] virtual slots of `view` (`candidates`): by `kvquant.split_kept`'s rule, the P kept slots of largest
    protection score then the newest B in 16 bits, every other kept slot quantized (its codes if it was)."""
    t = cache.layout
    f = t.full_slots
    is_q = jnp.arange(view.pos.shape[-1]) >= f  # [V]
    score = _protection(view.value_range, view.pos, t)
    src16, srcq, fresh = _split(kept, is_q, score, _newest(cache), t)
    src = Sources(view.keys, view.values, _virtual_pos(cache, layer), view.value_range, view.state,
                  (_layer_quantized(cache.kq, layer), _layer_quantized(cache.vq, layer)))
    # fresh tokens come from the 16-bit tier less its newest B (which stay): at most F - B of them
    return _write_layer(cache, layer, src, src16, srcq, fresh, rows, most_fresh=f - t.buffer)


def _flush_layer(cache: KVCache, layer, rows: jax.Array, newest: jax.Array) -> tuple[KVCache, jax.Array]:
    """A flush of layer `layer` for the `rows` [batch] bool: the P 16-bit candidates of largest protection score
    stay, then the newest B (`newest` [b, B] 16-bit slots); the other 16-bit candidates (at most B) are quantized
    and appended to the quantized tier at its `qlength` slots, which stay as they are (only the appended slots
    are written: a flush costs O(F + B) per layer, not O(Q)). Returns the cache and [batch] the tokens each
    flushing row quantizes (the same in every layer and kv head: each holds the same tokens).

    Every read gathers straight from the stacks (the layer index is part of the gather) and every write is one
    update of this layer, so the loop over layers rewrites the stacks in place (no copy of a stack per layer)."""
    t = cache.layout
    f, b_ = t.full_slots, t.buffer
    dtype = cache.float_dtype
    pos16 = layer_of(cache.pos, layer)  # [b, h, F]
    b, h = pos16.shape[:2]
    slot = jnp.arange(f)
    candidate = (pos16 >= 0) & (slot < (cache.length - b_)[:, None, None])  # [b, h, F]
    rng16 = layer_of(cache.value_range, layer)[..., :f]  # [b, h, F]
    src16, chosen = _sources_16(_protection(rng16, jnp.where(candidate, pos16, -1), t), candidate, newest, t)
    src16 = jnp.where(rows[:, None, None], src16, slot)  # rows not flushing: every slot stays
    fresh = jnp.where(rows[:, None, None], _rest_in_order(candidate, chosen, b_), -1)  # [b, h, B] to quantize
    ok16, okf = src16 >= 0, fresh >= 0
    bi, hi = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None]
    at16, atf = jnp.clip(src16, 0, f - 1), jnp.clip(fresh, 0, f - 1)  # [b, h, F], [b, h, B]
    read_at = jnp.concatenate([at16, atf], axis=-1)  # [b, h, F + B]: every slot a stack is read at

    def reorder(stack, fill):
        """(the stack with this layer's 16-bit slots in their new order, empty ones filled; the slots to
        quantize [b, h, B, ...]), read by one gather from the stack: its only reader before the write."""
        both = stack[layer, bi, hi, read_at]  # [b, h, F + B, ...]
        new = jnp.where(ok16.reshape(ok16.shape + (1,) * (both.ndim - 3)), both[:, :, :f], fill)
        return jax.lax.dynamic_update_index_in_dim(stack, new, layer, axis=0), both[:, :, f:]

    bits_storage = cache.k.dtype == jnp.uint16
    k_stack, k_fresh = reorder(cache.k, 0)
    v_stack, v_fresh = reorder(cache.v, 0)
    pos_stack, appended_pos = reorder(cache.pos, -1)
    kq = _quantize(from_bits(k_fresh, dtype), t, "key", dtype, bits_storage)  # [b, h, B, ...]
    vq = _quantize(from_bits(v_fresh, dtype), t, "value", dtype, bits_storage)
    new = cache.replace(k=k_stack, v=v_stack, pos=pos_stack)
    # The appended slots: quantized tier slot qlength + i (virtual F + qlength + i); rows not flushing and empty
    # entries go out of range and are dropped.
    at = jnp.where(okf, cache.qlength[:, None, None] + jnp.arange(b_), t.quant_slots)  # [b, h, B]

    def append(stack, x):  # x [b, h, B, ...]
        return stack.at[layer, bi, hi, at].set(x.astype(stack.dtype), mode="drop")

    def append_params(stack, x):  # x [b, h, B, G] into a group-major stack [layers, b, h, G, Q]
        gi = jnp.arange(stack.shape[3])[None, None, :, None]  # [1, 1, G, 1]: every index given, no window
        return stack.at[layer, bi[..., None], hi[..., None], gi, at[:, :, None]].set(
            jnp.swapaxes(x, 2, 3).astype(stack.dtype), mode="drop")

    def append_quantized(stack: Quantized, x: Quantized) -> Quantized:
        return stack.replace(codes=append(stack.codes, x.codes), scale=append_params(stack.scale, x.scale),
                             low=append_params(stack.low, x.low))

    new = new.replace(kq=append_quantized(cache.kq, kq), vq=append_quantized(cache.vq, vq),
                      qpos=append(cache.qpos, appended_pos))
    virtual_at = jnp.where(at < t.quant_slots, f + at, t.virtual_slots)  # [b, h, B]
    targets = jnp.concatenate([jnp.broadcast_to(slot, (b, h, f)), virtual_at], axis=-1)  # [b, h, F + B]

    def per_slot(stack, lowered):  # one scatter: the 16-bit part permuted, the appended part written
        both = stack[layer, bi, hi, read_at]  # [b, h, F + B]
        part16, appended = jnp.where(ok16, both[..., :f], 0.0), both[..., f:]
        values = jnp.concatenate([part16, _lower(appended) if lowered else appended], axis=-1)
        return stack.at[layer, bi, hi, targets].set(values, mode="drop")

    return new.replace(value_range=per_slot(cache.value_range, True),
                       state={name: per_slot(x, False) for name, x in cache.state.items()}), okf[:, 0].sum(-1)


def _split(kept: jax.Array, is_q: jax.Array, score: jax.Array, newest: jax.Array, tiers: TierLayout):
    """An eviction's new tiers from the policy's kept virtual slots [b, h, K] (`kvquant.split_kept`'s rule):
    (src16 [b, h, F]: the P, then the newest B [b, B]; srcq [b, h, Q]: the other kept slots, a virtual 16-bit
    slot where `fresh`, else the old quantized tier's slot; fresh [b, h, Q])."""
    b, h, _ = kept.shape
    p, f, q = tiers.protected, tiers.full_slots, tiers.quant_slots
    full, quant, fresh = split_kept(kept, jnp.broadcast_to(is_q, (b, h, is_q.shape[-1])), score, p)
    src16 = jnp.concatenate([full, jnp.broadcast_to(newest[:, None], (b, h, newest.shape[-1]))], axis=-1)
    src16 = jnp.pad(src16, ((0, 0), (0, 0), (0, f - src16.shape[-1])), constant_values=-1)
    extra = max(q - quant.shape[-1], 0)
    quant = jnp.pad(quant, ((0, 0), (0, 0), (0, extra)), constant_values=-1)[..., :q]
    fresh = jnp.pad(fresh, ((0, 0), (0, 0), (0, extra)))[..., :q] & (quant >= 0)
    return src16, jnp.where(fresh, quant, jnp.where(quant >= 0, quant - f, -1)), fresh
