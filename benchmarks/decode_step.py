"""A decode step and an eviction event timed alone, on caches filled with random keys and values; the bytes a
step must read (its roofline: memory bound at small batch). A step reads every weight once (the embedding table
only through the tied LM head; an untied table is read one row per token) and, per layer, K, V and `pos` of every
live slot:

    bytes(step) = weight_bytes + slots_read * batch * layers * kv_heads * (2 * head_dim * itemsize + 4)

and an eviction event reads and rewrites the `budget + buffer` slots of every layer (2x their bytes). The bound on
decode tokens/s over a run is batch * steps * bandwidth / sum(bytes) = batch * bandwidth / mean bytes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.timing import Stat, time_chained
from vase_jax.cache import KVCache, init_cache, stored
from vase_jax.config import Qwen3Config
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import GenerateConfig, decode_step
from vase_jax.generate import prefill as generate_prefill
from vase_jax.jit import target_jit
from vase_jax.model import Qwen3
from vase_jax.target import Target
from vase_jax.tiers import init_tiered_cache


def param_bytes(model: Qwen3) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def weight_bytes_per_step(model: Qwen3) -> int:
    """Parameter bytes a decode step reads: all, except an untied embedding table (one row per token)."""
    table = model.embedding[...]
    return param_bytes(model) - (0 if model.cfg.tie_word_embeddings else table.size * table.dtype.itemsize)


def slot_bytes(cfg: Qwen3Config, batch: int, itemsize: int) -> int:
    """Bytes of one cache slot over the batch and every layer: K and V (head_dim each) and the int32 `pos`."""
    return batch * cfg.num_layers * cfg.num_kv_heads * (2 * cfg.head_dim * itemsize + 4)


def row_replay(eviction: EvictionConfig, prompt_len: int, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row's cache over `steps` decode steps, as `generate` and `batching` run it: step k writes one slot and
    attends over all it holds; then the trigger (`framework.trigger`: > N real tokens, a multiple of B) sets the
    length back to N. (reads[k - 1]: slots held during step k, its new token's included; after[k]: after step k
    and its eviction, after[0] the prompt; triggers: the steps k after which the row is evicted)."""
    after, triggers = [prompt_len], []
    for k in range(1, steps + 1):  # `seen` (the real tokens) is prompt_len + k
        fires = eviction.evicts and framework.trigger(prompt_len + k, eviction)
        triggers += [k] if fires else []
        after.append(eviction.budget if fires else after[-1] + 1)
    after = np.asarray(after, np.int64)
    return after[:-1] + 1, after, np.asarray(triggers, np.int64)


def roofline(model: Qwen3, eviction: EvictionConfig, reads: np.ndarray, events: int, batch: int,
             itemsize: int) -> dict:
    """Bytes a decode step reads at the start, at the end and on average over a run whose steps hold `reads` slots
    (`row_replay`) with `events` eviction events (amortized): the bound at bandwidth bw is batch * bw / bytes."""
    w, per_slot = weight_bytes_per_step(model), slot_bytes(model.cfg, batch, itemsize)
    evict_bytes = 2 * (eviction.budget + eviction.buffer) * per_slot if eviction.evicts else 0
    total = len(reads) * w + int(reads.sum()) * per_slot + events * evict_bytes
    return {"weight_bytes": w, "bytes_step_start": w + int(reads[0]) * per_slot,
            "bytes_step_end": w + int(reads[-1]) * per_slot, "bytes_step_mean": total / len(reads),
            "bytes_per_eviction": evict_bytes}


def random_prompt(vocab: int, batch: int, prompt_len: int, config: GenerateConfig, seed: int = 0):
    """(input_ids, attention_mask) [batch, bucket] int32: `prompt_len` random ids per row, left-padded as `generate`."""
    ids = np.random.default_rng(seed).integers(0, vocab, (batch, prompt_len), dtype=np.int32)
    pad = ((0, 0), (config.bucket(prompt_len) - prompt_len, 0))
    return (jnp.asarray(np.pad(ids, pad, constant_values=config.pad_id)),
            jnp.asarray(np.pad(np.ones((batch, prompt_len), np.int32), pad)))


