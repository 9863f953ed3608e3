"""A decode step and an eviction event timed alone, on caches filled with random keys and values; the bytes a
step must read. Shared by `benchmarks.bench` (its micro figures) and `benchmarks.device_check` (its decode and
events phases).

Roofline of one decode step (memory bound at small batch): a step reads every weight once (the embedding table
only through the tied LM head; an untied table is read one row per token) and, per layer, the K, V and `pos` of
every live slot:

    bytes(step) = weight_bytes + slots_read * batch * layers * kv_heads * (2 * head_dim * itemsize + 4)

and an eviction event reads and rewrites the `budget + buffer` slots of every layer (2x their bytes). The bound on
decode tokens/s over a run is batch * steps * bandwidth / sum(bytes) = batch * bandwidth / mean bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.timing import Stat, time_runs
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


# ---- bytes per decode step ---------------------------------------------------------------------------------
def param_bytes(model: Qwen3) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def weight_bytes_per_step(model: Qwen3) -> int:
    """Parameter bytes a decode step reads: all, except an untied embedding table (one row per token)."""
    total = param_bytes(model)
    if not model.cfg.tie_word_embeddings:
        total -= model.embedding[...].size * model.embedding[...].dtype.itemsize
    return total


def slot_bytes(cfg: Qwen3Config, batch: int, itemsize: int) -> int:
    """Bytes of one cache slot over the batch and every layer: K and V (head_dim each) and the int32 `pos`."""
    return batch * cfg.num_layers * cfg.num_kv_heads * (2 * cfg.head_dim * itemsize + 4)


def row_replay(eviction: EvictionConfig, prompt_len: int, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row's cache over `steps` decode steps, as `generate` and `batching` run it: step k writes one slot and
    attends over all it holds; after it, the trigger (`framework.trigger` on the row's real tokens: > N and a
    multiple of B) sets the length back to N. `reads[k - 1]`: slots the row holds during its k-th step (its new
    token's included), `after[k]`: after the k-th step and its eviction (`after[0]` = the prompt), `triggers`: the
    steps k after which the row is evicted."""
    reads = np.empty(steps, np.int64)
    after = np.empty(steps + 1, np.int64)
    after[0] = length = seen = prompt_len
    triggers = []
    for k in range(1, steps + 1):
        length, seen = length + 1, seen + 1
        reads[k - 1] = length
        if eviction.evicts and framework.trigger(seen, eviction):
            length = eviction.budget
            triggers.append(k)
        after[k] = length
    return reads, after, np.asarray(triggers, np.int64)


def roofline(model: Qwen3, eviction: EvictionConfig, reads: np.ndarray, events: int, batch: int,
             itemsize: int) -> dict:
    """Bytes a decode step reads at the start, at the end and on average over a run whose steps hold `reads`
    slots (`row_replay`) with `events` eviction events (amortized). The tokens/s bound at read bandwidth `bw` is
    batch * bw / bytes_step_mean."""
    w = weight_bytes_per_step(model)
    per_slot = slot_bytes(model.cfg, batch, itemsize)
    evict_bytes = 2 * (eviction.budget + eviction.buffer) * per_slot if eviction.evicts else 0
    total = len(reads) * w + int(reads.sum()) * per_slot + events * evict_bytes
    return {"weight_bytes": w, "bytes_step_start": w + int(reads[0]) * per_slot,
            "bytes_step_end": w + int(reads[-1]) * per_slot, "bytes_step_mean": total / len(reads),
            "bytes_per_eviction": evict_bytes}


