"""Decode attention over the KV cache: one switch (`impl`) between the Pallas kernels and the XLA path."""

from __future__ import annotations

import jax

from pallas_kernels import get_decode_attention


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    length: jax.Array,
    impl: str = "auto",
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """One query token per row against the cache.

    q: [batch, kv_heads, group, head_dim]; k, v: [batch, kv_heads, capacity, head_dim]; pos: [batch, kv_heads,
    capacity] (-1 = empty, masked); length: int32, slots in use, a scalar for every row or [batch] one per row
    (a row's slots >= its length are masked; the kernels never read them).
    `impl` (`pallas_kernels.dispatch`): "auto" (the Pallas kernel of the platform the program is lowered for:
    Triton on cuda, Mosaic on tpu; the XLA path elsewhere), "xla", "pallas" (the platform's kernel; the Triton
    kernel in interpret mode on other platforms), "pallas_gpu" or "pallas_tpu" (that kernel family; interpret
    mode off its platform). `layer`: with a cache stacked over layers (k, v [layers, batch, kv_heads, capacity,
    head_dim], pos [layers, batch, kv_heads, capacity]), attend over that layer (a traced index works); every
    implementation reads its blocks straight from the stack. Returns [batch, kv_heads, group, head_dim] in q's dtype.
    """
    return get_decode_attention(impl)(q, k, v, pos, length, layer)
