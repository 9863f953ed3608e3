"""Decode attention over the KV cache: one switch (`attention_impl`) between the Pallas kernel and the XLA path."""

from __future__ import annotations

import jax

from pallas_kernels import decode_attention_reference, get_decode_attention


def decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, pos: jax.Array, length: jax.Array, impl: str = "auto",
    layer: jax.Array | int | None = None,
) -> jax.Array:
    """One query token per row against the cache.

    q: [batch, kv_heads, group, head_dim]; k, v: [batch, kv_heads, capacity, head_dim]; pos: [batch, kv_heads,
    capacity] (-1 = empty, masked); length: int32 scalar, slots in use (slots >= length are never read).
    `impl`: "auto" (Pallas on GPU, XLA elsewhere), "xla", or "pallas" (interpret mode off GPU).
    Returns [batch, kv_heads, group, head_dim] in q's dtype.

    `layer`: k, v and pos are the stacked cache (a leading `layers` axis) and the query attends over that layer.
    The XLA path slices its blocks straight from the stack; the Pallas kernels take one layer's arrays (the
    slice `k[layer]`).
    """
    fn = get_decode_attention(impl)
    if layer is None:
        return fn(q, k, v, pos, length)
    if fn is decode_attention_reference:
        return fn(q, k, v, pos, length, layer=layer)
    return fn(q, k[layer], v[layer], pos[layer], length)
