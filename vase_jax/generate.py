"""`generate`: prefill, then a decode loop compiled as one XLA program (`lax.while_loop`).

Loop state is a small pytree (`LoopState`): the cache, the output buffer, the step and per-row end flags. Each step
feeds the previous token of every row, appends one KV per layer, attends over the live slots, samples in float32,
and -- for eviction methods -- runs the periodic eviction of `vase_jax.eviction.framework` when it triggers. The
loop stops when every row has emitted an end token or `max_new_tokens` is reached.

Randomness: `key` is split once into a sampling key and an eviction key. Step s samples row r with
`fold_in(fold_in(sample_key, s), row)`; layer l's eviction number e uses `fold_in(fold_in(evict_key, l), e)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from vase_jax.cache import KVCache, init_cache
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import METHODS
from vase_jax.model import LayerWeights, Qwen3, prompt_positions
from vase_jax.sampling import SamplingConfig, sample
from vase_jax.sharding import check_mesh, constrain, constrain_cache, model_mesh, put, spec_for

QWEN3_END_TOKENS = (151645, 151643)  # <|im_end|>, <|endoftext|>
PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
LAYER_LOOPS = ("auto", "scan", "unroll")
try:  # the kernels' own list of implementations, when it has one
    from pallas_kernels.dispatch import IMPLS as ATTENTION_IMPLS
except ImportError:  # pragma: no cover
    ATTENTION_IMPLS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """Decoding settings (static). `temperature=0` is greedy; `top_k=0` is off (the reference's HF path does not
    apply top-k); Qwen3's thinking-mode recommendation is temperature 0.6, top_p 0.95, top_k 20."""

    max_new_tokens: int = 32768
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0
    eos_token_ids: tuple[int, ...] = QWEN3_END_TOKENS
    pad_token_id: int | None = None  # written after a row's end token; None -> eos_token_ids[0] (or 0)
    prompt_buckets: tuple[int, ...] = PROMPT_BUCKETS  # prompts are left-padded to the next bucket (beyond: x8192)
    return_cache: bool = False  # also return the final KV cache (GenerateOutput.cache), e.g. to inspect it
    # How the decode step runs the layers: "scan" (one compiled layer: compile time independent of depth),
    # "unroll" (per-layer code over weights unstacked once before the loop), "auto" (unroll on CPU, else scan).
    # The prefill and the eviction always scan. Both give the same tokens.
    layer_loop: str = "auto"
    # The decode-attention kernel, with and without eviction: "auto" (Pallas on GPU, XLA elsewhere), "xla" or
    # "pallas" (interpret mode off GPU). The eviction scoring kernels follow the same switch.
    attention_impl: str = "auto"

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_p, self.top_k)

    @property
    def pad_id(self) -> int:
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    def validate(self) -> GenerateConfig:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"GenerateConfig.max_new_tokens={self.max_new_tokens!r} must be a positive int")
        try:
            self.sampling.validate()
        except ValueError as e:
            raise ValueError(f"GenerateConfig.{e}") from None
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError(f"GenerateConfig.eos_token_ids={self.eos_token_ids!r} must be a tuple of ints")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"GenerateConfig.attention_impl={self.attention_impl!r}; allowed: "
                             f"{', '.join(ATTENTION_IMPLS)}")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"GenerateConfig.layer_loop={self.layer_loop!r}; allowed: {', '.join(LAYER_LOOPS)}")
        if not self.prompt_buckets or list(self.prompt_buckets) != sorted(set(self.prompt_buckets)):
            raise ValueError(f"GenerateConfig.prompt_buckets={self.prompt_buckets!r} must be strictly increasing")
        return self

    def bucket(self, prompt_len: int) -> int:
        for b in self.prompt_buckets:
            if prompt_len <= b:
                return b
        step = 8192
        return -(-prompt_len // step) * step


DEFAULT_CONFIG = GenerateConfig()
NO_EVICTION = EvictionConfig("full")


@struct.dataclass
class GenerateOutput:
    tokens: jax.Array  # [batch, max_new_tokens] int32, pad after the end token
    num_tokens: jax.Array  # [batch] int32, tokens generated per row (end token included)
    finished: jax.Array  # [batch] bool, True when the row emitted an end token
    evictions: jax.Array  # int32 scalar, eviction events that ran
    cache_length: jax.Array  # int32 scalar, slots in use at the end
    cache: KVCache | None = None  # the final cache, when GenerateConfig.return_cache


@struct.dataclass
class LoopState:
    cache: KVCache
    tokens: jax.Array  # [batch, max_new_tokens] int32
    last: jax.Array  # [batch] int32, the token fed at the next step
    done: jax.Array  # [batch] bool
    num_tokens: jax.Array  # [batch] int32
    step: jax.Array  # int32 scalar: tokens produced so far


def _validate_inputs(model, input_ids, attention_mask, config: GenerateConfig, eviction: EvictionConfig):
    if not isinstance(model, Qwen3):
        raise ValueError(f"model must be a vase_jax.Qwen3, got {type(model).__name__}")
    config.validate()
    eviction.validate()
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids={tuple(input_ids.shape)}: empty prompt (batch and seq must be >= 1)")
    if not isinstance(attention_mask, jax.core.Tracer):
        import numpy as np

        mask = np.asarray(attention_mask)
        empty = np.flatnonzero(mask.sum(axis=1) == 0)
        if empty.size:
            raise ValueError(f"attention_mask: rows {empty.tolist()} are empty prompts (no real token)")
        if not (mask[:, -1] != 0).all():
            raise ValueError("attention_mask: prompts must be left-padded (the last column must be all real tokens)")


def generate(
    model: Qwen3,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    *,
    key: jax.Array,
    config: GenerateConfig = DEFAULT_CONFIG,
    eviction: EvictionConfig = NO_EVICTION,
    row_ids: jax.Array | None = None,
) -> GenerateOutput:
    """Sample up to `config.max_new_tokens` tokens per row from left-padded prompts.

    input_ids, attention_mask: [batch, seq] (as `encode_prompts` returns). `row_ids` [batch] names each row's
    random stream (default `arange(batch)`): a row gives the same tokens whatever else is in its batch.
    Prompts longer than `eviction.budget` are kept whole until the first eviction, which then runs over more than
    `budget` candidates (as the reference does); the capacity grows to hold them.

    A model sharded over a `("data", "model")` mesh (`vase_jax.sharding.shard_model`, or `from_pretrained(...,
    mesh=)`) runs on that mesh: rows over `data`, heads over `model`; the cache is created sharded the same way.
    """
    return _generate(*_prepare(model, input_ids, attention_mask, key, config, eviction, row_ids))


def lower_generate(
    model: Qwen3,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    *,
    key: jax.Array,
    config: GenerateConfig = DEFAULT_CONFIG,
    eviction: EvictionConfig = NO_EVICTION,
    row_ids: jax.Array | None = None,
    platforms: tuple[str, ...] | None = None,
) -> jax.stages.Lowered:
    """The `generate` program lowered for `platforms` (e.g. `("cuda",)` or `("tpu",)`, default: this host's),
    without running it: the same validation and padding as `generate`. Lowering for a platform the host does not
    have checks that every kernel of that platform lowers (`.as_text()` shows the program)."""
    args = _prepare(model, input_ids, attention_mask, key, config, eviction, row_ids)
    traced = _generate.trace(*args)
    return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()


def _prepare(model, input_ids, attention_mask, key, config, eviction, row_ids):
    """Validate, pad the prompt to its bucket and split the model: the arguments of `_generate`."""
    input_ids = jnp.asarray(input_ids)
    attention_mask = jnp.asarray(attention_mask)
    _validate_inputs(model, input_ids, attention_mask, config, eviction)
    b, t_in = input_ids.shape
    t = config.bucket(t_in)
    if t > t_in:  # left-pad to the bucket so that prompts of nearby lengths share one compiled program
        input_ids = jnp.pad(input_ids, ((0, 0), (t - t_in, 0)), constant_values=config.pad_id)
        attention_mask = jnp.pad(attention_mask, ((0, 0), (t - t_in, 0)))
    capacity = framework.capacity_for(eviction, t, t - t_in, config.max_new_tokens)
    if row_ids is None:
        row_ids = jnp.arange(b, dtype=jnp.int32)
    input_ids, attention_mask = input_ids.astype(jnp.int32), attention_mask.astype(jnp.int32)
    row_ids = jnp.asarray(row_ids, jnp.int32)
    mesh = model_mesh(model)
    if mesh is not None:  # rows over `data` (checked before anything compiles)
        check_mesh(model.cfg, mesh, b)
        rows = jax.sharding.NamedSharding(mesh, spec_for(("batch", "seq"), mesh))
        input_ids, attention_mask = put(input_ids, rows), put(attention_mask, rows)
        row_ids = put(row_ids, jax.sharding.NamedSharding(mesh, spec_for(("batch",), mesh)))
    graphdef, state = nnx.split(model)
    return (graphdef, state, input_ids, attention_mask, key, row_ids, config, eviction, capacity, mesh)


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8, 9))
def _generate(graphdef, state, input_ids, attention_mask, key, row_ids, config: GenerateConfig,
              eviction: EvictionConfig, capacity: int, mesh: jax.sharding.Mesh | None = None) -> GenerateOutput:
    # Under a mesh, kernels see it while tracing (`pallas_kernels.dispatch.per_device` runs them in `shard_map`).
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None else contextlib.nullcontext():
        return _generate_body(graphdef, state, input_ids, attention_mask, key, row_ids, config, eviction,
                              capacity, mesh)


