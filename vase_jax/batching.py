"""Continuous batching: a fixed number of rows; when a row ends, the next pending sample is prefilled into it.

The engine is host-driven. One compiled decode program (`generate.decode_loop`) runs every busy row until some
row ends (end token or its cap); the host then reads that row's tokens, hands them to `on_result`, prefills the
next pending sample into the row (one prefill program per prompt bucket, batch 1) and writes it into the batch's
cache (one program; the loop state is donated, so neither the admission nor the decode loop copies the cache).
Shapes never change, so nothing recompiles after the first sample of each bucket (`compile_counts`).

A sample carries its own key, row id and cap, and its tokens depend only on them, its prompt and the settings:
they are bit-identical whichever row, batch or time it runs in, and to `generate` of the same sample. With
eviction, a new row starts decoding at the step that puts its trigger phase on the batch's ticks
(`framework.phase_wait`, at most B - 1 idle steps), so the batch still runs at most one eviction event per B
steps; `full` has no ticks and starts a row at once. A prompt longer than the budget is kept whole until the
row's first eviction, as in `generate`; the capacity is max(longest prompt bucket, N) + B.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vase_jax.cache import CACHE_AXES, KVCache, batch_axis, first_rows, init_cache
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import (
    DEFAULT_CONFIG,
    NO_EVICTION,
    GenerateConfig,
    LoopState,
    decode_loop,
    ended,
    first_tokens,
    no_events,
    prefill,
    query_window,
    resolve_layer_loop,
    split_keys,
)
from vase_jax.model import Qwen3
from vase_jax.sampling import typed_key


@dataclasses.dataclass(frozen=True)
class Request:
    """One sample: its prompt (real token ids, no padding), PRNG key, row stream id, cap, and a tag for the caller."""

    prompt: tuple[int, ...]
    key: Any  # a PRNG key (typed or raw)
    row_id: int
    max_new_tokens: int
    tag: Any = None


@dataclasses.dataclass(frozen=True)
class Result:
    tag: Any
    tokens: np.ndarray  # [n] int32, the end token included
    finished: bool  # ended by an end token (not by its cap)
    evictions: int  # the row's evictions
    seconds: float  # wall time from its prefill to the moment the host saw it end


@dataclasses.dataclass
class EngineStats:
    steps: int = 0  # decode steps the batch ran
    useful_row_steps: int = 0  # row-steps that produced a token of some sample
    total_row_steps: int = 0  # rows x steps
    events: int = 0  # eviction events
    min_event_gap: int = 0  # the fewest steps between two eviction events (a large number if fewer than two)
    segments: int = 0  # decode-program calls (host round trips)

    @property
    def utilization(self) -> float:
        """Useful row-steps / total row-steps."""
        return self.useful_row_steps / max(self.total_row_steps, 1)


def validate_requests(requests: list[Request], rows: int, config: GenerateConfig) -> None:
    """Clear errors, before anything compiles: rows >= 1, caps in [1, config.max_new_tokens], non-empty prompts."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"rows (batch size)={rows!r} must be a positive int")
    for i, r in enumerate(requests):
        if not isinstance(r.max_new_tokens, (int, np.integer)) or not 1 <= r.max_new_tokens <= config.max_new_tokens:
            raise ValueError(f"request {i} (tag {r.tag!r}): max_new_tokens={r.max_new_tokens!r}; allowed: 1 .. "
                             f"GenerateConfig.max_new_tokens={config.max_new_tokens}")
        if len(r.prompt) == 0:
            raise ValueError(f"request {i} (tag {r.tag!r}): empty prompt")


