"""Benchmark building blocks (used by `scripts/bench.py`): random models of named shapes, timing statistics,
memory bandwidth, the bytes a decode step must read, pieces of `generate` timed alone, and HF weight export.

Roofline of one decode step (memory bound at small batch): a step reads every weight once (the embedding
table only through the tied LM head; an untied table is read one row per token) and, per layer, the K, V and
`pos` of every live slot:

    bytes(step) = weight_bytes + slots_read * batch * layers * kv_heads * (2 * head_dim * itemsize + 4)

and an eviction event reads and rewrites the `budget + buffer` slots of every layer (2x their bytes). The
bound on decode tokens/s over a run is batch * steps * bandwidth / sum(bytes) = batch * bandwidth / mean bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vase_jax import batching, planner, random_model, weights
from vase_jax.cache import KVCache, init_cache, stored
from vase_jax.config import Qwen3Config
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import GenerateConfig, decode_step, row_rule
from vase_jax.generate import prefill as generate_prefill
from vase_jax.jit import target_jit
from vase_jax.model import Qwen3
from vase_jax.target import Target, platform_of

# Named model shapes live in the library (`random_model.named_configs`); these names stay for the benchmarks.
TINY, SMALL, named_configs, shrink = random_model.TINY_1K, random_model.SMALL, random_model.named_configs, \
    random_model.shrink


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


QUIET_LOAD = 1.2  # a 1-minute load average above this distorts CPU timings (and their ratios)


def load_warning(load: float) -> str | None:
    """A warning when the machine is busy, or None."""
    if load <= QUIET_LOAD:
        return None
    return (f"load average {load:.2f} > {QUIET_LOAD}: other processes share the CPU; timings and ratios (HF's "
            f"thread pool suffers more than XLA's) are not reliable; benchmark on a quiet machine")


def param_bytes(model: Qwen3) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ---- statistics and timing ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Stat:
    """Median, min and max of repeated measurements (and the raw values)."""

    median: float
    min: float
    max: float
    runs: tuple[float, ...]

    @classmethod
    def of(cls, values) -> Stat:
        values = tuple(float(v) for v in values)
        return cls(statistics.median(values), min(values), max(values), values)

    def map(self, fn: Callable[[float], float]) -> Stat:
        """The statistics of `fn` applied to every run (e.g. seconds -> tokens/s)."""
        return Stat.of(fn(v) for v in self.runs)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def time_runs(fn: Callable[[], object], repeats: int, warmup: int = 0) -> Stat:
    """Wall seconds of `fn()` (result passed to `jax.block_until_ready`), after `warmup` untimed calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return Stat.of(times)


def decode_rate(total: Stat, prefill: Stat, tokens: int) -> Stat | None:
    """tokens / (total - fastest prefill) per run. Each run holds one prefill, never (but for noise) faster than
    the fastest one timed alone, so a run's decode time is not underestimated by a slow prefill sample on a busy
    machine (with the median, a noisy prefill once exceeded a short run's total). None when a run is still not
    longer than the prefill (too short to separate the decode steps from the noise)."""
    decode = [t - prefill.min for t in total.runs]
    return None if min(decode) <= 0 else Stat.of(tokens / d for d in decode)


def bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> dict[str, float]:
    """Measured memory bandwidth in bytes/s: read (a sum) with NumPy and with JAX, and a JAX in-place copy
    ((read + write) bytes of `x + 1`). The roofline uses the larger read figure."""
    n = num_bytes // 4
    host = np.ones(n, np.float32)
    numpy_sum = time_runs(lambda: host.sum(), repeats, warmup=1).min
    dev = jnp.ones((n,), jnp.float32)
    jax_sum = time_runs(lambda: _sum(dev), repeats, warmup=1).min
    box = [dev]

    def add_one():  # in place (donated), so no fresh pages are touched
        box[0] = _add_one(box[0])
        return box[0]

    jax_copy = time_runs(add_one, repeats, warmup=1).min

    return {
        "numpy_read": num_bytes / numpy_sum,
        "jax_read": num_bytes / jax_sum,
        "jax_copy": 2 * num_bytes / jax_copy,
    }


_sum = jax.jit(jnp.sum)
_add_one = jax.jit(lambda x: x + 1.0, donate_argnums=0)


# ---- bytes per decode step ---------------------------------------------------------------------------------
def weight_bytes_per_step(model: Qwen3) -> int:
    """Parameter bytes a decode step reads: all, except an untied embedding table (one row per token)."""
    total = param_bytes(model)
    if not model.cfg.tie_word_embeddings:
        total -= model.embedding[...].size * model.embedding[...].dtype.itemsize
    return total


