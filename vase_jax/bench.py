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
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vase_jax import random_model, weights
from vase_jax.cache import KVCache, init_cache, stored
from vase_jax.config import Qwen3Config
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import GenerateConfig, decode_step
from vase_jax.generate import prefill as generate_prefill
from vase_jax.jit import target_jit
from vase_jax.model import Qwen3
from vase_jax.target import Target

# A model for smoke tests (seconds to compile and run): the tiny test shape with a 1024-token vocabulary.
TINY = dataclasses.replace(random_model.TINY, vocab_size=1024)
# Long generations on a CPU: Qwen3's head_dim (128) and GQA group (2) but 12 MB of float32 weights, so that
# the cache dominates the bytes a step reads after a few thousand tokens (at 8k tokens, batch 2: 67 MB).
SMALL = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=128, tie_word_embeddings=True, max_position_embeddings=1 << 16)


# ---- models ------------------------------------------------------------------------------------------------
def named_configs() -> dict[str, Qwen3Config]:
    """`tiny`, `small`, and one entry per packaged real config: `qwen3-0.6b`, `qwen3-4b`, ..."""
    out = {"tiny": TINY, "small": SMALL}
    for f in sorted(resources.files("vase_jax.data").joinpath("configs").iterdir()):
        if f.name.endswith(".json"):
            with resources.as_file(f) as path:
                out[f.name[: -len(".json")].lower()] = Qwen3Config.from_json_file(path)
    return out


def shrink(cfg: Qwen3Config, layers: int | None = None, vocab: int | None = None, hidden: int | None = None,
           intermediate: int | None = None) -> Qwen3Config:
    """The same shape with another number of layers, vocabulary size, hidden or MLP width (heads unchanged):
    e.g. Qwen3-4B's 36 layers and heads with widths of 256, whose compile time is that of the real model."""
    sizes = {"layers": layers, "vocab": vocab, "hidden": hidden, "intermediate": intermediate}
    for name, v in sizes.items():
        if v is not None and v < 1:
            raise ValueError(f"--{name}={v} must be >= 1")
    return dataclasses.replace(cfg, num_layers=layers or cfg.num_layers, vocab_size=vocab or cfg.vocab_size,
                               hidden_size=hidden or cfg.hidden_size,
                               intermediate_size=intermediate or cfg.intermediate_size)


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
        evictions=jnp.zeros(empty.evictions.shape, jnp.int32), active=jnp.ones(empty.active.shape, bool),
        state={name: jnp.where(slot < length, jax.random.uniform(jax.random.fold_in(kq, i), x.shape), 0.0)
               for i, (name, x) in enumerate(empty.state.items())})


@functools.partial(target_jit, static_argnums=(0, 5, 6, 7), target_argnum=7, donate_argnums=(2,))
def decode_steps(graphdef, state, cache: KVCache, token, start, steps: int, attention_impl: str, target: Target):
    """`steps` greedy `decode_step`s in one `fori_loop`, from a cache reset to `start` slots (no eviction), with
    `target`'s layer loop, as `generate` runs them. The cache is donated, so it is updated in place as in
    `generate`. Returns (cache, last token)."""
    model = nnx.merge(graphdef, state)
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