def _put_row(big: KVCache, one: KVCache, row) -> KVCache:
    """Write the batch-1 cache `one` into row `row` of `big` (every array along its "batch" axis)."""
    fields = {name: jax.lax.dynamic_update_slice_in_dim(getattr(big, name), getattr(one, name), row,
                                                        batch_axis(name)) for name in CACHE_AXES}
    state = {name: jax.lax.dynamic_update_slice_in_dim(x, one.state[name], row, batch_axis("state"))
             for name, x in big.state.items()}
    return big.replace(**fields, state=state)


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8))
def _prefill_row(graphdef, state, input_ids, attention_mask, key, row_id, config: GenerateConfig,
                 eviction: EvictionConfig, capacity: int):
    """Prefill one left-padded prompt [1, bucket] into a batch-1 cache of `capacity` slots -> (cache, token 0).
    The prompt runs beside a copy of itself, as `generate` runs a lone row (`generate._prepare`)."""
    model = nnx.merge(graphdef, state)
    input_ids, attention_mask, key, row_id = (jnp.concatenate([x, x]) for x in (input_ids, attention_mask, key, row_id))
    sample_key, _ = split_keys(key, 2)
    logits, cache = prefill(model, input_ids, attention_mask, capacity, query_window(eviction),
                            config.attention_impl, framework.slot_state(eviction))
    return first_rows(cache, 1), first_tokens(logits, sample_key, row_id, config)[:1]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _init_state(cfg, dtype, rows: int, config: GenerateConfig, eviction: EvictionConfig, capacity: int) -> LoopState:
    """Every row idle (done, inactive)."""
    cache = init_cache(cfg, rows, capacity, query_window(eviction), dtype, framework.slot_state(eviction))
    keys = jnp.broadcast_to(jax.random.key(0), (rows,))
    zeros = jnp.zeros((rows,), jnp.int32)
    return LoopState(cache=cache.replace(active=jnp.zeros((rows,), bool)),
                     tokens=jnp.full((rows, config.max_new_tokens), config.pad_id, jnp.int32), last=zeros,
                     done=jnp.ones((rows,), bool), num_tokens=zeros, cap=zeros + 1, start=zeros, sample_key=keys,
                     evict_key=keys, row_ids=zeros, step=jnp.int32(0), **no_events())


@functools.partial(jax.jit, static_argnums=(8, 9), donate_argnums=(0,))
def _admit(s: LoopState, row, one: KVCache, first, cap, key, row_id, phase, config: GenerateConfig,
           eviction: EvictionConfig) -> LoopState:
    """Put a prefilled sample into row `row`: its cache, token 0, cap, keys, and the batch step at which it starts
    decoding (now, or when its trigger phase meets the batch's ticks)."""
    sample_key, evict_key = split_keys(key, 1)
    wait = framework.phase_wait(one.seen[0] - phase, s.step, eviction)
    tokens_row = jnp.full((1, s.tokens.shape[1]), config.pad_id, jnp.int32).at[0, 0].set(first[0])

    def put(x, value):  # x [rows, ...] <- value [1, ...] at `row`
        return jax.lax.dynamic_update_slice_in_dim(x, jnp.asarray(value, x.dtype).reshape((1,) + x.shape[1:]), row, 0)

    one_tok = jnp.ones((1,), jnp.int32)
    return s.replace(
        cache=_put_row(s.cache, one.replace(active=jnp.zeros((1,), bool)), row),
        tokens=jax.lax.dynamic_update_slice_in_dim(s.tokens, tokens_row, row, 0),
        last=put(s.last, first), done=put(s.done, ended(first, one_tok, cap, config)), num_tokens=put(s.num_tokens, 1),
        cap=put(s.cap, cap), start=put(s.start, s.step + wait), sample_key=put(s.sample_key, sample_key),
        evict_key=put(s.evict_key, evict_key), row_ids=put(s.row_ids, row_id))


@functools.partial(jax.jit, static_argnums=(0, 4, 5), donate_argnums=(2,))
def _run(graphdef, state, s: LoopState, reported, config: GenerateConfig, eviction: EvictionConfig) -> LoopState:
    """Decode every busy row until some row ends that the host has not seen yet (`reported` False)."""
    model = nnx.merge(graphdef, state)
    layers = model.layer_weights(unstack=resolve_layer_loop(config.layer_loop) == "unroll")
    return decode_loop(model, layers, s, config, eviction, lambda s: ~jnp.any(s.done & ~reported))


def compile_counts() -> dict[str, int]:
    """Programs compiled so far by the engine: {"prefill": one per (bucket, settings), "admit", "decode"}."""
    return {"prefill": _prefill_row._cache_size(), "admit": _admit._cache_size(), "decode": _run._cache_size(),
            "init": _init_state._cache_size(), "result": _row_result._cache_size()}


