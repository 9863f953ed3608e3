"""The method registry and the inputs every selection function receives.

A selection function is pure:

    select(inputs: EvictionInputs, config: EvictionConfig, key: jax.Array) -> kept  # [batch, kv_heads, K] int32

`kept` indexes the candidate axis of `inputs.keys`, in the order the slots will be stored (the reference stores
kept slots in selection order: protected first, then top-k or sampled draws). Every index must be distinct and,
while valid candidates remain unchosen, point at a valid candidate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from flax import struct


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

    @property
    def valid(self) -> jax.Array:  # [batch, kv_heads, L] bool
        return self.pos >= 0


SelectFn = Callable[[EvictionInputs, "EvictionConfig", jax.Array], jax.Array]  # noqa: F821


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    select: SelectFn
    needs_queries: bool  # whether the generate loop must keep the query ring buffer for this method
    stochastic: bool  # whether the kept set depends on the generate key (event key or layer key)
    doc: str = ""


METHODS: dict[str, Method] = {}


def register(name: str, *, needs_queries: bool, stochastic: bool, doc: str = "") -> Callable[[SelectFn], SelectFn]:
    """Decorator: register `select` under `name` so that `EvictionConfig(method=name)` uses it."""

    def wrap(select: SelectFn) -> SelectFn:
        if name in METHODS:
            raise ValueError(f"eviction method {name!r} is already registered")
        METHODS[name] = Method(name, select, needs_queries, stochastic, doc or (select.__doc__ or "").strip())
        return select

    return wrap
