"""Decode attention over the KV cache: one switch (`attention_impl`) between the Pallas kernel and the XLA path."""

from __future__ import annotations

import jax

from pallas_kernels import get_decode_attention


def decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array, length: jax.Array, impl: str = "auto"
) -> jax.Array:
    """One query token per row against the cache.

    q: [batch, kv_heads, group, head_dim]; k, v: [batch, kv_heads, capacity, head_dim]; pos: [batch, kv_heads,
    capacity] (-1 = empty, masked); length: int32 scalar, slots in use (slots >= length are never read).
    `impl`: "auto" (Pallas on GPU, XLA elsewhere), "xla", or "pallas" (interpret mode off GPU).
    Returns [batch, kv_heads, group, head_dim] in q's dtype.
    """
    return get_decode_attention(impl)(q, k, v, pos, length)
