"""Attention over the KV cache: decode attention (one switch, `impl`, between the Pallas kernels and the XLA path)
and the chunked prefill's attention of a block of prompt queries (`chunk_attention`)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

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


def chunk_attention(q: jax.Array, read_block: Callable, slots: int, start: jax.Array, query_valid: jax.Array, *,
                    column_sums: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """A chunk of C prompt queries against the cache slots written so far, causally, one key block of C slots at
    a time (the online softmax of flash attention): no temporary holds more than C x C scores per (row, head), and
    only one block of the cache is read at a time.

    The prompt is stored unpadded, a token's slot is its position: query i of the chunk sits at slot start + i and
    attends to the live slots (pos >= 0) s <= start + i. For each query, with m the running maximum of its logits
    l_s = q.k_s / sqrt(D) and over the blocks: acc <- acc e^(m_old - m) + sum_s e^(l_s - m) v_s, sum <- sum
    e^(m_old - m) + sum_s e^(l_s - m); out = acc / sum. Only the blocks that hold slots [0, start + C) are read.

    q: [batch, kv_heads, group, C, head_dim]; `read_block(first, size)`: the cache's keys and values [batch,
    kv_heads, size, head_dim] (floats) and positions [batch, kv_heads, size] of slots [first, first + size), of
    `slots` in all; start: int32 scalar, the chunk's first slot; query_valid: [batch, C] bool (a row's padding
    queries past its prompt: their outputs are unused). Returns (out like q, and with
    `column_sums` the softmax weights of every slot summed over the group and the valid queries, [batch,
    kv_heads, slots] float32, else None).
    """
    b, h, g, c, d = q.shape
    block = min(c, slots)
    query_slot = start + jnp.arange(c)  # [C]
    blocks = jnp.minimum((start + c + block - 1) // block, -(-slots // block))  # blocks holding slots < start + C

    def block_logits(j):
        """Key block j (slots [j C, j C + C), its start moved back to fit the cache: the slots an earlier block
        read are masked): (masked logits [b, h, g, C, C] f32, the block's values, its first slot)."""
        first = jnp.minimum(j * block, slots - block)
        slot = first + jnp.arange(block)  # [C]
        k_j, v_j, pos_j = read_block(first, block)  # [b, h, C, d] twice, [b, h, C]
        live = (pos_j >= 0) & (slot >= j * block)  # [b, h, C]
        visible = live[:, :, None, None, :] & (slot[None, :] <= query_slot[:, None])  # [b, h, 1, C, C]
        logits = jnp.einsum("bhgqd,bhkd->bhgqk", q, k_j, preferred_element_type=jnp.float32) * d ** -0.5
        return jnp.where(visible, logits, -jnp.inf), v_j, first

    def step(j, carry):
        m, total, acc = carry  # [b, h, g, C] f32 twice, [b, h, g, C, d] f32
        logits, v_j, _ = block_logits(j)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        p = jnp.exp(logits - m_new[..., None])  # [b, h, g, C, C]
        rescale = jnp.exp(m - m_new)
        acc = acc * rescale[..., None] + jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v_j.dtype), v_j,
                                                    preferred_element_type=jnp.float32)
        return m_new, total * rescale + p.sum(axis=-1), acc

    floor = jnp.full((b, h, g, c), jnp.finfo(jnp.float32).min)  # not -inf: exp(m - m_new) stays defined
    m, total, acc = jax.lax.fori_loop(0, blocks, step, (floor, jnp.zeros_like(floor),
                                                        jnp.zeros(q.shape, jnp.float32)))
    out = jnp.where(total[..., None] > 0, acc / total[..., None], 0.0).astype(q.dtype)
    if not column_sums:
        return out, None
    weight = jnp.where(query_valid[:, None, None, :] & (total > 0), 1.0 / total, 0.0)  # [b, h, g, C]

    def add_block(j, sums):
        logits, _, first = block_logits(j)
        col = (jnp.exp(logits - m[..., None]) * weight[..., None]).sum(axis=(2, 3))  # [b, h, C]
        old = jax.lax.dynamic_slice_in_dim(sums, first, block, axis=2)
        fresh = first + jnp.arange(block) >= j * block
        return jax.lax.dynamic_update_slice_in_dim(sums, jnp.where(fresh, old + col, old), first, axis=2)

    return out, jax.lax.fori_loop(0, blocks, add_block, jnp.zeros((b, h, slots), jnp.float32))
