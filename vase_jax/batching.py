"""Continuous batching: a fixed number of rows; when a row's sample ends, the next pending sample takes the row.

The engine is a device-side loop fed by the host in rounds. Each round the host prefills the next `queue` pending
samples in one batched call (`stage_prompts`: one program per prompt bucket) and hands them, staged, to the engine
(`engine_program`: one program). The engine decodes every busy row; when rows end, it copies their outputs into a
results buffer and writes staged samples into the freed rows, all on the device, and goes on decoding. It returns
to the host when every row is done, or when a row is free, nothing staged is left and the host has more samples.
The host then stages the next samples and dispatches the next round, and only then hands the round's results to
`on_result`: grading and writing records run beside the device's next round. Host round trips and prefill calls
are thus one per `queue` samples, not one per sample; the loop state is donated, so no round copies the cache.
Shapes never change, so nothing recompiles after the first round of each bucket (`compile_counts`).

A sample carries its own key, row id and cap, and its tokens depend only on them, its prompt and the settings:
they are bit-identical whichever row, batch, round or time it runs in, and to `generate` of the same sample.
With eviction, a new row starts decoding at the step that puts its trigger phase on the batch's ticks
(`EvictionConfig.phase_wait`, at most B - 1 idle steps), so the batch still runs at most one eviction event per B
steps; `full` has no ticks and starts a row at once. A prompt longer than the budget is kept whole until the
row's first eviction, as in `generate`; the capacity is max(longest prompt bucket, N) + B.

Memory beyond the batch's cache: the staged prompts' caches, `queue` rows of S slots (S = the longest prompt
bucket), and a results buffer of `rows + queue` output rows.
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
from flax import nnx, struct

from pallas_kernels.decode_tuning import fixed_splits
from vase_jax.cache import CacheLayout, KVCache, as_layout
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import (
    DEFAULT_CONFIG,
    NO_EVICTION,
    GenerateConfig,
    LoopState,
    cache_layout,
    decode_loop,
    ended,
    ended_by_token,
    first_tokens,
    generate_target,
    no_events,
    prefill_prompts,
    query_window,
    row_rule,
    split_keys,
)
from vase_jax.invariance import RowRule, padded_rows
from vase_jax.jit import target_jit
from vase_jax.model import Qwen3
from vase_jax.sampling import typed_key
from vase_jax.target import Target
from vase_jax.tiers import TierLayout


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
    segments: int = 0  # engine calls (host round trips)
    host_seconds: float = 0.0  # time in `on_result` (and building results), while the device ran the next round

    @property
    def utilization(self) -> float:
        """Useful row-steps / total row-steps."""
        return self.useful_row_steps / max(self.total_row_steps, 1)


FREE, UNUSED = -1, -2  # `EngineState.sample` of a row without a sample


@struct.dataclass
class Staged:
    """Prefilled samples waiting for a row: entries [0, count) are real."""

    cache: KVCache  # [queue] rows of S slots (S = the longest prompt bucket)
    first: jax.Array  # [queue] int32: token 0, sampled from the prefill's logits
    cap: jax.Array  # [queue] int32
    key: jax.Array  # [queue] PRNG keys (the samples' own)
    row_ids: jax.Array  # [queue] int32
    sample: jax.Array  # [queue] int32: the sample's index in the request list
    count: jax.Array  # int32 scalar


@struct.dataclass
class EngineState:
    loop: LoopState  # the batch: [rows]
    sample: jax.Array  # [rows] int32: the sample a row runs (FREE; UNUSED: the idle companion of a lone row)
    used: jax.Array  # int32 scalar: staged samples taken so far this round
    # results of the round, entries [0, out_count): a finished sample's tokens and counters
    out_tokens: jax.Array  # [rows + queue, max_new_tokens] int32
    out_num: jax.Array  # [rows + queue] int32
    out_finished: jax.Array  # [rows + queue] bool: ended by an end token
    out_evictions: jax.Array  # [rows + queue] int32
    out_sample: jax.Array  # [rows + queue] int32
    out_count: jax.Array  # int32 scalar


MAX_DEFAULT_QUEUE = 64


def default_queue(rows: int) -> int:
    """Samples prefilled per round by default: `rows`, at most `MAX_DEFAULT_QUEUE` (the staged prompts' caches
    of a large batch would otherwise hold a noticeable share of the device: 256 staged 256-token prompts of
    Qwen3-14B are 10.7 GB), at least 2 (a one-row prefill rounds differently on CPU)."""
    return max(min(rows, MAX_DEFAULT_QUEUE), 2)


def queue_for(rows: int, queue: int | None, rule: RowRule) -> int:
    """The samples `run` prefills per round: `queue`, or `default_queue(rows)`; at least `rule.min_rows` (a
    smaller prefill batch rounds differently where the rule says so, `vase_jax.invariance`)."""
    queue = default_queue(rows) if queue is None else queue
    return padded_rows(queue, rule)


def staged_layout(capacity: CacheLayout | TierLayout, prompt_slots: int, eviction: EvictionConfig):
    """The cache a round's staged prompts are prefilled into: one of `prompt_slots` (`for_prompts`), or with prompt
    compression the batch's own N + B slots (`capacity`)."""
    return capacity if eviction.compress_prompt else capacity.for_prompts(prompt_slots)


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