@functools.partial(target_jit, static_argnums=(0, 4, 5, 6, 7, 8, 9), target_argnum=8)
def prefill(graphdef, state, input_ids, attention_mask, capacity, window: int, attention_impl: str,
            slot_state: tuple, target: Target, chunk: int | None = GenerateConfig.prefill_chunk):
    """`generate`'s prefill: the prompt forward pass (in chunks of `chunk` tokens past that many), the cache of
    `capacity` (slots or a `TierLayout`; the policy's `slot_state`) -> (first greedy token [batch], cache)."""
    logits, cache = generate_prefill(nnx.merge(graphdef, state), input_ids, attention_mask, capacity, window,
                                     attention_impl, slot_state, target=target, chunk=chunk)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def _fill(empty: KVCache, keys, dtype, live: int, length: int, **fields) -> KVCache:
    """`empty` (a cache's `jax.eval_shape`) with every leaf a new buffer (callers donate the cache): normal keys,
    values and queries from `keys`, drawn in `dtype` (a float32 draw would hold twice the cache), `live` tokens
    seen, the newest `length` in the first (16-bit) slots, and `fields`."""
    def counter(value):
        return jnp.full(empty.length.shape, value, jnp.int32)

    k, v, q = (stored(jax.random.normal(key, x.shape, dtype), empty)
               for key, x in zip(keys, (empty.k, empty.v, empty.queries), strict=True))
    slot = jnp.arange(empty.pos.shape[-1], dtype=jnp.int32)
    return empty.replace(k=k, v=v, queries=q, pos=jnp.broadcast_to(jnp.where(slot < length, live - length + slot, -1),
                                                                   empty.pos.shape),
                         query_valid=jnp.ones(empty.query_valid.shape, bool), row_pos=counter(live),
                         length=counter(length), seen=counter(live), prompt_length=counter(0), evictions=counter(0),
                         active=jnp.ones(empty.active.shape, bool), **fields)


def filled_cache(cfg: Qwen3Config, batch: int, capacity: int, length: int, window: int, dtype, seed: int = 0,
                 state: tuple = (), target: Target | None = None) -> KVCache:
    """A cache of `capacity` slots (stored as `init_cache` for `target`) whose first `length` hold random keys and
    values (positions 0..length-1) and uniform [0, 1) numbers in the policy's per-slot `state` arrays."""
    keys = jax.random.split(jax.random.key(seed), 3)
    empty = jax.eval_shape(lambda: init_cache(cfg, batch, capacity, window, dtype, state, target))
    slot = jnp.arange(capacity, dtype=jnp.int32)
    return _fill(empty, keys, dtype, length, length, state={
        name: jnp.where(slot < length, jax.random.uniform(jax.random.fold_in(keys[2], i), x.shape), 0.0)
        for i, (name, x) in enumerate(empty.state.items())})


