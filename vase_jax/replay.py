"""Teacher-forced replay: what eviction does to a model's next-token distributions on a fixed continuation.

`replay(model, prompts, reference, ...)` runs `generate`'s decode loop with the reference tokens fed in instead
of sampled ones, twice in one program: on an evicting cache, whose eviction runs exactly as `generate` runs it
(the same start steps, the same triggers, the same keys: for the same tokens the same kept sets), and on a full
cache beside it. At every reference position n >= 1 of row b it records, with p the full cache's next-token
distribution and q the evicting cache's (softmax of the logits, temperature 1):

    kl[b, n]       = KL(p || q) = sum_v p(v) (log p(v) - log q(v))
    agree[b, n]    = argmax q == argmax p                 (greedy decoding would write the same token)
    nll[b, n]      = -log q(reference[b, n]),   nll_full[b, n] = -log p(reference[b, n])

Position 0 is predicted by the prefill, where nothing is evicted yet (kl 0). With a budget that no row ever
exceeds, q = p exactly (kl 0). It needs no grader and no sampling: the cheap, deterministic quality figure of
an eviction method. `summarize` averages it per position bucket.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from pallas_kernels.decode_tuning import fixed_splits
from pallas_kernels.dispatch import pairwise_sum
from vase_jax.cache import CacheLayout, KVCache, first_rows
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import (
    GenerateConfig,
    decode_step,
    generate_target,
    pad_rows,
    prefill,
    prefill_prompts,
    prompt_pad_id,
    row_rule,
    split_keys,
)
from vase_jax.invariance import padded_rows
from vase_jax.jit import target_jit
from vase_jax.model import Qwen3
from vase_jax.sampling import typed_key
from vase_jax.target import Target


@struct.dataclass
class ReplayOutput:
    """Per reference position [batch, T] (T = reference.shape[1]); `valid` marks n < the row's length."""

    kl: jax.Array  # float32, KL(full || evicted) of the next-token distributions
    agree: jax.Array  # bool, the two argmax tokens are equal
    nll: jax.Array  # float32, -log q(reference token) under the evicting cache
    nll_full: jax.Array  # float32, -log p(reference token) under the full cache
    valid: jax.Array  # bool
    row_evictions: jax.Array  # [batch] int32, evictions of each row
    cache: KVCache | None = None  # the evicting cache at the end, when asked for


@struct.dataclass
class _State:
    cache: KVCache
    full: KVCache
    num_tokens: jax.Array  # [batch] int32: reference tokens consumed (token 0 from the prefill)
    start: jax.Array  # [batch] int32: the step of the row's first decode step (`framework.phase_wait`)
    step: jax.Array  # int32 scalar
    stats: dict[str, jax.Array]  # name -> [batch, T]