def slot_bytes(cfg: Qwen3Config, batch: int, itemsize: int) -> int:
    """Bytes of one cache slot over the batch and every layer: K and V (head_dim each) and the int32 `pos`."""
    return batch * cfg.num_layers * cfg.num_kv_heads * (2 * cfg.head_dim * itemsize + 4)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The cache over a fixed-length generation, as `generate` runs it."""

    slots_read: np.ndarray  # [steps] slots each decode step attends over (its own new slot included)
    events: int  # eviction events
    final_length: int  # slots in use at the end


def cache_schedule(eviction: EvictionConfig, prompt_tokens: int, max_new_tokens: int) -> Schedule:
    """Replay the loop of `generate` for a row of `prompt_tokens` real tokens (the cache holds no padding): step
    s writes slot `length` and attends over `length + 1` slots; after each step the eviction of
    `framework.trigger` (real tokens > N and a multiple of B) sets the length back to N."""
    length, events = prompt_tokens, 0
    reads = np.empty(max_new_tokens - 1, np.int64)
    for s in range(max_new_tokens - 1):
        reads[s] = length + 1
        length += 1
        if eviction.evicts and framework.trigger(length, eviction):
            length = eviction.budget
            events += 1
    return Schedule(reads, events, length)


def roofline(model: Qwen3, eviction: EvictionConfig, schedule: Schedule, batch: int, itemsize: int) -> dict:
    """Bytes a decode step reads at the start, at the end and on average over the run (eviction events
    amortized). The tokens/s bound at read bandwidth `bw` is batch * bw / bytes_step_mean."""
    w = weight_bytes_per_step(model)
    per_slot = slot_bytes(model.cfg, batch, itemsize)
    evict_bytes = 2 * (eviction.budget + eviction.buffer) * per_slot if eviction.evicts else 0
    steps = len(schedule.slots_read)
    total = steps * w + int(schedule.slots_read.sum()) * per_slot + schedule.events * evict_bytes
    return {
        "weight_bytes": w,
        "bytes_step_start": w + int(schedule.slots_read[0]) * per_slot,
        "bytes_step_end": w + int(schedule.slots_read[-1]) * per_slot,
        "bytes_step_mean": total / steps,
        "bytes_per_eviction": evict_bytes,
    }


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


@functools.partial(target_jit, static_argnums=(0, 4, 5, 6, 7, 8), target_argnum=8)
def prefill(graphdef, state, input_ids, attention_mask, capacity: int, window: int, attention_impl: str,
            slot_state: tuple, target: Target):
    """What `generate` does before its loop: the prompt forward pass, the cache of `capacity` slots (with the
    policy's per-slot `slot_state`) and the first (greedy) token. Returns (first token [batch], cache)."""
    logits, cache = generate_prefill(nnx.merge(graphdef, state), input_ids, attention_mask, capacity, window,
                                     attention_impl, slot_state, target=target)
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
    from vase_jax.tiers import init_tiered_cache  # noqa: PLC0415 (tiers imports generate's modules)

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


# ---- Hugging Face export -----------------------------------------------------------------------------------
def hf_config(cfg: Qwen3Config):
    """The `transformers.Qwen3Config` of the same shape."""
    from transformers import Qwen3Config as HFConfig  # noqa: PLC0415 (HF comparisons only: 1.7 s to import)

    return HFConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )


def to_hf(model: Qwen3, torch_dtype=None):
    """A `transformers.Qwen3ForCausalLM` holding `model`'s weights (eval mode)."""
    import torch  # noqa: PLC0415 (the `test` extra: the HF reference only)
    from transformers import Qwen3ForCausalLM  # noqa: PLC0415

    torch_dtype = torch_dtype or torch.float32
    hf = Qwen3ForCausalLM(hf_config(model.cfg)).eval()
    exported = weights.hf_state_dict(weights.flat_params(model), model.cfg)
    state = {k: torch.from_numpy(np.array(v, np.float32, copy=True)) for k, v in exported.items()}
    hf.load_state_dict(state, strict=True)
    return hf.to(torch_dtype)