# ---- pieces of generate, timed alone -----------------------------------------------------------------------
def random_prompt(vocab: int, batch: int, prompt_len: int, config: GenerateConfig, seed: int = 0):
    """Random ids, every row `prompt_len` real tokens, left-padded to the prompt bucket as `generate` does.
    Returns (input_ids, attention_mask) [batch, bucket] int32."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, prompt_len), dtype=np.int32)
    bucket = config.bucket(prompt_len)
    ids = np.pad(ids, ((0, 0), (bucket - prompt_len, 0)), constant_values=config.pad_id)
    mask = np.pad(np.ones((batch, prompt_len), np.int32), ((0, 0), (bucket - prompt_len, 0)))
    return jnp.asarray(ids), jnp.asarray(mask)


@functools.partial(target_jit, static_argnums=(0, 4, 5, 6, 7, 8, 9), target_argnum=8)
def prefill(graphdef, state, input_ids, attention_mask, capacity, window: int, attention_impl: str,
            slot_state: tuple, target: Target, chunk: int | None = GenerateConfig.prefill_chunk):
    """What `generate` does before its loop: the prompt forward pass (in chunks of `chunk` tokens past that many),
    the cache of `capacity` (slots, or a mixed-precision `TierLayout`, with the policy's per-slot `slot_state`) and
    the first (greedy) token. Returns (first token [batch], cache)."""
    logits, cache = generate_prefill(nnx.merge(graphdef, state), input_ids, attention_mask, capacity, window,
                                     attention_impl, slot_state, target=target, chunk=chunk)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def filled_cache(
    cfg: Qwen3Config, batch: int, capacity: int, length: int, window: int, dtype, seed: int = 0, state: tuple = (),
    target: Target | None = None,
) -> KVCache:
    """A cache of `capacity` slots; the first `length` hold random keys and values (positions 0..length-1);
    `state`: the policy's per-slot state arrays (uniform random in [0, 1) on the first `length` slots); stored as
    `target` stores a cache (`init_cache`)."""
    kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
    empty = jax.eval_shape(lambda: init_cache(cfg, batch, capacity, window, dtype, state, target))  # storage
    slot = jnp.arange(capacity, dtype=jnp.int32)

    def normals(key: jax.Array, like) -> jax.Array:
        """Standard normals drawn in `dtype` itself (a float32 draw would hold twice the cache while filling),
        stored as the cache stores them."""
        return stored(jax.random.normal(key, like.shape, dtype), empty)

    def filled() -> jax.Array:  # [batch] `length`; a new buffer per field, since callers donate the cache
        return jnp.full(empty.length.shape, length, jnp.int32)

    # Every leaf of `empty` is replaced: nothing of the empty cache is allocated.
    return empty.replace(
        k=normals(kk, empty.k), v=normals(kv, empty.v), queries=normals(kq, empty.queries),
        pos=jnp.broadcast_to(jnp.where(slot < length, slot, -1), empty.pos.shape),
        query_valid=jnp.ones(empty.query_valid.shape, bool), row_pos=filled(), length=filled(), seen=filled(),
        prompt_length=jnp.zeros(empty.prompt_length.shape, jnp.int32),
        evictions=jnp.zeros(empty.evictions.shape, jnp.int32), active=jnp.ones(empty.active.shape, bool),
        state={name: jnp.where(slot < length, jax.random.uniform(jax.random.fold_in(kq, i), x.shape), 0.0)
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
        raise ValueError(f"live={live}: more than the layout's P + B + Q = "
                         f"{layout.protected + layout.buffer + layout.quant_slots} tokens")
    kk, kv, kr, kc = jax.random.split(jax.random.key(seed), 4)
    slot16 = jnp.arange(layout.full_slots, dtype=jnp.int32)
    slotq = jnp.arange(layout.quant_slots, dtype=jnp.int32)

    def normals(key, like):
        return stored(jax.random.normal(key, like.shape, dtype), empty)

    def quantized(key, like):  # `kvquant.Quantized` with random codes and the same scale and low everywhere
        if like.bits == 16:  # a 16-bit side holds its values (or their bits) as codes
            return like.replace(codes=normals(key, like.codes))
        def constant(x, value):  # stored as the cache stores its floats (scales are bits where k is)
            return stored(jnp.full(x.shape, value, dtype), empty)

        codes = jax.random.bits(key, like.codes.shape, like.codes.dtype)  # uint8 (no wider draw held)
        return like.replace(codes=codes, scale=constant(like.scale, 2.0 / (2**like.bits - 1)),
                            low=constant(like.low, -1.0))

    def counter(value):  # [batch]; a new buffer per field, since callers donate the cache
        return jnp.full(empty.length.shape, value, jnp.int32)

    return empty.replace(
        k=normals(kk, empty.k), v=normals(kv, empty.v), queries=normals(kr, empty.queries),
        pos=jnp.broadcast_to(jnp.where(slot16 < n16, nq + slot16, -1), empty.pos.shape),
        kq=quantized(kc, empty.kq), vq=quantized(jax.random.fold_in(kc, 1), empty.vq),
        qpos=jnp.broadcast_to(jnp.where(slotq < nq, slotq, -1), empty.qpos.shape),
        qlength=counter(nq), value_range=jnp.zeros(empty.value_range.shape, jnp.float32),
        query_valid=jnp.ones(empty.query_valid.shape, bool), row_pos=counter(live), length=counter(n16),
        seen=counter(live), prompt_length=counter(0), evictions=counter(0), active=jnp.ones(empty.active.shape, bool),
        state={})


@functools.partial(target_jit, static_argnums=(0, 5, 6, 7), target_argnum=7, donate_argnums=(2,))
def decode_steps(graphdef, state, cache: KVCache, token, start, steps: int, attention_impl: str, target: Target):
    """`steps` greedy `decode_step`s in one `fori_loop`, from a cache reset to `start` slots (no eviction; None:
    the cache's own counters, as for a mixed-precision cache from `filled_tiered_cache`, which has no tick
    here), with `target`'s layer loop, as `generate` runs them. The cache is donated, so it is updated in place as
    in `generate`. Returns (cache, last token)."""
    model = nnx.merge(graphdef, state)
    if start is not None:
        start = jnp.full_like(cache.row_pos, start)  # every row
        cache = cache.replace(length=start, seen=start, row_pos=start)

    def body(_, carry):
        c, tok = carry
        logits, c = decode_step(model, c, tok, attention_impl, target)
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
    """Milliseconds per decode step: `repeats` calls of `decode_steps` (`steps` steps each; one untimed call
    first, which compiles), each on the cache the previous one returned (donated: no copy, and the caller's cache
    is consumed, so that a large one is not held twice)."""
    box = [cache]
    del cache
    token = jnp.zeros(box[0].length.shape, jnp.int32)

    def call():
        box[0], tok = decode_steps(graphdef, state, box[0], token, start, steps, attention_impl, target)
        return tok

    return time_runs(call, repeats, warmup=1).map(lambda s: s / steps * 1e3)


def evict_ms(cache: KVCache, eviction: EvictionConfig, repeats: int, attention_impl: str = "auto",
             seed: int = 0) -> Stat:
    """Milliseconds of one eviction event (`evict_full`), `repeats` events after an untimed one, the cache
    donated from one to the next."""
    box = [cache]
    del cache
    key, rows = jax.random.key(seed), jnp.arange(box[0].length.shape[0], dtype=jnp.int32)

    def call():
        box[0] = evict_full(box[0], eviction, key, rows, attention_impl)
        return box[0].length

    return time_runs(call, repeats, warmup=1).map(lambda s: s * 1e3)