def _generate_body(graphdef, state, input_ids, attention_mask, key, row_ids, config: GenerateConfig,
                   eviction: EvictionConfig, capacity: int, mesh) -> GenerateOutput:
    model = nnx.merge(graphdef, state)
    b = input_ids.shape[0]
    sample_key, evict_key = jax.random.split(key)
    eos = jnp.asarray(config.eos_token_ids or (-1,), jnp.int32)

    impl = config.attention_impl
    with jax.named_scope("prefill"):
        logits, cache = prefill(model, input_ids, attention_mask, capacity, query_window(eviction), impl,
                                framework.slot_state(eviction), mesh)
        first = sample(logits, jax.random.fold_in(sample_key, 0), config.sampling, row_ids)
    # Unrolled: the weights are sliced out of the stack here, once, so that no step copies them.
    layers = model.layer_weights(unstack=resolve_layer_loop(config.layer_loop) == "unroll")

    tokens = constrain(jnp.full((b, config.max_new_tokens), config.pad_id, jnp.int32).at[:, 0].set(first),
                       ("batch", "step"), mesh)
    done = jnp.isin(first, eos)
    state0 = LoopState(cache=cache, tokens=tokens, last=first, done=done, num_tokens=jnp.ones((b,), jnp.int32),
                       step=jnp.int32(1))

    def running(s: LoopState) -> jax.Array:
        return (s.step < config.max_new_tokens) & ~jnp.all(s.done)

    def step(s: LoopState) -> LoopState:
        logits, cache = decode_step(model, s.cache, s.last, impl, layers)
        cache = constrain_cache(cache, mesh)  # the loop carry keeps the cache's sharding: no reshuffling per step
        token = sample(logits, jax.random.fold_in(sample_key, s.step), config.sampling, row_ids)
        token = jnp.where(s.done, config.pad_id, token)
        tokens = jax.lax.dynamic_update_slice(s.tokens, token[:, None], (0, s.step))
        return LoopState(cache=cache, tokens=tokens, last=token, done=s.done | jnp.isin(token, eos),
                         num_tokens=s.num_tokens + (~s.done).astype(jnp.int32), step=s.step + 1)

    if not eviction.evicts:
        final = jax.lax.while_loop(running, step, state0)
    else:
        # Decode steps run in an inner loop that exits when an eviction is due; the outer loop evicts. The per-step
        # body thus holds no conditional, which would make XLA copy the cache at every step.
        def segment(s: LoopState) -> LoopState:
            # At least one step (the trigger is checked after a step, never right after the prefill or an
            # eviction), traced once: `first` is true only on entry.
            def more(c):
                s, first = c
                return running(s) & (first | ~framework.should_evict(s.cache, eviction))

            s, _ = jax.lax.while_loop(more, lambda c: (step(c[0]), jnp.bool_(False)), (s, jnp.bool_(True)))
            def evict(c: KVCache) -> KVCache:  # per device under a mesh
                return constrain_cache(framework.evict_per_device(c, eviction, evict_key, row_ids, impl), mesh)

            cache = jax.lax.cond(framework.should_evict(s.cache, eviction), evict, lambda c: c, s.cache)
            return s.replace(cache=cache)

        final = jax.lax.while_loop(running, segment, state0)
    return GenerateOutput(tokens=final.tokens, num_tokens=final.num_tokens, finished=final.done,
                          evictions=final.cache.evictions, cache_length=final.cache.length,
                          cache=final.cache if config.return_cache else None)