# ---- device programs ---------------------------------------------------------------------------------------------
@functools.partial(target_jit, static_argnums=(0, 9, 10, 11, 12), target_argnum=12)
def stage_prompts(graphdef, params, input_ids, attention_mask, keys, row_ids, caps, sample, count,
                  config: GenerateConfig, eviction: EvictionConfig, slots: CacheLayout | TierLayout,
                  target: Target) -> Staged:
    """Prefill `queue` left-padded prompts [queue, bucket] into a cache of layout `slots`, and sample token 0."""
    model = nnx.merge(graphdef, params)
    sample_key, evict_key = split_keys(keys, keys.shape[0])
    logits, cache = prefill_prompts(model, input_ids, attention_mask, slots, config, eviction, evict_key, row_ids,
                                    target)
    first = first_tokens(logits, sample_key, row_ids, config, target)
    return Staged(cache=cache, first=first, cap=caps, key=keys, row_ids=row_ids, sample=sample, count=count)


def _collect(e: EngineState, config: GenerateConfig) -> EngineState:
    """Copy the outputs of the rows whose sample ended into the results buffer; those rows become free."""
    s = e.loop
    ended_rows = s.done & (e.sample >= 0)  # [rows]
    out_size = e.out_num.shape[0]
    slot = jnp.where(ended_rows, e.out_count + jnp.cumsum(ended_rows) - 1, out_size)  # others: dropped

    def put(out, x):
        return out.at[slot].set(x, mode="drop")

    return e.replace(out_tokens=put(e.out_tokens, s.tokens), out_num=put(e.out_num, s.num_tokens),
                     out_finished=put(e.out_finished, ended_by_token(s, config)),
                     out_evictions=put(e.out_evictions, s.cache.evictions), out_sample=put(e.out_sample, e.sample),
                     out_count=e.out_count + ended_rows.sum(dtype=jnp.int32),
                     sample=jnp.where(ended_rows, FREE, e.sample))


def _admit(e: EngineState, staged: Staged, phase, config: GenerateConfig, eviction: EvictionConfig) -> EngineState:
    """Write staged samples into free rows (in row order) until either runs out. A sample starts decoding now, or
    when its trigger phase meets the batch's ticks."""
    free = e.loop.done & (e.sample == FREE)  # [rows]
    rows = free.shape[0]
    order = jnp.nonzero(free, size=rows, fill_value=0)[0]  # free rows first
    n = jnp.minimum(free.sum(dtype=jnp.int32), staged.count - e.used)

    def admit_one(i, e: EngineState) -> EngineState:
        row, j = order[i], e.used + i
        s = e.loop
        one = staged.cache.take_row(j, s.cache)
        first = jax.lax.dynamic_slice_in_dim(staged.first, j, 1)
        cap = jax.lax.dynamic_slice_in_dim(staged.cap, j, 1)
        key = jax.lax.dynamic_slice_in_dim(staged.key, j, 1)
        sample_key, evict_key = split_keys(key, 1)
        wait = s.cache.phase_wait(one.seen[0] - phase, s.step, eviction)
        tokens_row = jnp.full((1, s.tokens.shape[1]), config.pad_id, jnp.int32).at[0, 0].set(first[0])

        def put(x, value):  # x [rows, ...] <- value [1, ...] at `row`
            return jax.lax.dynamic_update_slice_in_dim(x, jnp.asarray(value, x.dtype).reshape((1,) + x.shape[1:]),
                                                       row, 0)

        s = s.replace(
            cache=s.cache.put_row(one.replace(active=jnp.zeros((1,), bool)), row),
            tokens=jax.lax.dynamic_update_slice_in_dim(s.tokens, tokens_row, row, 0), last=put(s.last, first),
            done=put(s.done, ended(first, jnp.ones((1,), jnp.int32), cap, config)), num_tokens=put(s.num_tokens, 1),
            cap=put(s.cap, cap), start=put(s.start, s.step + wait), sample_key=put(s.sample_key, sample_key),
            evict_key=put(s.evict_key, evict_key), row_ids=put(s.row_ids, staged.row_ids[j]))
        return e.replace(loop=s, sample=put(e.sample, staged.sample[j]))

    e = jax.lax.fori_loop(0, n, admit_one, e)
    return e.replace(used=e.used + n)