def replay(model: Qwen3, input_ids, attention_mask, reference, lengths, *, key: jax.Array,
           eviction: EvictionConfig, config: GenerateConfig | None = None, row_ids=None,
           return_cache: bool = False) -> ReplayOutput:
    """Teacher-forced replay of `reference` [batch, T] int (each row's continuation, its first `lengths[b]`
    tokens real) after the left-padded prompts `input_ids`, `attention_mask` [batch, P], with `eviction` applied
    as `generate(..., key=key, eviction=eviction, row_ids=row_ids)` applies it (module docstring). `config`:
    the platform, layer loop and attention kernel (its sampling settings are unused; `max_new_tokens` is T)."""
    config = config or GenerateConfig()
    reference = np.asarray(reference, np.int32)
    lengths = np.asarray(lengths, np.int32)
    input_ids, attention_mask = jnp.asarray(input_ids, jnp.int32), jnp.asarray(attention_mask, jnp.int32)
    b = input_ids.shape[0]
    if reference.ndim != 2 or reference.shape[0] != b:
        raise ValueError(f"reference: [batch, T] = ({b}, T) tokens, got shape {reference.shape}")
    if lengths.shape != (b,) or (lengths < 1).any() or (lengths > reference.shape[1]).any():
        raise ValueError(f"lengths: [batch] ints in [1, {reference.shape[1]}], got {lengths.tolist()}")
    if config.kv_bits.quantizes:
        raise ValueError("replay runs the 16-bit cache (GenerateConfig.key_bits = value_bits = 16)")
    if not eviction.evicts:
        raise ValueError("replay compares an evicting cache with the full one: give an eviction method")
    config = dataclasses.replace(config, max_new_tokens=int(reference.shape[1]))
    config.validate()
    eviction.validate()
    framework.check_model(eviction, model.cfg)
    target = generate_target(model, config)
    t = config.bucket(input_ids.shape[1])
    if t > input_ids.shape[1]:
        input_ids = jnp.pad(input_ids, ((0, 0), (t - input_ids.shape[1], 0)),
                            constant_values=prompt_pad_id(config, model.cfg))
        attention_mask = jnp.pad(attention_mask, ((0, 0), (t - attention_mask.shape[1], 0)))
    key = typed_key(jnp.asarray(key) if not isinstance(key, jax.Array) else key)
    row_ids = jnp.arange(b, dtype=jnp.int32) if row_ids is None else jnp.asarray(row_ids, jnp.int32)
    rows = padded_rows(b, row_rule(model, config, target))
    if rows > b:  # as `generate` runs a small batch: beside copies of its first row (`vase_jax.invariance`)
        input_ids, attention_mask, row_ids = (pad_rows(x, rows) for x in (input_ids, attention_mask, row_ids))
        reference, lengths = (np.concatenate([x] + [x[:1]] * (rows - b)) for x in (reference, lengths))
        key = key if key.ndim == 0 else pad_rows(key, rows)
    capacity = framework.capacity_for(eviction, t, config.max_new_tokens)
    full_capacity = framework.capacity_for(EvictionConfig("full"), t, config.max_new_tokens)
    graphdef, state = nnx.split(model)
    out = _replay(graphdef, state, input_ids, attention_mask, jnp.asarray(reference), jnp.asarray(lengths), key,
                  row_ids, config, eviction, (capacity, full_capacity, return_cache), target)
    if rows > b:
        out = out.replace(kl=out.kl[:b], agree=out.agree[:b], nll=out.nll[:b], nll_full=out.nll_full[:b],
                          valid=out.valid[:b], row_evictions=out.row_evictions[:b],
                          cache=None if out.cache is None else first_rows(out.cache, b))
    return out


def _log_softmax(x: jax.Array) -> jax.Array:
    """log softmax over the last axis, its sum a `pairwise_sum`: x - m - log sum(exp(x - m)), m the row's max."""
    m = jnp.max(x, axis=-1, keepdims=True)  # a max is exact in any order
    return x - m - jnp.log(pairwise_sum(jnp.exp(x - m)))


def _distribution_stats(logits: jax.Array, full_logits: jax.Array, token: jax.Array) -> dict[str, jax.Array]:
    """[batch] stats of one position from the two caches' logits [batch, vocab] and the reference token. The sums
    over the vocabulary are `pairwise_sum`s, so that a row's stats do not depend on the batch's rows (XLA:CPU's
    own reduce over [rows, 4096] gave a lone row's KL other last bits than its row in a batch of 3)."""
    q = _log_softmax(logits.astype(jnp.float32))  # [batch, vocab]
    p = _log_softmax(full_logits.astype(jnp.float32))
    kl = pairwise_sum(jnp.where(p == -jnp.inf, 0.0, jnp.exp(p) * (p - q)))[:, 0]  # 0 log 0 = 0
    pick = token[:, None]
    return {"kl": jnp.maximum(kl, 0.0), "agree": (q.argmax(-1) == p.argmax(-1)).astype(jnp.float32),
            "nll": -jnp.take_along_axis(q, pick, axis=-1)[:, 0],
            "nll_full": -jnp.take_along_axis(p, pick, axis=-1)[:, 0]}


@functools.partial(target_jit, static_argnums=(0, 8, 9, 10, 11), target_argnum=11)
def _replay(graphdef, state, input_ids, attention_mask, reference, lengths, key, row_ids, config: GenerateConfig,
            eviction: EvictionConfig, capacities: tuple[int, int, bool], target: Target) -> ReplayOutput:
    with fixed_splits(config.batch_invariant):  # the decode kernel's splits as in `generate`
        return _replay_body(graphdef, state, input_ids, attention_mask, reference, lengths, key, row_ids, config,
                            eviction, capacities, target)