def query_window(eviction: EvictionConfig) -> int:
    """Query ring size of the cache: the buffer for attention-scored eviction methods, else 0 (no ring)."""
    return eviction.buffer if eviction.evicts and METHODS[eviction.method].needs_queries else 0


def prefill(model: Qwen3, input_ids: jax.Array, attention_mask: jax.Array, capacity: int, window: int,
            attention_impl: str = "auto", state: tuple = (), mesh: jax.sharding.Mesh | None = None):
    """The prompt forward pass and the cache it fills: (last-position logits [batch, vocab] f32, KVCache).

    `capacity` slots; `window` > 0 keeps a ring of that many post-RoPE queries (see `query_window`); `state`: the
    policy's per-slot state arrays (`framework.slot_state`); `mesh`: create the cache sharded over it
    (`vase_jax.sharding.cache_specs`). The layers run scanned (a prefill reads each weight
    once, so slicing it out of the stack costs nothing per token).
    """
    cache = constrain_cache(init_cache(model.cfg, input_ids.shape[0], capacity, window, model.dtype, state), mesh)
    logits, cache = model.forward(input_ids, prompt_positions(attention_mask), cache, attention_mask=attention_mask,
                                  attention_impl=attention_impl, last_logits_only=True)
    return logits[:, -1], constrain_cache(cache, mesh)


def decode_step(model: Qwen3, cache: KVCache, token: jax.Array, attention_impl: str = "auto",
                layers: LayerWeights | None = None):
    """Feed one token per row: token [batch] -> (logits [batch, vocab] f32, updated cache).

    `layers`: `model.layer_weights(...)` computed once outside the loop (default: stacked, scanned).
    """
    logits, cache = model.forward(token[:, None], cache.row_pos[:, None], cache, attention_impl=attention_impl,
                                  layers=layers)
    return logits[:, 0], cache


def resolve_layer_loop(layer_loop: str) -> str:
    """ "auto" -> "unroll" on CPU (XLA:CPU copies every weight a dot reads through a slice of the stack, so the
    scanned decode step would copy each layer's weights at every step), "scan" on GPU and TPU."""
    if layer_loop == "auto":
        return "unroll" if jax.default_backend() == "cpu" else "scan"
    return layer_loop