@functools.partial(target_jit, static_argnums=(0, 6, 7, 8), target_argnum=8, donate_argnums=(2,))
def engine_program(graphdef, params, e: EngineState, staged: Staged, more, phase, config: GenerateConfig,
            eviction: EvictionConfig, target: Target) -> EngineState:
    """One round: admit staged samples into free rows, decode, collect ended rows and refill them, until every row
    is done, or a row is free with nothing staged while the host has `more` samples."""
    with fixed_splits(config.batch_invariant):  # the decode kernel's splits as in `generate`
        return _engine_round(graphdef, params, e, staged, more, phase, config, eviction, target)


def _engine_round(graphdef, params, e: EngineState, staged: Staged, more, phase, config: GenerateConfig,
                  eviction: EvictionConfig, target: Target) -> EngineState:
    model = nnx.merge(graphdef, params)
    e = e.replace(used=jnp.int32(0), out_count=jnp.int32(0))
    e = _admit(_collect(e, config), staged, phase, config, eviction)

    def going(e: EngineState) -> jax.Array:
        starved = more & (e.used >= staged.count) & jnp.any(e.loop.done & (e.sample == FREE))
        return jnp.any(~e.loop.done) & ~starved

    def round_step(e: EngineState) -> EngineState:
        running = e.sample >= 0
        s = decode_loop(model, e.loop, config, eviction, lambda s: ~jnp.any(s.done & running), target)
        return _admit(_collect(e.replace(loop=s), config), staged, phase, config, eviction)

    return jax.lax.while_loop(going, round_step, e)


@functools.partial(target_jit, static_argnums=(0, 1, 2, 3, 4, 5, 6, 7, 8), target_argnum=8)
def init_state(cfg, dtype, rows: int, width: int, queue: int, config: GenerateConfig, eviction: EvictionConfig,
                capacity: int | CacheLayout | TierLayout, target: Target) -> EngineState:
    """Every row free (done, inactive), the results buffer empty. `width` >= `rows`: the batch the engine runs,
    the rows past `rows` unused companions (as `generate` pads a small batch: `vase_jax.invariance`). `capacity`:
    the cache's layout (`generate.cache_layout`), or a slot count for a 16-bit cache."""
    sample = jnp.full((width,), FREE, jnp.int32).at[rows:].set(UNUSED)
    rows = width
    cache = as_layout(capacity).init(cfg, rows, query_window(eviction), dtype, framework.slot_state(eviction), target)
    keys = jnp.broadcast_to(jax.random.key(0), (rows,))
    zeros = jnp.zeros((rows,), jnp.int32)
    loop = LoopState(cache=cache.replace(active=jnp.zeros((rows,), bool)),
                     tokens=jnp.full((rows, config.max_new_tokens), config.pad_id, jnp.int32), last=zeros,
                     done=jnp.ones((rows,), bool), num_tokens=zeros, cap=zeros + 1, start=zeros, sample_key=keys,
                     evict_key=keys, row_ids=zeros, step=jnp.int32(0), **no_events())
    out = rows + queue
    return EngineState(loop=loop, sample=sample, used=jnp.int32(0),
                       out_tokens=jnp.zeros((out, config.max_new_tokens), jnp.int32),
                       out_num=jnp.zeros((out,), jnp.int32), out_finished=jnp.zeros((out,), bool),
                       out_evictions=jnp.zeros((out,), jnp.int32), out_sample=jnp.zeros((out,), jnp.int32),
                       out_count=jnp.int32(0))


def compile_counts() -> dict[str, int]:
    """Programs compiled so far by the engine: {"prefill": one per (bucket, settings), "decode", "init"}."""
    return {"prefill": stage_prompts.traces, "decode": engine_program.traces, "init": init_state.traces}


