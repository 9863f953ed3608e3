"""The policy registry and the inputs every selection function receives.

A policy is a pure selection function plus what it declares:

    select(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> kept  # [batch, kv_heads, K] int32

- `options`: a frozen dataclass of the policy's own parameters, with defaults and an optional
  `validate(self, config)` that raises `ValueError` naming the option. `EvictionConfig(method, **options)` builds
  it (`config.options`); an option the method does not declare is an error.
- `state`: per-slot arrays (`SlotState`) that the cache keeps beside `pos` and updates at every decode step from
  the decode attention's weights; the policy reads them as `inputs.state[name]`.
- `needs_queries`: the cache keeps the ring of the newest B post-RoPE queries for this policy.
- `stochastic`: the kept set depends on the generate key.

`kept` indexes the candidate axis of `inputs.keys`, in the order the slots will be stored (the reference stores
kept slots in selection order: protected first, then top-k or sampled draws). Every index must be distinct and,
while valid candidates remain unchosen, point at a valid candidate. The framework (`framework.run_policy`) checks
the shared preconditions (at least K candidates) once, before calling `select`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

NO_EVICTION = "full"  # the method name that means "keep everything"; not a policy
FRAMEWORK_FIELDS = ("method", "budget", "buffer", "value_slots", "sink_slots", "sort_kept_by_position", "options")


@struct.dataclass
class EvictionInputs:
    """Everything a policy may look at, for one layer, at one eviction event."""

    keys: jax.Array  # [batch, kv_heads, L, head_dim] post-RoPE candidate keys (cache dtype)
    values: jax.Array  # [batch, kv_heads, L, head_dim]
    queries: jax.Array  # [batch, kv_heads, group, W, head_dim] post-RoPE queries of the newest W tokens, oldest first
    query_valid: jax.Array  # [batch, W] bool: False for queries of padding tokens
    pos: jax.Array  # [batch, kv_heads, L] int32 absolute position per candidate slot, -1 if empty or padding
    layer_key: jax.Array  # PRNG key of this layer, the same at every eviction (CurDKV's fixed projection)
    row_ids: jax.Array  # [batch] int32: each row's index in the caller's batch (per-row random streams)
    # The newest B slots, always kept (not candidates), oldest first; the last one is the newest token.
    buffer_keys: jax.Array  # [batch, kv_heads, B, head_dim]
    buffer_values: jax.Array  # [batch, kv_heads, B, head_dim]
    buffer_pos: jax.Array  # [batch, kv_heads, B] int32, -1 for padding
    state: dict[str, jax.Array] = struct.field(default_factory=dict)  # name -> [batch, kv_heads, L] float32
    # Range(v) of each candidate as the cache recorded it from the 16-bit value when the token was written (a
    # mixed-precision cache, `vase_jax.tiers`, whose quantized values would give a slightly different Range);
    # None: Range is computed from `values`.
    value_range: jax.Array | None = None  # [batch, kv_heads, L] float32
    layer: jax.Array | int = 0  # the layer these candidates belong to (traced inside the framework's layer loop)
    prompt_length: jax.Array | None = None  # [batch] int32: the row's prompt tokens (positions [0, P_b))
    next_position: jax.Array | None = None  # [batch] int32: the position of the row's next token
    # The policy's score combined over every layer (`Policy.layer_score`, `Policy.across_layers`), when the
    # kept set is shared by all layers; None otherwise.
    shared_score: jax.Array | None = None  # [batch, kv_heads, L] float32
    attention_impl: str = struct.field(pytree_node=False, default="auto")  # scoring kernels: auto | xla | pallas

    @property
    def valid(self) -> jax.Array:  # [batch, kv_heads, L] bool
        return self.pos >= 0

    @property
    def buffer_valid(self) -> jax.Array:  # [batch, kv_heads, B] bool
        return self.buffer_pos >= 0


SelectFn = Callable[[EvictionInputs, "EvictionConfig", jax.Array], jax.Array]  # noqa: F821


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """The options of a policy that has none."""


def accumulate(state: jax.Array, weights: jax.Array) -> jax.Array:
    """The default `SlotState` update: a running sum, state + weights."""
    return state + weights


@dataclasses.dataclass(frozen=True)
class SlotState:
    """A per-slot float32 array a policy keeps in the cache: `cache.state[name]`, [layers, batch, kv_heads, slots].

    Let w[b, h, j] = sum_{g in the kv head's query group} softmax_j(q_g . k_j / sqrt(D)) over the live slots
    (padding and empty slots weigh 0). The prefill sets state = update(0, sum_t w_t) over the prompt's causal
    attention (padding queries excluded); every decode step sets state = update(state, w) after writing the new
    token. An eviction moves each slot's state with the slot; slots >= N are reset to 0.
    `update` must be a module-level function (it is part of the compiled program's static structure).
    """

    name: str
    update: Callable[[jax.Array, jax.Array], jax.Array] = accumulate


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    select: SelectFn
    needs_queries: bool  # whether the cache keeps the query ring buffer for this method
    stochastic: bool  # whether the kept set depends on the generate key (event key or layer key)
    options: type = NoOptions  # frozen dataclass of the policy's parameters
    state: tuple[SlotState, ...] = ()  # per-slot arrays kept in the cache
    doc: str = ""
    # A policy whose kept set can be shared by every layer: `across_layers(config)` says how its per-layer
    # `layer_score(inputs, config)` [batch, kv_heads, L] combine ("mean" or "max"; "" keeps one set per layer).
    # The framework then scores every layer, combines, and calls `select` once with `inputs.shared_score`.
    layer_score: Callable | None = None
    across_layers: Callable | None = None
    mixed_precision: bool = True  # runs on the mixed-precision cache (`vase_jax.tiers`)

    def layer_combine(self, config) -> str:
        """How this configuration combines per-layer scores into one kept set: "mean", "max" or "" (per layer)."""
        return "" if self.across_layers is None else self.across_layers(config)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.options))


METHODS: dict[str, Policy] = {}


def register(
    name: str,
    *,
    needs_queries: bool = False,
    stochastic: bool = False,
    options: type = NoOptions,
    state: tuple[SlotState, ...] = (),
    doc: str = "",
    layer_score: Callable | None = None,
    across_layers: Callable | None = None,
    mixed_precision: bool = True,
) -> Callable[[SelectFn], SelectFn]:
    """Decorator: register `select` under `name` so that `EvictionConfig(method=name, **options)` uses it."""
    if name == NO_EVICTION:
        raise ValueError(f"eviction method name {name!r} is reserved (no eviction); choose another name")
    if not (dataclasses.is_dataclass(options) and isinstance(options, type)):
        raise ValueError(f"register({name!r}): options={options!r} must be a dataclass type")
    if not options.__dataclass_params__.frozen:
        raise ValueError(f"register({name!r}): options {options.__name__} must be a frozen dataclass")
    clash = sorted({f.name for f in dataclasses.fields(options)} & set(FRAMEWORK_FIELDS + ("attention_impl",)))
    if clash:
        raise ValueError(f"register({name!r}): options {', '.join(clash)} clash with EvictionConfig's own fields")
    names = [s.name for s in state]
    if len(set(names)) != len(names):
        raise ValueError(f"register({name!r}): state names {names} must be distinct")
    if (layer_score is None) != (across_layers is None):
        raise ValueError(f"register({name!r}): layer_score and across_layers go together")

    def wrap(select: SelectFn) -> SelectFn:
        if name in METHODS:
            raise ValueError(f"eviction method {name!r} is already registered")
        METHODS[name] = Policy(name, select, needs_queries, stochastic, options, tuple(state),
                               doc or (select.__doc__ or "").strip(), layer_score, across_layers, mixed_precision)
        return select

    return wrap


def owners(option: str) -> list[str]:
    """The registered methods that declare `option`."""
    return sorted(m for m, p in METHODS.items() if option in p.option_names)


def masked_state(inputs: EvictionInputs, name: str) -> jax.Array:
    """inputs.state[name] in float32 with invalid candidates at 0. [batch, kv_heads, L]"""
    return jnp.where(inputs.valid, inputs.state[name].astype(jnp.float32), 0.0)