# ---- the AIME25 protocol on random weights: measured windows, projected whole ----------------------------------
# The paper's AIME25 protocol (its "samples per problem R"): 30 problems x R = 16
# samples, at most 32768 tokens per sample in all (prompt + output), Qwen3's sampling (temperature 0.6, top-p 0.95).
AIME25 = {"samples": 480, "prompt_len": 256, "total_tokens": 32768, "median": 12000, "sigma": 0.5}
# The spec gives no per-sample output lengths for AIME25. A log-normal with median 12k and sigma 0.5 (our choice),
# cut at the cap, is heavy-tailed to the right, puts about 2% of the samples at the cap and averages about 13.4k
# tokens: about 6.4M generated tokens per method (the issue's ~6M).
AIME25_TINY = {"samples": 24, "prompt_len": 16, "total_tokens": 256, "median": 96, "sigma": 0.5}


def lognormal_lengths(samples: int, *, median: float, sigma: float, cap: int, seed: int = 0) -> np.ndarray:
    """Output lengths (tokens, the end token included) of `samples` samples: round(median * exp(sigma * z)),
    z ~ N(0, 1) from `np.random.default_rng(seed)`, clipped to [2, cap] (a prefill token and a decode step at
    least). [samples] int32."""
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples={samples!r} must be a positive int")
    if not median > 0 or not sigma >= 0:
        raise ValueError(f"median={median!r} must be > 0 and sigma={sigma!r} >= 0")
    if not isinstance(cap, int) or cap < 2:
        raise ValueError(f"cap={cap!r} must be an int >= 2")
    z = np.random.default_rng(seed).standard_normal(samples)
    return np.clip(np.rint(median * np.exp(sigma * z)), 2, cap).astype(np.int32)