# ---- the host loop -----------------------------------------------------------------------------------------------
def run(
    model: Qwen3,
    requests: Iterable[Request],
    *,
    rows: int,
    config: GenerateConfig = DEFAULT_CONFIG,
    eviction: EvictionConfig = NO_EVICTION,
    on_result: Callable[[Result], None] | None = None,
    stats: EngineStats | None = None,
    queue: int | None = None,
) -> list[Result]:
    """Generate every request on a batch of `rows` rows, refilling a row as soon as its sample ends.

    `on_result` is called with each sample's `Result` when the host sees it end (at the end of the engine's round,
    in end order); the list of results is also returned in that order. It runs while the device runs the next
    round (already dispatched), so grading and writing records do not stall the device unless they take longer
    than a round; `stats.host_seconds` adds up their time. `stats` (optional) receives the step counts
    and the row utilization. `queue`: samples prefilled per round (default `default_queue(rows)`: `rows`, at most
    64; at least the machine's `RowRule.min_rows`): fewer hold less memory (the staged prompts) and report
    results sooner, more make fewer round trips.
    """
    requests = list(requests)
    config.validate()
    eviction.validate()
    if not isinstance(model, Qwen3):
        raise ValueError(f"model must be a vase_jax.Qwen3, got {type(model).__name__}")
    framework.check_model(eviction, model.cfg)
    validate_requests(requests, rows, config)
    if queue is not None and (not isinstance(queue, int) or isinstance(queue, bool) or queue < 1):
        raise ValueError(f"queue={queue!r} must be a positive int (samples prefilled per round)")
    target = generate_target(model, config)
    rule = row_rule(model, config, target)
    queue = queue_for(rows, queue, rule)
    stats = stats if stats is not None else EngineStats()
    if not requests:
        return []
    slots = max(config.bucket(len(r.prompt)) for r in requests)
    capacity = cache_layout(model.cfg, config, eviction, slots)
    slots = staged_layout(capacity, slots, eviction)
    graphdef, params = nnx.split(model)
    e = init_state(model.cfg, model.dtype, rows, padded_rows(rows, rule), queue, config, eviction, capacity,
                    target)
    pending = collections.deque(enumerate(requests))
    phase = jnp.int32(len(requests[0].prompt))  # the batch's ticks fall where the first sample's trigger does
    staged_at: dict[int, float] = {}
    results: list[Result] = []

    def next_round(e: EngineState) -> EngineState:  # dispatched, not waited for: the device runs it from here
        staged = _stage_next(graphdef, params, pending, queue, config, eviction, slots, staged_at, target)
        stats.segments += 1
        return engine_program(graphdef, params, e, staged, jnp.bool_(bool(pending)), phase, config, eviction, target)

    e = next_round(e)
    while True:
        count, nums, finished, evictions, samples, tokens = jax.device_get(
            (e.out_count, e.out_num, e.out_finished, e.out_evictions, e.out_sample, e.out_tokens))
        last = not pending
        if not last:  # the next round runs on the device while the host hands this round's results out
            e = next_round(e)
        start = time.perf_counter()
        for i in range(int(count)):
            index = int(samples[i])
            result = Result(requests[index].tag, np.asarray(tokens[i, : int(nums[i])]), bool(finished[i]),
                            int(evictions[i]), start - staged_at.pop(index))
            results.append(result)
            stats.useful_row_steps += int(nums[i]) - 1  # token 0 comes from the prefill
            if on_result is not None:
                on_result(result)
        stats.host_seconds += time.perf_counter() - start
        if last:
            break
    step, events, gap = jax.device_get((e.loop.step, e.loop.events, e.loop.min_event_gap))
    stats.steps += int(step)
    stats.events += int(events)
    stats.min_event_gap = int(gap)
    stats.total_row_steps += rows * int(step)
    return results


def _stage_next(graphdef, params, pending: collections.deque, queue: int, config: GenerateConfig,
                eviction: EvictionConfig, slots: CacheLayout | TierLayout, staged_at: dict[int, float],
                target: Target) -> Staged:
    """Take up to `queue` pending samples and prefill them as one batch (padded with copies of the first)."""
    batch = [pending.popleft() for _ in range(min(queue, len(pending)))]
    now = time.perf_counter()
    staged_at.update((index, now) for index, _ in batch)
    reqs = [r for _, r in batch]
    reqs += [reqs[0]] * (queue - len(reqs))
    t = max(config.bucket(len(r.prompt)) for r in reqs)
    ids = np.full((queue, t), config.pad_id, np.int32)
    mask = np.zeros((queue, t), np.int32)
    for i, r in enumerate(reqs):
        ids[i, t - len(r.prompt):] = r.prompt
        mask[i, t - len(r.prompt):] = 1
    keys = jnp.stack([typed_key(jnp.asarray(r.key)) for r in reqs])
    index = [i for i, _ in batch] + [-1] * (queue - len(batch))
    return stage_prompts(graphdef, params, jnp.asarray(ids), jnp.asarray(mask), keys,
                  jnp.asarray([r.row_id for r in reqs], jnp.int32), jnp.asarray([r.max_new_tokens for r in reqs],
                                                                                  jnp.int32),
                  jnp.asarray(index, jnp.int32), jnp.int32(len(batch)), config, eviction, slots, target)