def run(
    model: Qwen3,
    requests: Iterable[Request],
    *,
    rows: int,
    config: GenerateConfig = DEFAULT_CONFIG,
    eviction: EvictionConfig = NO_EVICTION,
    on_result: Callable[[Result], None] | None = None,
    stats: EngineStats | None = None,
) -> list[Result]:
    """Generate every request on a batch of `rows` rows, refilling a row as soon as its sample ends.

    `on_result` is called with each sample's `Result` as soon as it ends (in end order); the list of results is
    also returned in that order. `stats` (optional) receives the step counts and the row utilization.
    """
    requests = list(requests)
    config.validate()
    eviction.validate()
    if not isinstance(model, Qwen3):
        raise ValueError(f"model must be a vase_jax.Qwen3, got {type(model).__name__}")
    validate_requests(requests, rows, config)
    stats = stats if stats is not None else EngineStats()
    if not requests:
        return []
    capacity = framework.capacity_for(eviction, max(config.bucket(len(r.prompt)) for r in requests),
                                      config.max_new_tokens)
    graphdef, params = nnx.split(model)
    # A lone row runs beside an idle one, as in `generate` (a one-row matmul rounds differently).
    s = _init_state(model.cfg, model.dtype, max(rows, 2), config, eviction, capacity)
    pending = collections.deque(requests)
    tags: list[Any] = [None] * max(rows, 2)
    admitted = [0.0] * max(rows, 2)
    reported = np.ones(max(rows, 2), bool)  # idle rows count as reported
    phase = len(requests[0].prompt)  # the batch's ticks fall where the first sample's trigger does
    results: list[Result] = []

    def admit(s: LoopState, row: int) -> LoopState:
        req = pending.popleft()
        admitted[row] = time.perf_counter()
        t = config.bucket(len(req.prompt))
        ids = np.full((1, t), config.pad_id, np.int32)
        ids[0, t - len(req.prompt):] = req.prompt
        mask = (np.arange(t) >= t - len(req.prompt)).astype(np.int32)[None]
        key = typed_key(jnp.asarray(req.key))[None]
        row_id = jnp.asarray([req.row_id], jnp.int32)
        one, first = _prefill_row(graphdef, params, jnp.asarray(ids), jnp.asarray(mask), key, row_id, config,
                                  eviction, capacity)
        tags[row] = req.tag
        reported[row] = False
        return _admit(s, jnp.int32(row), one, first, jnp.asarray([req.max_new_tokens], jnp.int32), key, row_id,
                      jnp.int32(phase), config, eviction)

    for row in range(min(rows, len(pending))):
        s = admit(s, row)
    while not reported.all():
        s = _run(graphdef, params, s, jnp.asarray(reported), config, eviction)
        stats.segments += 1
        done, num, step = jax.device_get((s.done, s.num_tokens, s.step))
        for row in np.flatnonzero(done & ~reported):
            tokens, finished, evictions = jax.device_get(_row_result(s, jnp.int32(row), config))
            result = Result(tags[row], np.asarray(tokens)[: int(num[row])], bool(finished), int(evictions),
                            time.perf_counter() - admitted[row])
            results.append(result)
            stats.useful_row_steps += int(num[row]) - 1  # token 0 comes from the prefill
            reported[row] = True
            if on_result is not None:
                on_result(result)
            if pending:
                s = admit(s, int(row))
    step, events, gap = jax.device_get((s.step, s.events, s.min_event_gap))
    stats.steps += int(step)
    stats.events += int(events)
    stats.min_event_gap = int(gap)
    stats.total_row_steps += rows * int(step)
    return results


@functools.partial(jax.jit, static_argnums=(2,))
def _row_result(s: LoopState, row, config: GenerateConfig):
    """Row `row`'s output buffer [max_new_tokens], whether its last token is an end token, and its evictions (one
    program for every row: slicing the buffer to the row's length on the host compiles nothing)."""
    tokens = s.tokens[row]
    last = tokens[jnp.maximum(s.num_tokens[row] - 1, 0)]
    return tokens, jnp.isin(last, jnp.asarray(config.eos_token_ids or (-1,), jnp.int32)), s.cache.evictions[row]