def row_replay(eviction: EvictionConfig, prompt_len: int, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row's cache over `steps` decode steps, as `batching` runs it (`cache_schedule` for one row):
    `reads[k - 1]`: slots it holds during its k-th step (its new token's included), `after[k]`: after the k-th
    step and its eviction (`after[0]` = the prompt), `triggers`: the steps k after which the row is evicted."""
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


@dataclasses.dataclass(frozen=True)
class EngineSchedule:
    """What `batching.run` does with a list of sample lengths, replayed on the host (`simulate_engine`)."""

    rows: int
    queue: int
    samples: int
    tokens: int  # sum of the lengths
    rounds: int  # engine calls (one prefill of up to `queue` samples each)
    steps: int  # decode steps the batch runs
    events: int  # eviction events (steps after which some row is evicted)
    # cache slots the steps' attention reads, summed over steps and rows, for the two ways a decode attention
    # bounds a row: by its own length (the Pallas kernels), or by the longest row's (the XLA path: rows x longest)
    own_slot_reads: int
    longest_slot_reads: int
    useful_row_steps: int  # row-steps that produce a token of some sample

    @property
    def utilization(self) -> float:
        return self.useful_row_steps / max(self.rows * self.steps, 1)

    def slot_reads(self, reads: str) -> int:
        """`own_slot_reads` (reads="own") or `longest_slot_reads` (reads="longest")."""
        return self.own_slot_reads if reads == "own" else self.longest_slot_reads

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"utilization": self.utilization}


_FREE = -1


def simulate_engine(lengths, rows: int, eviction: EvictionConfig, prompt_len: int,
                    queue: int | None = None) -> EngineSchedule:
    """Replay `batching.run` on samples of `lengths` tokens (each ends at its cap, as with no end token), all with
    prompts of `prompt_len` tokens, on `rows` rows, `queue` samples staged per round (default
    `batching.default_queue(rows)`, as `run`).

    The engine's rules: each round stages the next `queue` samples; a free row (in row order) takes the next
    staged sample and starts decoding at once (`full`) or at the next multiple of B steps (eviction: its trigger
    phase on the batch's ticks); a sample of n tokens decodes n - 1 steps; the round ends when every row is done,
    or when a row is free, nothing staged is left and more samples wait; the last round drains. A row holds its
    prompt while it waits, one slot more per step (back to N after an eviction), and its last length once ended,
    until a new sample takes it; a step's attention reads the slots of the rows that decode (an inactive row's
    length is 0 to it), up to the row's own length (`own_slot_reads`) or up to the longest row's
    (`longest_slot_reads`). Returns the step, round and
    event counts and the slots read."""
    lengths = np.asarray(lengths, np.int64)
    rows = int(rows)
    queue = batching.default_queue(rows) if queue is None else int(queue)
    period = eviction.buffer if eviction.evicts else 1
    sample = [_FREE] * rows
    done_at = [0] * rows  # the step count at which the row's sample is done
    occupancy: list[list[tuple[int, int, int]]] = [[] for _ in range(rows)]  # per row: (admitted, start, steps)
    pending = list(range(len(lengths)))[::-1]
    t = rounds = 0

    def collect_admit(staged: list[int], used: int, t: int) -> int:
        """The ended rows become free; free rows take staged samples in row order. Returns the staged used."""
        for r in range(rows):
            if sample[r] >= 0 and done_at[r] <= t:
                sample[r] = _FREE
        for r in range(rows):
            if sample[r] == _FREE and used < len(staged):
                i, n = staged[used], int(lengths[staged[used]]) - 1
                used += 1
                start = t + (-t) % period
                sample[r], done_at[r] = i, (start + n if n > 0 else t)
                occupancy[r].append((t, start, n))
        return used

    while pending:
        staged = [pending.pop() for _ in range(min(queue, len(pending)))]
        rounds += 1
        more = bool(pending)
        used = collect_admit(staged, 0, t)
        while True:
            busy = [done_at[r] for r in range(rows) if sample[r] >= 0 and done_at[r] > t]
            starved = more and used >= len(staged) and _FREE in sample
            if not busy or starved:
                break
            if not any(sample[r] >= 0 and done_at[r] <= t for r in range(rows)):
                t = min(busy)  # decode until a running row is done
            used = collect_admit(staged, used, t)
    longest = int(lengths.max()) - 1 if len(lengths) else 0
    reads, after, triggers = row_replay(eviction, prompt_len, max(longest, 1))
    longest = np.zeros(t, np.int64)  # [steps] the longest row's cache length at each step
    own = 0  # every row's length, summed over steps
    event = np.zeros(t, bool)
    useful = 0
    cumulative = np.concatenate([[0], np.cumsum(reads)])
    for r in range(rows):
        for _, start, n in occupancy[r]:
            useful += n
            # a row reads its slots only while it decodes: waiting for its tick and once ended it is inactive,
            # and the attention reads nothing of it (`model.attention`)
            longest[start:start + n] = np.maximum(longest[start:start + n], reads[:n])
            own += int(cumulative[n])
            event[start + triggers[triggers <= n] - 1] = True
    return EngineSchedule(rows=rows, queue=queue, samples=len(lengths), tokens=int(lengths.sum()), rounds=rounds,
                          steps=t, events=int(event.sum()), own_slot_reads=own,
                          longest_slot_reads=rows * int(longest.sum()), useful_row_steps=useful)


PROJECTION = ("T = rounds * round_s + steps * step_s + slot_reads * slot_s + events * event_s (rounds, steps, "
              "slot_reads, events: the engine's schedule of the drawn lengths, simulated; slot_reads: the cache "
              "slots the steps' attention reads, over rows and steps; the seconds: fitted to the measured runs)")
ATTENTION_READS = ("own", "longest")


def attention_reads(platform: str, attention_impl: str) -> str:
    """How the decode attention bounds a row, per platform and `GenerateConfig.attention_impl`: the Pallas
    kernels (cuda, tpu; "auto", "pallas", "pallas_gpu", "pallas_tpu") read each row's slots up to its own length
    ("own"); the XLA path (CPU's, or "xla") loops to the longest row's ("longest")."""
    if attention_impl == "xla" or (platform == "cpu" and attention_impl == "auto"):
        return "longest"
    return "own"


@dataclasses.dataclass(frozen=True)
class StepModel:
    """Wall seconds of an engine run from its schedule (`EngineSchedule`):

        T = rounds * round_s + steps * step_s + slot_reads * slot_s + events * event_s

    `round_s`: a round's prefill, admissions, results and host round trip (with the run's setup); `step_s`: a decode
    step's fixed cost (weights, sampling); `slot_s`: per cache slot a row's attention reads (slot_reads: the
    schedule's `slot_reads(reads)`, reads "own" or "longest": `attention_reads`); `event_s`: an eviction event."""

    round_s: float
    step_s: float
    slot_s: float
    event_s: float
    reads: str = "own"

    def seconds(self, s: EngineSchedule) -> float:
        return (s.rounds * self.round_s + s.steps * self.step_s + s.slot_reads(self.reads) * self.slot_s
                + s.events * self.event_s)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def fit_step_model(round_s: float, windows: list[tuple[EngineSchedule, float]], reads: str = "own") -> StepModel:
    """`StepModel` from measured runs [(schedule, seconds)]: y = seconds - rounds * round_s regressed on (steps,
    slot_reads, events) by non-negative least squares: every subset of the columns that keeps `steps` (and leaves
    out columns that are zero in every run) is solved by least squares, and among those whose coefficients are all
    >= 0, the one of fewest columns whose squared error is within 1e-9 * |y|^2 of the least is kept; if none is,
    step_s = sum(y) / sum(steps)."""
    if not windows:
        raise ValueError("fit_step_model: no measured runs")
    if reads not in ATTENTION_READS:
        raise ValueError(f"reads={reads!r}; allowed: {', '.join(ATTENTION_READS)}")
    x = np.array([[s.steps, s.slot_reads(reads), s.events] for s, _ in windows], np.float64)
    y = np.array([sec - s.rounds * round_s for s, sec in windows], np.float64)
    live = [j for j in (1, 2) if x[:, j].any()]
    fits = []
    for extra in ([], *[[j] for j in live], live if len(live) == 2 else []):
        cols = [0, *extra]
        if len(cols) > len(windows):
            continue
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (coef >= 0).all():
            fits.append((float(np.sum((x[:, cols] @ coef - y) ** 2)), len(cols), dict(zip(cols, coef, strict=True))))
    best = None
    if fits:  # the fewest columns among the best fits (in lockstep runs past the first eviction, slot_reads is a
        # combination of steps and events: the three columns are collinear, and the smaller model is as good)
        least = min(err for err, _, _ in fits)
        best = min((n, err, i) for i, (err, n, _) in enumerate(fits) if err <= least + 1e-9 * float(y @ y))
        best = fits[best[2]][2]
    if best is None:
        best = {0: max(float(y.sum()), 0.0) / max(float(x[:, 0].sum()), 1.0)}
    return StepModel(round_s, float(best.get(0, 0.0)), float(best.get(1, 0.0)), float(best.get(2, 0.0)), reads)


def model_device(model: Qwen3) -> jax.Device:
    """The device holding the model's weights."""
    return next(iter(jax.tree.leaves(nnx.state(model))[0].devices()))


def method_label(ev: EvictionConfig) -> str:
    """"full", or "method@budget"."""
    return f"{ev.method}@{ev.budget}" if ev.evicts else ev.method


def _run_timed(model: Qwen3, reqs: list, rows: int, queue: int, config: GenerateConfig, ev: EvictionConfig,
               prompt_len: int) -> tuple[float, batching.EngineStats, EngineSchedule]:
    """Wall seconds of `batching.run` on `reqs`, its stats, and the simulated schedule of the same run."""
    stats = batching.EngineStats()
    start = time.perf_counter()
    batching.run(model, reqs, rows=rows, config=config, eviction=ev, stats=stats, queue=queue)
    seconds = time.perf_counter() - start
    return seconds, stats, simulate_engine([r.max_new_tokens for r in reqs], rows, ev, prompt_len, queue)


def _check_scale(model_fit: StepModel, lengths: np.ndarray, rows: int, ev: EvictionConfig, prompt_len: int,
                 queue: int, cap: int, seconds: float) -> float:
    """The largest factor f in (0, 1] (bisection, 12 halvings) whose lengths round(lengths * f) the model says run
    within `seconds`."""
    def predicted(f: float) -> float:
        caps = np.clip(np.rint(lengths * f), 2, cap)
        return model_fit.seconds(simulate_engine(caps, rows, ev, prompt_len, queue))

    if predicted(1.0) <= seconds:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) <= seconds else (lo, mid)
    return max(lo, 1e-6)


def measure_engine(model: Qwen3, ev: EvictionConfig, make_requests: Callable[[list[int]], list], rows: int,
                   queue: int, config: GenerateConfig, prompt_len: int, lengths: np.ndarray, seconds: float,
                   check_share: float, first_window: int, reads: str, log: Callable[[str], None]) -> dict:
    """Steps 1-3 of `aime25_workload` for one method on `rows` rows (after the compile): round_s, the lockstep
    windows, the fitted `StepModel` (slots counted as `reads`) and the continuous check. Returns its record (with
    the model as "fit")."""
    label, cap = method_label(ev), config.max_new_tokens
    t0 = time.perf_counter()

    def timed(caps):
        return _run_timed(model, make_requests(caps), rows, queue, config, ev, prompt_len)

    round_s = Stat.of(timed([1] * rows)[0] for _ in range(3))
    triggers = row_replay(ev, prompt_len, cap - 1)[2] if ev.evicts else np.zeros(0, np.int64)
    reach = min(int(triggers[0]) + 2 * ev.buffer + 1, cap) if len(triggers) else 0  # two events past the first
    windows, matches = [], []
    length, fit = min(first_window, cap), None
    window_end = t0 + (1 - check_share) * seconds
    while True:
        sched = simulate_engine([length] * rows, rows, ev, prompt_len, queue)
        if fit is not None:
            predicted = fit.seconds(sched)
        elif windows:  # one window so far: its seconds per step, doubled for the slots' growth
            s0, sec0 = windows[-1]
            predicted = round_s.median + 2 * (sec0 - round_s.median) * sched.steps / max(s0.steps, 1)
        else:
            predicted = 0.0
        if len(windows) >= 2 and time.perf_counter() + predicted > window_end:
            break
        sec, stats, sched = timed([length] * rows)
        windows.append((sched, sec))
        matches.append(stats.steps == sched.steps and stats.events == sched.events)
        fit = fit_step_model(round_s.median, windows, reads) if len(windows) >= 2 else None
        log(f"{label}: window {length} tokens x {rows} rows: {sec:.2f} s ({sched.steps} steps, {sched.events} "
            "events)")
        if length >= cap:
            break
        nxt = min(2 * length, cap)
        if reach > nxt and fit is not None and not any(s.events for s, _ in windows) and (
                time.perf_counter() + fit.seconds(simulate_engine([reach] * rows, rows, ev, prompt_len, queue))
                <= window_end):
            nxt = reach  # past the first eviction while the time allows: the events' cost is measured
        length = nxt
    fit = fit_step_model(round_s.median, windows, reads)
    first = lengths[: min(len(lengths), 3 * rows)]
    scale = _check_scale(fit, first, rows, ev, prompt_len, queue, cap,
                         max(t0 + seconds - time.perf_counter(), 0.0))
    caps = np.clip(np.rint(first * scale), 2, cap).astype(np.int32)
    sec, stats, sched = timed(caps.tolist())
    matches.append(stats.steps == sched.steps and stats.events == sched.events)
    check = {"samples": len(caps), "scale": scale, "tokens": int(caps.sum()), "seconds": sec,
             "predicted_s": fit.seconds(sched), "tok_s": int(caps.sum()) / sec, "steps": sched.steps,
             "engine_steps": stats.steps, "events": sched.events, "engine_events": stats.events,
             "utilization": sched.utilization}
    check["error"] = check["predicted_s"] / sec - 1
    log(f"{label}: check {len(caps)} samples (lengths x {scale:.3f}): {sec:.2f} s measured, "
        f"{check['predicted_s']:.2f} s predicted")
    last, last_s = windows[-1]
    return {"fit": fit, "round_s": round_s.as_dict(), "model": fit.as_dict(), "check": check,
            "windows": [{"length": s.tokens // s.samples, "seconds": w, "steps": s.steps, "events": s.events,
                         "slot_reads": s.slot_reads(reads), "tok_s": s.tokens / w, "predicted_s": fit.seconds(s)}
                        for s, w in windows],
            "window_tok_s": last.tokens / last_s, "schedules_match_engine": all(matches),
            "steady": (not ev.evicts) or any(s.events > 0 for s, _ in windows),
            "measure_s": time.perf_counter() - t0}


DEADLINE_MARGIN_S = 15.0  # aime25_workload: left after the measuring for the projection and the write


def aime25_workload(model: Qwen3, methods: list[EvictionConfig], *, seconds_per_method: float = 120.0,
                    batch: int | dict[str, int] | None = None, samples: int = AIME25["samples"],
                    prompt_len: int = AIME25["prompt_len"], total_tokens: int = AIME25["total_tokens"],
                    median: float = AIME25["median"], sigma: float = AIME25["sigma"], seed: int = 0,
                    device_bytes: int | None = None, headroom: float = planner.DEFAULT_HEADROOM,
                    queue: int | None = None, max_rows: int = planner.MAX_ROWS, attention_impl: str = "auto",
                    layer_loop: str = "auto", check_share: float = 0.3, first_window: int = 32,
                    deadline: float | None = None,
                    on_method: Callable[[dict], None] | None = None, log: Callable[[str], None] = print) -> dict:
    """The AIME25 protocol's shape, per eviction method, on `model` (random weights will do): `samples` samples
    of `prompt_len`-token random prompts whose output lengths are `lognormal_lengths(median, sigma, cap =
    total_tokens - prompt_len)`, each ended at its drawn length by its cap (`Request.max_new_tokens`; no end
    token), decoded by `batching.run` with the protocol's sampling (temperature 0.6, top-p 0.95) and
    `max_new_tokens = total_tokens - prompt_len`.

    Rows: `batch` (one for every method, or {label: rows}, labels as "vase_dkv@2048" and "full"), or the largest
    that fits the model's device (`planner.largest_batch`, with the device's compiler, `device_bytes` (default:
    the device's allocator limit) and `headroom`; at most `samples` and `max_rows`). The search compiles the
    engine's programs at 3 or more sizes (about 40 s a size for Qwen3-14B's 40 layers on XLA:GPU); to spare a
    device's time, plan beforehand on any host (`scripts/plan.py --batch auto --target h200`) and pass `batch`.

    A whole protocol (~6M tokens) takes too long to time, so each method is measured for about
    `seconds_per_method` (after its plan and its compile, reported as plan_s and compile_s) and projected:

    1. round_s: the median of 3 runs of `rows` samples that end at the prefill (1 token): one round, no step;
    2. windows: runs of `rows` samples of L tokens in lockstep (one round each), L = `first_window`, 2L, 4L, ...
       (for an eviction method, a jump to two events past the first eviction, when the fit so far says it fits)
       while the next one fits in (1 - check_share) of the time; a `StepModel` fitted to them (`fit_step_model`);
    3. check: the first min(samples, 3 * rows) drawn samples, their lengths scaled down to fit the time left, run
       continuously; the model's prediction against the measured seconds (and the simulated steps and events
       against the engine's);
    4. the whole protocol: `simulate_engine` on the drawn lengths gives rounds, steps, slot_reads and events, and

           T = rounds * round_s + steps * step_s + slot_reads * slot_s + events * event_s

       (slot_reads: the cache slots the steps' attention reads, summed over rows and steps, each row up to its own
       length with the Pallas kernels, up to the longest row's on the XLA path (`attention_reads`): how `full`'s
       step time grows with its live slots, a line fitted in step 2; the projection with the other count is
       reported too). tokens/s = tokens / T; row utilization = the samples' decode row-steps / (rows * steps).

    `deadline` (seconds since the epoch): each method's measuring is shortened to end by then (less
    `DEADLINE_MARGIN_S`, at least 1 s), whatever its plan and compile took; the time used is the record's `seconds`.

    Peak memory: the device's `memory_stats()["peak_bytes_in_use"]` after the method (the process's peak so far),
    else the plan's total. `on_method(result so far)` is called after each method (to write results as they come).
    Returns a JSON-able dict {"meta": ..., "methods": [one record per method]}.
    """
    if not methods or not all(isinstance(ev, EvictionConfig) for ev in methods):
        raise ValueError(f"methods={methods!r}: give a non-empty list of EvictionConfig")
    for ev in methods:
        ev.validate()
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len={prompt_len!r} must be a positive int")
    if not isinstance(total_tokens, int) or total_tokens < prompt_len + 2:
        raise ValueError(f"total_tokens={total_tokens!r} must be an int >= prompt_len + 2 = {prompt_len + 2}")
    if not seconds_per_method > 0:
        raise ValueError(f"seconds_per_method={seconds_per_method!r} must be > 0")
    if not 0 < check_share < 1:
        raise ValueError(f"check_share={check_share!r} must be in (0, 1)")
    labels = [method_label(ev) for ev in methods]
    per_method = batch if isinstance(batch, dict) else dict.fromkeys(labels, batch)
    for key, rows in per_method.items():
        if key not in labels:
            raise ValueError(f"batch: {key!r} is not one of the methods ({', '.join(labels)})")
        if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 1):
            raise ValueError(f"batch={batch!r}: rows must be positive ints, or None (the largest that fits)")
    if not isinstance(first_window, int) or first_window < 2:
        raise ValueError(f"first_window={first_window!r} must be an int >= 2")
    cap = total_tokens - prompt_len
    lengths = lognormal_lengths(samples, median=median, sigma=sigma, cap=cap, seed=seed)
    device = model_device(model)
    if (any(per_method.get(label) is None for label in labels) and device_bytes is None and
            planner.device_memory(device) is None):
        raise ValueError(f"batch=None: the {device.platform} device reports no memory size; give batch or "
                         "device_bytes")
    config = GenerateConfig(max_new_tokens=cap, eos_token_ids=(), attention_impl=attention_impl,
                            layer_loop=layer_loop).validate()
    reads = attention_reads(platform_of(device), attention_impl)
    rng = np.random.default_rng(seed + 1)
    prompts = [tuple(int(t) for t in rng.integers(0, model.cfg.vocab_size, prompt_len)) for _ in range(samples)]
    base_key = jax.random.key(seed)

    def make_requests(caps) -> list:
        return [batching.Request(prompts[i % samples], jax.random.fold_in(base_key, i), i, int(n), i)
                for i, n in enumerate(caps)]

    meta = {"workload": "aime25", "samples": samples, "prompt_len": prompt_len, "total_tokens": total_tokens,
            "max_new_tokens": cap,
            "lengths": {"distribution": "lognormal, clipped to [2, max_new_tokens]", "median": median,
                        "sigma": sigma, "seed": seed, "mean": float(lengths.mean()), "max": int(lengths.max()),
                        "at_cap": int((lengths == cap).sum()), "tokens": int(lengths.sum())},
            "model": dataclasses.asdict(model.cfg), "dtype": jnp.dtype(model.dtype).name,
            "device": f"{device.device_kind} ({device.platform})", "seconds_per_method": seconds_per_method,
            "headroom": headroom, "formula": PROJECTION, "attention_reads": reads}
    out = {"meta": meta, "methods": []}
    for ev in methods:
        label = method_label(ev)
        rec: dict = {"label": label, "method": ev.method, "budget": ev.budget if ev.evicts else None,
                     "buffer": ev.buffer if ev.evicts else None}
        start = time.perf_counter()
        common = dict(target=device, config=config, prompt_len=prompt_len, dtype=model.dtype, queue=queue)
        if per_method.get(label) is None:
            found = planner.largest_batch(model.cfg, ev, device_bytes=device_bytes, headroom=headroom,
                                          samples=samples, max_rows=max_rows, **common)
            rows, plan = found.rows, found.plan
            rec |= {"rows_reason": found.reason, "batch_plan": found.as_dict()}
        else:
            rows = per_method[label]
            plan = planner.plan_engine(model.cfg, rows, ev, compile_program=False, **common)
            rec["rows_reason"] = f"given: {rows} rows"
        rec |= {"rows": rows, "plan_s": time.perf_counter() - start, "plan": None if plan is None else plan.as_dict()}
        log(f"{label}: {rows} rows ({rec['rows_reason']})")
        if rows > 0:
            rule = row_rule(model, config, Target.make(platform_of(device)))
            q = batching.queue_for(rows, queue, rule)  # as `batching.run` does
            start = time.perf_counter()
            _run_timed(model, make_requests([2] * rows), rows, q, config, ev, prompt_len)  # compiles the programs
            rec |= {"queue": q, "compile_s": time.perf_counter() - start}
            seconds = seconds_per_method  # a deadline (time.time()) shortens it to what is left after the compile
            if deadline is not None:
                seconds = max(min(seconds, deadline - time.time() - DEADLINE_MARGIN_S), 1.0)
            rec["seconds"] = seconds
            measured = measure_engine(model, ev, make_requests, rows, q, config, prompt_len, lengths,
                                      seconds, check_share, first_window, reads, log)
            fit = measured.pop("fit")
            proto = simulate_engine(lengths, rows, ev, prompt_len, q)
            total = fit.seconds(proto)
            other = dataclasses.replace(fit, reads=ATTENTION_READS[1 - ATTENTION_READS.index(reads)])
            stats = device.memory_stats() if device.platform != "cpu" else None
            peak = (stats or {}).get("peak_bytes_in_use")
            rec |= measured | {
                "protocol": proto.as_dict() | {
                    "seconds": total, "tok_s": proto.tokens / total, "reads": reads,
                    "seconds_if_" + other.reads: other.seconds(proto),
                    "step_ms": 1e3 * (total - proto.rounds * fit.round_s) / max(proto.steps, 1)},
                "peak_bytes": peak if peak is not None else (None if plan is None else plan.total),
                "peak_source": "memory_stats peak_bytes_in_use (the process's, so far)" if peak is not None else
                "plan (no compile: weights, state and staged prompts)" if plan.engine_temporaries is None else
                "plan"}
            log(f"{label}: protocol {proto.tokens} tokens on {rows} rows: {proto.steps} steps, utilization "
                f"{proto.utilization:.2f}, projected {total:.1f} s = {total / 60:.1f} min ({proto.tokens / total:.0f} "
                "tok/s)")
        out["methods"].append(rec)
        if on_method is not None:
            on_method(out)
    return out
