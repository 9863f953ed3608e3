"""`generate`: prefill, then a decode loop compiled as one XLA program (`lax.while_loop`).

Loop state is a small pytree (`LoopState`): the cache, the output buffer, the batch's step count and per-row state
(tokens produced, cap, end flag, start step, keys). Each step feeds the previous token of every active row,
appends one KV per layer, attends over the live slots, samples in float32, and -- for eviction methods -- runs the
periodic eviction of `vase_jax.eviction.framework` for the rows whose trigger fires. The loop stops when every row
has emitted an end token or reached its cap.

Every row is its own sequence: its tokens depend only on its prompt, its key, its row id and the settings, never on
the other rows or on when it started. Rows of an evicting batch start decoding at a step that puts their trigger
phase on the batch's ticks (`EvictionConfig.phase_wait`, a wait of at most B - 1 steps), so that a batch runs at most
one eviction event per B steps; `full` has no ticks and starts every row at once.

Randomness: `key` (one, or one per row) is split into a sampling key and an eviction key. A row's n-th token
(n = 0 from the prefill) is sampled with `fold_in(fold_in(sample_key, n), row_id)`; its e-th eviction in layer l
uses `fold_in(fold_in(evict_key, l), e)` (then the row id, inside the policy).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from pallas_kernels.decode_tuning import fixed_splits
from pallas_kernels.dispatch import IMPLS as ATTENTION_IMPLS
from vase_jax import limits
from vase_jax.cache import CacheLayout, KVCache, as_layout, first_rows, left_padding, pad_axis, unpad
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import METHODS
from vase_jax.invariance import RowRule, padded_rows, rule_for, unpadded
from vase_jax.jit import target_jit
from vase_jax.kvquant import DEFAULT_GROUP, KVBits
from vase_jax.model import Qwen3, prompt_positions
from vase_jax.sampling import SamplingConfig, fold_rows, sample, typed_key
from vase_jax.sharding import check_mesh, constrain, constrain_cache, model_mesh, put, spec_for
from vase_jax.target import LAYER_LOOPS as TARGET_LOOPS
from vase_jax.target import PLATFORMS, Target, devices_platform
from vase_jax.tiers import TierLayout, tier_layout

QWEN3_END_TOKENS = (151645, 151643)  # <|im_end|>, <|endoftext|>
PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
LAYER_LOOPS = ("auto",) + TARGET_LOOPS
MIN_PREFILL_CHUNK = 16  # `GenerateConfig.prefill_chunk`'s smallest value


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
    # The prefill of a prompt bucket longer than this runs in chunks of this many tokens through every layer, each
    # chunk's queries attending over the cache one block of this many slots at a time (`Qwen3.prefill_chunk`): its
    # temporaries grow with the prompt, not with its square. A bucket of at most this many tokens runs densely.
    # None: always densely. It does not depend on the batch, so a row's tokens do not either.
    prefill_chunk: int | None = 256
    return_cache: bool = False  # also return the final KV cache (GenerateOutput.cache), e.g. to inspect it
    # A row's tokens do not depend on its batch: a batch of fewer rows (per device) than this machine's kernels
    # need to take the path of larger batches runs beside copies of its first row (`vase_jax.invariance`, probed
    # once per process; a warning says so when no padding can promise it). False: the batch runs as given.
    batch_invariant: bool = True
    # How the prefill and the decode steps run the layers: "unroll" (a Python loop, each layer its own code),
    # "switch" (a scan over the layer index whose matmuls pick their layer's weight by `lax.switch`: compile time
    # flat in depth), "auto" (the platform's default: unroll on GPU, switch on CPU and TPU). Both read each weight
    # where it lives and give the same tokens. See `vase_jax.model.run_layers` and `vase_jax.target`.
    layer_loop: str = "auto"
    # The platform the program is for ("cpu", "cuda", "rocm", "tpu"); it decides the cache's storage, the layer
    # loop's default and the CPU-only workarounds (`vase_jax.target`). None: the platform of the model's devices,
    # or, inside your own `jax.jit` (where the weights are tracers that carry no device), JAX's default backend.
    # `lower_generate(platforms=...)` sets it.
    platform: str | None = None
    # The decode-attention kernel, with and without eviction: "auto" (Pallas on GPU, XLA elsewhere), "xla" or
    # "pallas" (interpret mode off GPU). The eviction scoring kernels follow the same switch.
    attention_impl: str = "auto"
    # The mixed-precision cache (`vase_jax.tiers`): bits of cached keys and values (16, 8 or 4; keys never below
    # values; 16 and 16 is the 16-bit cache, the same program as without these fields), channels per scale
    # (None: 128 at 8 bits, 64 at 4), the slots kept in 16 bits for their Range(v) (None: Nv with a method that
    # protects Range, 0 with another evicting method, a quarter of the cache without eviction), and HQQ's
    # zero-point refinement when a token is quantized.
    key_bits: int = 16
    value_bits: int = 16
    kv_group: int | None = None
    kv_protected: int | None = None
    kv_refine: bool = False

    @property
    def kv_bits(self) -> KVBits:
        return KVBits(self.key_bits, self.value_bits, self.kv_group, self.kv_group, self.kv_refine)

    def kv_bits_for(self, head_dim: int) -> KVBits:
        """`kv_bits` with the default group sizes capped at `head_dim` (a head narrower than 128 channels at 8
        bits takes one group per head)."""
        def group(bits):
            if self.kv_group is not None or bits == 16:
                return self.kv_group
            return min(DEFAULT_GROUP[bits], head_dim)

        return KVBits(self.key_bits, self.value_bits, group(self.key_bits), group(self.value_bits), self.kv_refine)

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
        if self.platform is not None and self.platform not in PLATFORMS:
            raise ValueError(f"GenerateConfig.platform={self.platform!r}; allowed: None, {', '.join(PLATFORMS)}")
        try:
            self.kv_bits.validate()
        except ValueError as e:
            raise ValueError(f"GenerateConfig: {e}") from None
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"GenerateConfig.batch_invariant={self.batch_invariant!r} must be a bool")
        if not isinstance(self.kv_refine, bool):
            raise ValueError(f"GenerateConfig.kv_refine={self.kv_refine!r} must be a bool")
        if self.prefill_chunk is not None and (not isinstance(self.prefill_chunk, int) or
                                               isinstance(self.prefill_chunk, bool) or
                                               self.prefill_chunk < MIN_PREFILL_CHUNK):
            raise ValueError(f"GenerateConfig.prefill_chunk={self.prefill_chunk!r}; allowed: None (dense prefill) or "
                             f"an int >= {MIN_PREFILL_CHUNK} (prompt tokens per chunk)")
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
    """What `generate` returns. Device memory while it runs: the weights, the cache (`max(P, N) + B` slots per layer,
    row and kv head with eviction, `P + max_new_tokens` without; P the prompt bucket), and the program's
    temporaries beyond the cache: the prefill's activations (float32 MLP intermediates of batch x prompt tokens, or
    of batch x `prefill_chunk` tokens for a longer prompt, with one block of chunk x chunk scores per row and head),
    one layer's eviction scores (layers are evicted one at a time), the logits and sampling arrays. No weight and
    no part of the cache is copied (docs/DESIGN.md, "Memory to expect")."""

    tokens: jax.Array  # [batch, max_new_tokens] int32, pad after the end token
    num_tokens: jax.Array  # [batch] int32, tokens generated per row (end token included)
    finished: jax.Array  # [batch] bool, True when the row emitted an end token
    evictions: jax.Array  # int32 scalar, eviction events the batch ran (each evicts one or more rows)
    row_evictions: jax.Array  # [batch] int32, evictions of each row (its reference count)
    cache_length: jax.Array  # [batch] int32, slots in use at the end
    steps: jax.Array  # int32 scalar, decode steps the batch ran (rows that wait or have ended idle in some)
    cache: KVCache | None = None  # the final cache, when GenerateConfig.return_cache


@struct.dataclass
class LoopState:
    cache: KVCache
    tokens: jax.Array  # [batch, max_new_tokens] int32
    last: jax.Array  # [batch] int32, the token fed at the next step
    done: jax.Array  # [batch] bool: ended (end token or cap)
    num_tokens: jax.Array  # [batch] int32: tokens produced (the row's own step index)
    cap: jax.Array  # [batch] int32: the row's max_new_tokens
    start: jax.Array  # [batch] int32: the batch step at which the row takes its first decode step
    sample_key: jax.Array  # [batch] PRNG keys
    evict_key: jax.Array  # [batch] PRNG keys
    row_ids: jax.Array  # [batch] int32
    step: jax.Array  # int32 scalar: decode steps the batch ran
    events: jax.Array  # int32 scalar: eviction events the batch ran
    last_event: jax.Array  # int32 scalar: the step of the latest event
    min_event_gap: jax.Array  # int32 scalar: the fewest steps between two events (NO_GAP if fewer than two)


NO_GAP = 1 << 30


def _validate_caps(max_new_tokens, batch: int, config: GenerateConfig):
    """Per-row caps: None (config.max_new_tokens for every row) or [batch] ints in [1, config.max_new_tokens]."""
    if max_new_tokens is None:
        return np.full((batch,), config.max_new_tokens, np.int32)
    if isinstance(max_new_tokens, jax.core.Tracer):
        raise ValueError("max_new_tokens (per-row caps) must be a concrete array, not traced")
    caps = np.asarray(max_new_tokens)
    if caps.shape != (batch,) or not np.issubdtype(caps.dtype, np.integer):
        raise ValueError(f"max_new_tokens: per-row caps must be an int array of shape [batch] = ({batch},), got "
                         f"shape {caps.shape} dtype {caps.dtype}")
    bad = np.flatnonzero((caps <= 0) | (caps > config.max_new_tokens))
    if bad.size:
        raise ValueError(f"max_new_tokens: rows {bad.tolist()} have caps {caps[bad].tolist()}; allowed: 1 .. "
                         f"GenerateConfig.max_new_tokens={config.max_new_tokens}")
    return caps.astype(np.int32)


def _validate_key(key, batch: int):
    if key.ndim not in (0, 1) or (key.ndim == 1 and key.shape[0] != batch):
        raise ValueError(f"key: one PRNG key or one per row ([batch] = ({batch},)), got shape {tuple(key.shape)}")


def _validate_inputs(model, input_ids, attention_mask, config: GenerateConfig, eviction: EvictionConfig):
    if not isinstance(model, Qwen3):
        raise ValueError(f"model must be a vase_jax.Qwen3, got {type(model).__name__}")
    config.validate()
    eviction.validate()
    framework.check_model(eviction, model.cfg)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids={tuple(input_ids.shape)}: empty prompt (batch and seq must be >= 1)")
    if not isinstance(attention_mask, jax.core.Tracer):
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
    max_new_tokens=None,
) -> GenerateOutput:
    """Sample up to `config.max_new_tokens` tokens per row from left-padded prompts.

    input_ids, attention_mask: [batch, seq] (as `encode_prompts` returns). `key`: one PRNG key, or one per row
    [batch]. `row_ids` [batch] names each row's random stream (default `arange(batch)`): a row gives the same
    tokens whatever else is in its batch. `max_new_tokens`: optional per-row caps [batch] (ints in
    [1, config.max_new_tokens]). Prompts longer than `eviction.budget` are kept whole until the row's first
    eviction, which then runs over more than `budget` candidates (as the reference does); the capacity grows to
    hold them.

    A model sharded over a `("data", "model")` mesh (`vase_jax.sharding.shard_model`, or `from_pretrained(...,
    mesh=)`) runs on that mesh: rows over `data`, heads over `model`; the cache is created sharded the same way.

    The program is built for the platform of the model's devices (`GenerateConfig.platform` inside your own
    `jax.jit`; `vase_jax.target`); `GenerateOutput` says what device memory it holds.
    """
    args = _prepare(model, input_ids, attention_mask, key, config, eviction, row_ids, max_new_tokens)
    out = generate_program(*args)
    b = jnp.shape(input_ids)[0]
    if args[2].shape[0] != b:  # a small batch ran beside copies of its first row (`_prepare`)
        out = out.replace(tokens=out.tokens[:b], num_tokens=out.num_tokens[:b], finished=out.finished[:b],
                          row_evictions=out.row_evictions[:b], cache_length=out.cache_length[:b],
                          cache=None if out.cache is None else first_rows(out.cache, b))
    return out


def lower_generate(
    model: Qwen3,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    *,
    key: jax.Array,
    config: GenerateConfig = DEFAULT_CONFIG,
    eviction: EvictionConfig = NO_EVICTION,
    row_ids: jax.Array | None = None,
    max_new_tokens=None,
    platforms: tuple[str, ...] | None = None,
) -> jax.stages.Lowered:
    """The `generate` program lowered for `platforms` (one platform, e.g. `("cuda",)` or `("tpu",)`; default: as
    `generate` picks it), without running it: the same validation, padding and `Target` as `generate` on that
    platform, so the text is the program that platform runs. Lowering for a platform the host does not have
    checks that every kernel of that platform lowers (`.as_text()` shows the program); the model may be abstract
    (`ShapeDtypeStruct` weights)."""
    platform = None
    if platforms is not None:
        if len(platforms) != 1 or platforms[0] not in PLATFORMS + ("gpu",):
            raise ValueError(f"platforms={platforms!r}: one platform, one of {', '.join(PLATFORMS)} (the cache "
                             "storage and the layer loop depend on it)")
        platform = Target.make(platforms[0]).platform
    args = _prepare(model, input_ids, attention_mask, key, config, eviction, row_ids, max_new_tokens, platform)
    traced = generate_program.trace(*args)
    return traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()


def generate_target(model: Qwen3, config: GenerateConfig, platform: str | None = None) -> Target:
    """The `Target` of a `generate` call: `platform` (a lowering's), else `config.platform`, else the platform of
    the model's devices, else (abstract or traced weights) JAX's default backend; with `config.layer_loop`."""
    if platform is not None:
        if config.platform is not None and Target.make(config.platform).platform != platform:
            raise ValueError(f"GenerateConfig.platform={config.platform!r} disagrees with the lowering platform "
                             f"{platform!r}")
        return Target.make(platform, config.layer_loop)
    found = devices_platform(nnx.state(model))
    if config.platform is not None and found is not None and Target.make(config.platform).platform != found:
        raise ValueError(f"GenerateConfig.platform={config.platform!r}, but the model's weights are on {found} "
                         "devices")
    return Target.make(config.platform or found or jax.default_backend(), config.layer_loop)


def _prepare(model, input_ids, attention_mask, key, config, eviction, row_ids, max_new_tokens=None, platform=None):
    """Validate, pad the prompt to its bucket and split the model: the arguments of `generate_program`."""
    input_ids = jnp.asarray(input_ids)
    attention_mask = jnp.asarray(attention_mask)
    _validate_inputs(model, input_ids, attention_mask, config, eviction)
    target = generate_target(model, config, platform)
    b, t_in = input_ids.shape
    caps = jnp.asarray(_validate_caps(max_new_tokens, b, config))
    key = typed_key(jnp.asarray(key) if not isinstance(key, jax.Array) else key)
    _validate_key(key, b)
    if row_ids is not None and jnp.shape(row_ids) != (b,):
        raise ValueError(f"row_ids has shape {tuple(jnp.shape(row_ids))}; expected [batch] = ({b},)")
    mesh = model_mesh(model)
    if mesh is not None:
        check_mesh(model.cfg, mesh, b)  # the caller's batch must split over `data` (before it is padded)
    rows = padded_rows(b, row_rule(model, config, target), 1 if mesh is None else mesh.shape.get("data", 1))
    if rows > b:
        # A row's numbers must not depend on its batch's size (the continuous engine runs samples in batches of
        # any size, a mesh splits them over devices): a batch of fewer rows per device than the machine's
        # `RowRule.min_rows` runs beside copies of its first row (`vase_jax.invariance`); `generate` returns
        # the first b rows.
        input_ids, attention_mask, caps = (pad_rows(x, rows) for x in (input_ids, attention_mask, caps))
        key = key if key.ndim == 0 else pad_rows(key, rows)
        row_ids = None if row_ids is None else pad_rows(jnp.asarray(row_ids), rows)
        b = rows
    t = config.bucket(t_in)
    if t > t_in:  # left-pad to the bucket so that prompts of nearby lengths share one compiled program
        input_ids = jnp.pad(input_ids, ((0, 0), (t - t_in, 0)), constant_values=prompt_pad_id(config, model.cfg))
        attention_mask = jnp.pad(attention_mask, ((0, 0), (t - t_in, 0)))
    layout = cache_layout(model.cfg, config, eviction, t)
    weights = model.embedding.get_value()  # an array here; traced in the caller's jit; abstract when lowering
    if isinstance(weights, jax.Array) and not isinstance(weights, jax.core.Tracer):  # the device is here: fit it
        filled = jax.eval_shape(lambda: prompt_layout(layout, eviction, config, t).init(
            model.cfg, b, query_window(eviction), model.dtype, framework.slot_state(eviction), target))
        limits.check_fits(model.cfg, model.dtype, b, t, t_in, filled, config.prefill_chunk,
                          1 if mesh is None else mesh.size, next(iter(weights.devices())))
    if row_ids is None:
        row_ids = jnp.arange(b, dtype=jnp.int32)
    input_ids, attention_mask = input_ids.astype(jnp.int32), attention_mask.astype(jnp.int32)
    row_ids = jnp.asarray(row_ids, jnp.int32)
    if mesh is not None:  # rows over `data` (checked before anything compiles)
        check_mesh(model.cfg, mesh, b)
        rows = jax.sharding.NamedSharding(mesh, spec_for(("batch", "seq"), mesh))
        input_ids, attention_mask = put(input_ids, rows), put(attention_mask, rows)
        row_ids = put(row_ids, jax.sharding.NamedSharding(mesh, spec_for(("batch",), mesh)))
    graphdef, state = nnx.split(model)
    return (graphdef, state, input_ids, attention_mask, key, row_ids, caps, config, eviction, layout, target,
            mesh)


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """x [b, ...] with copies of its first row appended up to `rows` rows."""
    return jnp.concatenate([x] + [x[:1]] * (rows - x.shape[0]))


def row_rule(model: Qwen3, config: GenerateConfig, target: Target) -> RowRule:
    """The `RowRule` a `generate` call pads its batch by: measured on this machine (`vase_jax.invariance.rule_for`,
    once per process) for a model whose weights are on the target's devices; the documented default for
    abstract weights or another platform's lowering (`invariance.DEFAULT_MIN_ROWS`); with `config.batch_invariant`
    off, no promise and only the target's `min_rows` (`invariance.unpadded`: on CPU a lone row beside a copy)."""
    if not config.batch_invariant:
        return unpadded(target, model.dtype)
    measured = devices_platform(nnx.state(model)) == target.platform
    return rule_for(model.cfg, model.dtype, target, probe=measured)


def prompt_pad_id(config: GenerateConfig, cfg) -> int:
    """The id that pads prompts to their bucket: `config.pad_id` when the model's vocabulary has it, else 0. The
    padding is masked, but its embedding must be a number: an id past the vocabulary (Qwen3's end tokens, the
    default, with a small-vocabulary model) gathers NaN, and 0 x NaN poisons the masked attention sums."""
    return config.pad_id if 0 <= config.pad_id < cfg.vocab_size else 0


def cache_layout(cfg, config: GenerateConfig, eviction: EvictionConfig,
                 prompt_slots: int) -> CacheLayout | TierLayout:
    """The layout of a `generate` call's cache for prompts of `prompt_slots` (a bucket): a 16-bit cache of
    `framework.capacity_for` slots, or with `config.kv_bits` below 16 a mixed-precision cache's tiers
    (validated; ValueError naming the parameter)."""
    if config.kv_bits.quantizes:
        if eviction.compress_prompt:
            raise ValueError(f"EvictionConfig.compress_prompt=True runs on the 16-bit cache; GenerateConfig "
                             f"key_bits={config.key_bits}, value_bits={config.value_bits} asks for a mixed-precision "
                             "one: drop one of the two")
        return generate_tiers(cfg, config, eviction, prompt_slots)
    return CacheLayout(framework.capacity_for(eviction, prompt_slots, config.max_new_tokens))


def generate_tiers(cfg, config: GenerateConfig, eviction: EvictionConfig, prompt_slots: int) -> TierLayout:
    """The mixed-precision cache's layout for prompts of `prompt_slots` (a bucket) and these settings; ValueError
    naming the parameter."""
    kv_bits = config.kv_bits_for(cfg.head_dim)
    try:
        kv_bits.validate(cfg.head_dim)
    except ValueError as e:
        raise ValueError(f"GenerateConfig: {e}") from None
    return tier_layout(kv_bits, config.kv_protected, eviction, prompt_slots, config.max_new_tokens)


def split_keys(key: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
    """(sample keys, eviction keys), [batch] each, from one key (shared by the rows) or one per row."""
    if key.ndim == 0:
        sample_key, evict_key = jax.random.split(key)
        return jnp.broadcast_to(sample_key, (batch,)), jnp.broadcast_to(evict_key, (batch,))
    pairs = jax.vmap(jax.random.split)(key)  # [batch, 2]
    return pairs[:, 0], pairs[:, 1]


def whole_vocab(logits: jax.Array, mesh: jax.sharding.Mesh | None) -> jax.Array:
    """Logits [batch, vocab] with the vocabulary gathered on every device of the row's `model` group (identity
    without a mesh), so that sampling runs per device. Sampling takes a cumulative sum over the vocabulary
    (`sampling._inverse_cdf`), which jax lowers on CPU as a reduce-window; over a vocabulary split across devices
    that reduce-window took about 7 s per decode step for 151936 ids (2 processes x 4 devices, data=4, model=2).
    The gather moves [batch, vocab] logits per step, never the cache."""
    return constrain(logits, ("batch", "gathered_vocab"), mesh)  # a name without a rule: replicated


def first_tokens(logits: jax.Array, sample_key: jax.Array, row_ids: jax.Array, config: GenerateConfig,
                 target: Target, mesh: jax.sharding.Mesh | None = None) -> jax.Array:
    """Token 0 of every row, from the prefill's logits [batch, vocab]: [batch] int32."""
    return sample(whole_vocab(logits, mesh), fold_rows(sample_key, jnp.zeros_like(row_ids)), config.sampling, row_ids,
                  rowwise=target.rowwise_sampling)


def ended(token: jax.Array, num_tokens: jax.Array, cap: jax.Array, config: GenerateConfig) -> jax.Array:
    """[batch] bool: `token` (the row's `num_tokens`-th) is an end token, or the row reached its cap."""
    eos = jnp.asarray(config.eos_token_ids or (-1,), jnp.int32)
    return jnp.isin(token, eos) | (num_tokens >= cap)


def decode_loop(model: Qwen3, s: LoopState, config: GenerateConfig, eviction: EvictionConfig, keep_going,
                target: Target, mesh: jax.sharding.Mesh | None = None) -> LoopState:
    """Decode steps while `keep_going(s)` (a scalar bool) holds, evicting the rows whose trigger fires. Under a
    `mesh` the cache keeps its sharding through the loop and each device evicts its own rows and kv heads.
    `target`: the platform and layer loop of the program (`vase_jax.target`).

    A step feeds `last` of every active row (not done, and the batch has reached its `start` step), samples its
    next token with its own key and step index, and writes it at column `num_tokens` of its output buffer.
    """
    impl = config.attention_impl
    b = s.last.shape[0]
    rows = jnp.arange(b)
    width = s.tokens.shape[1]

    def running(s: LoopState) -> jax.Array:
        return jnp.any(~s.done) & keep_going(s)

    def step(s: LoopState) -> LoopState:
        active = ~s.done & (s.step >= s.start)
        logits, cache = decode_step(model, s.cache.replace(active=active), s.last, impl, target)
        cache = constrain_cache(cache, mesh)  # the loop carry keeps the cache's sharding: no reshuffling per step
        token = sample(whole_vocab(logits, mesh), fold_rows(s.sample_key, s.num_tokens), config.sampling, s.row_ids,
                       rowwise=target.rowwise_sampling)
        column = jnp.where(active, s.num_tokens, width)  # inactive rows: out of range, dropped
        tokens = s.tokens.at[rows, column].set(token, mode="drop")
        num_tokens = s.num_tokens + active.astype(jnp.int32)
        done = s.done | (active & ended(token, num_tokens, s.cap, config))
        return s.replace(cache=cache, tokens=tokens, last=jnp.where(active, token, s.last), done=done,
                         num_tokens=num_tokens, step=s.step + 1)

    if not s.cache.has_events(eviction):
        return jax.lax.while_loop(running, step, s)

    # Decode steps run in an inner loop that exits when an eviction is due; the outer loop evicts. The per-step
    # body thus holds no conditional, which would make XLA copy the cache at every step.
    def segment(s: LoopState) -> LoopState:
        # At least one step (the trigger is checked after a step, never right after the prefill or an
        # eviction), traced once: `first` is true only on entry.
        def more(c):
            s, first = c
            return running(s) & (first | ~s.cache.rows_due(eviction).any())

        s, _ = jax.lax.while_loop(more, lambda c: (step(c[0]), jnp.bool_(False)), (s, jnp.bool_(True)))
        evicted = framework.should_evict(s.cache, eviction) if eviction.evicts else jnp.bool_(False)
        # No conditional around the event (XLA:GPU would copy the cache into and out of its branches): with no
        # row due, `evict` runs zero layers. Per device under a mesh.
        cache = constrain_cache(framework.evict_per_device(s.cache, eviction, s.evict_key, s.row_ids, impl), mesh)
        gap = jnp.where(evicted, jnp.minimum(s.min_event_gap, s.step - s.last_event), s.min_event_gap)
        return s.replace(cache=cache, events=s.events + evicted.astype(jnp.int32), min_event_gap=gap,
                         last_event=jnp.where(evicted, s.step, s.last_event))

    return jax.lax.while_loop(running, segment, s)


@functools.partial(target_jit, static_argnums=(0, 7, 8, 9, 10, 11), target_argnum=10, mesh_argnum=11)
def generate_program(graphdef, state, input_ids, attention_mask, key, row_ids, caps, config: GenerateConfig,
              eviction: EvictionConfig, layout: CacheLayout | TierLayout, target: Target,
              mesh: jax.sharding.Mesh | None = None) -> GenerateOutput:
    # Under a mesh, kernels see it while tracing (`pallas_kernels.dispatch.per_device` runs them in `shard_map`);
    # batch invariance fixes the decode kernel's split count whatever the batch (`decode_tuning.fixed_splits`).
    with (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None else contextlib.nullcontext(),
          fixed_splits(config.batch_invariant)):
        return _generate_body(graphdef, state, input_ids, attention_mask, key, row_ids, caps, config, eviction,
                              layout, target, mesh)


def _generate_body(graphdef, state, input_ids, attention_mask, key, row_ids, caps, config: GenerateConfig,
                   eviction: EvictionConfig, layout: CacheLayout | TierLayout, target: Target, mesh) -> GenerateOutput:
    model = nnx.merge(graphdef, state)
    b = input_ids.shape[0]
    sample_key, evict_key = split_keys(key, b)

    with jax.named_scope("prefill"):
        logits, cache = prefill_prompts(model, input_ids, attention_mask, layout, config, eviction, evict_key, row_ids,
                                        target, mesh)
        first = first_tokens(logits, sample_key, row_ids, config, target, mesh)

    # The batch's ticks: row 0 starts at once, every other row waits for its trigger phase.
    phase = cache.seen[0]
    start = cache.phase_wait(cache.seen - phase, jnp.int32(0), eviction)
    ones = jnp.ones((b,), jnp.int32)
    tokens = constrain(jnp.full((b, config.max_new_tokens), config.pad_id, jnp.int32).at[:, 0].set(first),
                       ("batch", "step"), mesh)
    state0 = LoopState(cache=cache, tokens=tokens, last=first, done=ended(first, ones, caps, config), num_tokens=ones,
                       cap=caps, start=start, sample_key=sample_key, evict_key=evict_key, row_ids=row_ids,
                       step=jnp.int32(0), **no_events())
    final = decode_loop(model, state0, config, eviction, lambda s: jnp.bool_(True), target, mesh)
    return GenerateOutput(tokens=final.tokens, num_tokens=final.num_tokens, finished=ended_by_token(final, config),
                          evictions=final.events,
                          row_evictions=final.cache.evictions, cache_length=final.cache.length,
                          steps=final.step, cache=final.cache.as_floats() if config.return_cache else None)


def no_events() -> dict[str, jax.Array]:
    """The event counters of a `LoopState` before any event."""
    return dict(events=jnp.int32(0), last_event=jnp.int32(-NO_GAP), min_event_gap=jnp.int32(NO_GAP))


def ended_by_token(s: LoopState, config: GenerateConfig) -> jax.Array:
    """[batch] bool: the row's last token is an end token."""
    eos = jnp.asarray(config.eos_token_ids or (-1,), jnp.int32)
    last = jnp.take_along_axis(s.tokens, jnp.maximum(s.num_tokens - 1, 0)[:, None], axis=1)[:, 0]
    return jnp.isin(last, eos)


def query_window(eviction: EvictionConfig) -> int:
    """Query ring size of the cache: the buffer for attention-scored eviction methods, else 0 (no ring)."""
    return eviction.buffer if eviction.evicts and METHODS[eviction.method].needs_queries else 0


def prefill(model: Qwen3, input_ids: jax.Array, attention_mask: jax.Array,
            capacity: int | CacheLayout | TierLayout, window: int, attention_impl: str = "auto", state: tuple = (),
            mesh: jax.sharding.Mesh | None = None, target: Target | None = None, chunk: int | None = None):
    """The prompt forward pass and the cache it fills: (last-position logits [batch, vocab] f32, KVCache).

    `capacity`: a slot count, or a cache layout (`cache_layout`); `window` > 0 keeps a ring of that many post-RoPE
    queries (see `query_window`); `state`: the policy's per-slot state arrays (`framework.slot_state`); `mesh`:
    create the cache sharded over it (`vase_jax.sharding.cache_specs`); `target`: the program's platform and layer
    loop (default: as `Qwen3.forward` picks it), which also decides the cache's storage. `chunk`
    (`GenerateConfig.prefill_chunk`): a prompt of more columns than this runs in chunks (`chunked_prefill`).
    """
    target = Target.of(model.embedding[...]) if target is None else target
    layout = as_layout(capacity)
    if chunk is not None and input_ids.shape[1] > chunk:
        staged = layout.chunk_staging(input_ids.shape[1]).init(model.cfg, input_ids.shape[0], window, model.dtype,
                                                               state, target)
        logits, staged = chunked_prefill(model, input_ids, attention_mask, constrain_cache(staged, mesh), chunk,
                                         attention_impl, target)
        cache = layout.from_chunks(staged, attention_mask.astype(bool), model.cfg)
    else:
        cache = constrain_cache(layout.init(model.cfg, input_ids.shape[0], window, model.dtype, state, target),
                                mesh)
        logits, cache = model.forward(input_ids, prompt_positions(attention_mask), cache,
                                      attention_mask=attention_mask, attention_impl=attention_impl, target=target,
                                      last_logits_only=True)
    return logits[:, -1], constrain_cache(cache, mesh)


def prefill_prompts(model: Qwen3, input_ids: jax.Array, attention_mask: jax.Array,
                    layout: CacheLayout | TierLayout, config: GenerateConfig, eviction: EvictionConfig,
                    evict_key: jax.Array, row_ids: jax.Array, target: Target, mesh=None):
    """`prefill` as `generate` runs it (the eviction's query window and state, `config`'s kernels and chunks) into
    a cache of `layout`. With `eviction.compress_prompt` the prompt goes to a cache that holds it (max(P, N) + B
    slots), then `framework.compress_prompt` evicts each row longer than N (its `evict_key`) and keeps `layout`'s
    N + B slots."""
    logits, cache = prefill(model, input_ids, attention_mask, prompt_layout(layout, eviction, config,
                                                                            input_ids.shape[1]),
                            query_window(eviction), config.attention_impl, framework.slot_state(eviction), mesh,
                            target, config.prefill_chunk)
    if eviction.compress_prompt:
        cache = constrain_cache(framework.compress_prompt(cache, eviction, evict_key, row_ids, config.attention_impl,
                                                          layout.slots), mesh)
    return logits, cache


def prompt_layout(layout: CacheLayout | TierLayout, eviction: EvictionConfig, config: GenerateConfig,
                  prompt_slots: int) -> CacheLayout | TierLayout:
    """The layout the prefill fills: `layout`, or with prompt compression one that holds the whole prompt
    (max(P, N) + B slots), compressed to `layout` after the prefill."""
    if not eviction.compress_prompt:
        return layout
    return CacheLayout(framework.capacity_for(dataclasses.replace(eviction, compress_prompt=False), prompt_slots,
                                              config.max_new_tokens))


def chunked_prefill(model: Qwen3, input_ids: jax.Array, attention_mask: jax.Array, cache: KVCache, chunk: int,
                    attention_impl: str, target: Target) -> tuple[jax.Array, KVCache]:
    """The prefill in chunks of `chunk` tokens: the prompts unpadded (row b's tokens at columns [0, P_b), its
    padding after them, to a multiple of `chunk`), then a loop over the chunks, each through every layer
    (`Qwen3.prefill_chunk`), keeping each row's last real token's output. Memory: one chunk's activations and one
    block of chunk x chunk scores per (row, head), beside the cache. -> (logits [batch, 1, vocab] f32, cache; its
    per-slot state holds the prompt's summed attention weights: the layout's `from_chunks` finishes it)."""
    b, t = input_ids.shape
    chunks = -(-t // chunk)
    pad = left_padding(attention_mask)  # [batch]
    tokens = pad_axis(unpad(input_ids, pad, 1), 1, chunks * chunk, 0)  # [batch, chunks * chunk]
    last = t - pad - 1  # [batch] the column of each row's last real token

    def one_chunk(c, carry):
        cache, out = carry
        start = c * chunk
        x, cache = model.prefill_chunk(jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1), start, cache,
                                       attention_impl=attention_impl, target=target)  # x [batch, chunk, embed]
        column = last - start
        mine = jnp.take_along_axis(x, jnp.clip(column, 0, chunk - 1)[:, None, None], axis=1)  # [batch, 1, embed]
        return cache, jnp.where(((column >= 0) & (column < chunk))[:, None, None], mine, out)

    cache = cache.start_prompt(attention_mask.astype(bool))
    out = jnp.zeros((b, 1, model.cfg.hidden_size), model.dtype)
    cache, out = jax.lax.fori_loop(0, chunks, one_chunk, (cache, out))
    return model.logits(out, target), cache


def decode_step(model: Qwen3, cache: KVCache, token: jax.Array, attention_impl: str = "auto",
                target: Target | None = None):
    """Feed one token per row: token [batch] -> (logits [batch, vocab] f32, updated cache). `target`: as in
    `prefill`."""
    logits, cache = model.forward(token[:, None], cache.row_pos[:, None], cache, attention_impl=attention_impl,
                                  target=target)
    return logits[:, 0], cache