def filled_tiered_cache(cfg: Qwen3Config, batch: int, layout, live: int, window: int, dtype, seed: int = 0,
                        target: Target | None = None) -> KVCache:
    """A mixed-precision cache (`tiers.TierLayout` `layout`) holding `live` tokens as between two ticks: the
    newest min(live, P + B) in the 16-bit tier (random normal keys and values), the others in the quantized tier
    (uniformly random codes, every group's scale 2 / (2^bits - 1) and low -1: values in [-1, 1]); stored as
    `target` stores a cache. For timing decode steps (`decode_steps` with `start=None`), not for accuracy."""
    empty = jax.eval_shape(lambda: init_tiered_cache(cfg, batch, layout, window, dtype, (), target))
    n16 = min(live, layout.protected + layout.buffer)
    nq = live - n16
    if nq > layout.quant_slots:
        raise ValueError(f"live={live}: more than the layout's P + B + Q = {n16 + layout.quant_slots} tokens")
    kk, kv, kr, kc = jax.random.split(jax.random.key(seed), 4)
    slotq = jnp.arange(layout.quant_slots, dtype=jnp.int32)

    def quantized(key, like):  # `kvquant.Quantized`: random codes, the same scale and low everywhere
        if like.bits == 16:  # a 16-bit side holds its values (or their bits) as codes
            return like.replace(codes=stored(jax.random.normal(key, like.codes.shape, dtype), empty))
        return like.replace(codes=jax.random.bits(key, like.codes.shape, like.codes.dtype),  # uint8: no wider draw
                            scale=stored(jnp.full(like.scale.shape, 2.0 / (2**like.bits - 1), dtype), empty),
                            low=stored(jnp.full(like.low.shape, -1.0, dtype), empty))

    return _fill(empty, (kk, kv, kr), dtype, live, n16, kq=quantized(kc, empty.kq),
                 vq=quantized(jax.random.fold_in(kc, 1), empty.vq), qlength=jnp.full(empty.length.shape, nq, jnp.int32),
                 qpos=jnp.broadcast_to(jnp.where(slotq < nq, slotq, -1), empty.qpos.shape),
                 value_range=jnp.zeros(empty.value_range.shape, jnp.float32), state={})


@functools.partial(target_jit, static_argnums=(0, 5, 6, 7), target_argnum=7, donate_argnums=(2,))
def decode_steps(graphdef, state, cache: KVCache, token, start, steps: int, attention_impl: str, target: Target):
    """`steps` greedy `decode_step`s in one `fori_loop` with `target`'s layer loop, as `generate` runs them, from
    a cache reset to `start` slots (no eviction; None: the cache's own counters, as for `filled_tiered_cache`'s,
    which has no tick here). The cache is donated: updated in place, as in `generate`. Returns (cache, token)."""
    model = nnx.merge(graphdef, state)
    if start is not None:  # every row
        cache = cache.replace(**dict.fromkeys(("length", "seen", "row_pos"), jnp.full_like(cache.row_pos, start)))

    def body(_, carry):
        logits, c = decode_step(model, *carry, attention_impl, target)
        return c, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return jax.lax.fori_loop(0, steps, body, (cache, token))


@functools.partial(jax.jit, static_argnums=(1, 4), donate_argnums=(0,))
def evict_full(cache: KVCache, eviction: EvictionConfig, key, row_ids, attention_impl: str = "auto") -> KVCache:
    """One `framework.evict` event on a cache holding `budget + buffer` slots (the state at a trigger). The
    cache is donated and its length restored afterwards, so calls can repeat on the returned cache."""
    full = jnp.full_like(cache.length, eviction.budget + eviction.buffer)  # every row at its trigger
    out = framework.evict(cache.replace(length=full, seen=full, active=jnp.ones_like(cache.active)), eviction, key,
                          row_ids, attention_impl)
    return out.replace(pos=cache.pos, length=full, seen=full)


def step_ms(graphdef, state, cache: KVCache, start, steps: int, repeats: int, attention_impl: str,
            target: Target) -> Stat:
    """Milliseconds per decode step: `repeats` chained calls of `decode_steps` (`steps` steps each)."""
    token = jnp.zeros(cache.length.shape, jnp.int32)
    return time_chained(lambda carry: decode_steps(graphdef, state, *carry, start, steps, attention_impl, target),
                        (cache, token), repeats).map(lambda s: s / steps * 1e3)


def evict_ms(cache: KVCache, eviction: EvictionConfig, repeats: int, attention_impl: str = "auto",
             seed: int = 0) -> Stat:
    """Milliseconds of one eviction event: `repeats` chained calls of `evict_full`."""
    key, rows = jax.random.key(seed), jnp.arange(cache.length.shape[0], dtype=jnp.int32)
    return time_chained(lambda c: evict_full(c, eviction, key, rows, attention_impl), cache, repeats).map(
        lambda s: s * 1e3)