def _replay_body(graphdef, state, input_ids, attention_mask, reference, lengths, key, row_ids,
                 config: GenerateConfig, eviction: EvictionConfig, capacities: tuple[int, int, bool],
                 target: Target) -> ReplayOutput:
    model = nnx.merge(graphdef, state)
    capacity, full_capacity, return_cache = capacities
    b, width = reference.shape
    impl = config.attention_impl
    _, evict_key = split_keys(key, b)
    with jax.named_scope("prefill"):
        logits, cache = prefill_prompts(model, input_ids, attention_mask, CacheLayout(capacity), config, eviction,
                                        evict_key, row_ids, target)
        full_logits, full = prefill(model, input_ids, attention_mask, full_capacity, 0, impl, (), None, target,
                                    config.prefill_chunk)
    first = _distribution_stats(logits, full_logits, reference[:, 0])
    stats = {name: jnp.zeros((b, width), jnp.float32).at[:, 0].set(v) for name, v in first.items()}
    start = framework.phase_wait(cache.seen - cache.seen[0], jnp.int32(0), eviction)  # as `generate`
    rows = jnp.arange(b)

    def running(s: _State) -> jax.Array:
        return jnp.any(s.num_tokens < lengths)

    def step(s: _State) -> _State:
        active = (s.num_tokens < lengths) & (s.step >= s.start)
        fed = jnp.take_along_axis(reference, (s.num_tokens - 1)[:, None], axis=1)[:, 0]  # [batch]
        logits, cache = decode_step(model, s.cache.replace(active=active), fed, impl, target)
        full_logits, full = decode_step(model, s.full.replace(active=active), fed, impl, target)
        column = jnp.minimum(s.num_tokens, width - 1)
        now = _distribution_stats(logits, full_logits, jnp.take_along_axis(reference, column[:, None], axis=1)[:, 0])
        where = jnp.where(active, s.num_tokens, width)  # inactive rows write nothing (out of range: dropped)
        stats = {n: s.stats[n].at[rows, where].set(now[n], mode="drop") for n in s.stats}
        return _State(cache=cache, full=full, num_tokens=s.num_tokens + active.astype(jnp.int32), start=s.start,
                      step=s.step + 1, stats=stats)

    # As `generate.decode_loop`: steps run in an inner loop that exits when a row's trigger fires (checked after a
    # step, never right after the prefill or an event); the outer loop evicts those rows. No eviction code runs
    # inside the per-step body (XLA would carry the cache through it and copy it at every step).
    def segment(s: _State) -> _State:
        def more(c):
            s, first = c
            return running(s) & (first | ~framework.rows_to_evict(s.cache, eviction).any())

        s, _ = jax.lax.while_loop(more, lambda c: (step(c[0]), jnp.bool_(False)), (s, jnp.bool_(True)))
        return dataclasses.replace(s, cache=framework.evict(s.cache, eviction, evict_key, row_ids, impl))

    s = _State(cache=cache, full=full, num_tokens=jnp.ones((b,), jnp.int32), start=start, step=jnp.int32(0),
               stats=stats)
    s = jax.lax.while_loop(running, segment, s)
    valid = jnp.arange(width)[None, :] < lengths[:, None]
    kept = {n: jnp.where(valid, s.stats[n], 0.0) for n in ("kl", "nll", "nll_full")}
    return ReplayOutput(**kept, agree=valid & (s.stats["agree"] > 0), valid=valid, row_evictions=s.cache.evictions,
                        cache=s.cache.as_floats() if return_cache else None)


def summarize(out: ReplayOutput, buckets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)) -> dict:
    """Means over the valid positions: kl, agree (top-1 agreement), nll, nll_full; and the same per position
    bucket [0, b0), [b0, b1), ... (positions of the continuation), each with its count."""
    valid = np.asarray(out.valid)
    arrays = {name: np.asarray(getattr(out, name), np.float64) for name in ("kl", "agree", "nll", "nll_full")}

    def means(mask) -> dict:
        n = int(mask.sum())
        return {"positions": n, **{k: (float(v[mask].mean()) if n else None) for k, v in arrays.items()}}

    position = np.broadcast_to(np.arange(valid.shape[1]), valid.shape)
    edges = (0, *buckets, np.inf)
    by_bucket = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        mask = valid & (position >= lo) & (position < hi)
        if mask.any():
            by_bucket.append({"from": int(lo), "to": None if hi == np.inf else int(hi), **means(mask)})
    return {**means(valid), "by_position": by_bucket}
