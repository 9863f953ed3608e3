"""Decode attention over a quantized cache segment, with the scales folded into the einsums (XLA path).

A quantized key or value is x_hat[c] = code[c] * scale[G(c)] + low[G(c)] (`vase_jax.kvquant`; G(c) the group of
channel c). For one query q (scaled by 1/sqrt(D)) and slot j, with q summed per group, qsum[G] = sum_{c in G} q[c]:

    s_j    = sum_c q[c] k_hat_j[c] = sum_G scale_j[G] (sum_{c in G} q[c] code_j[c]) + sum_G low_j[G] qsum[G]
    out[c] = sum_j p_j v_hat_j[c]  = sum_j (p_j scale_j[G(c)]) code_j[c] + sum_j p_j low_j[G(c)]

so a block's codes are unpacked and multiplied as they are, and no dequantized copy of the cache is made. The
loop is the XLA reference's (`pallas_kernels.decode_attention`): an online softmax over blocks of `block` slots
that stops after the row's used blocks. It returns the unnormalized partials (acc, m, l), so that a cache held in
two segments (16-bit slots and quantized slots) is attended by `merge` of the two, by log-sum-exp:

    M = max(m_a, m_b),   out = (e^{m_a - M} acc_a + e^{m_b - M} acc_b) / (e^{m_a - M} l_a + e^{m_b - M} l_b)

(0 where neither segment has a valid slot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.decode_attention import decode_attention_partials_reference, stored_as
from vase_jax.kvquant import Quantized, unpack

_NEG = -1e30  # a finite start for the running max: exp(m_old - m_new) never sees inf - inf
_HIGHEST = lax.Precision.HIGHEST


def _codes(x: Quantized, start, block: int, layer, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Slots [start, start + block) of a quantized segment [(layers,) batch, kv_heads, slots, ...] (layer `layer`
    when stacked, sliced straight from the stack): codes as float32 [b, h, block, G, g], scale and low
    [b, h, block, G]. A 16-bit side (`bits` 16, its values or their bits as `codes`) is one group of scale 1."""

    def take(a):
        if layer is None:
            return lax.dynamic_slice_in_dim(a, start, block, axis=2)
        starts = (layer, 0, 0, start) + (0,) * (a.ndim - 4)
        return lax.dynamic_slice(a, starts, (1, *a.shape[1:3], block, *a.shape[4:]))[0]

    if x.bits == 16:
        values = stored_as(take(x.codes), dtype).astype(jnp.float32)  # [b, h, block, D]
        ones = jnp.ones(values.shape[:3] + (1,), jnp.float32)
        return values[..., None, :], ones, jnp.zeros_like(ones)
    scale, low = take(x.scale).astype(jnp.float32), take(x.low).astype(jnp.float32)
    codes = unpack(take(x.codes), x.bits).astype(jnp.float32)  # [b, h, block, D]
    return codes.reshape(*codes.shape[:3], scale.shape[-1], -1), scale, low


def quantized_partials(q: jax.Array, k: Quantized, v: Quantized, pos: jax.Array, length: jax.Array, *,
                       block: int = 64, scale: float | None = None, layer: jax.Array | int | None = None):
    """Online-softmax partials of q against a quantized segment.

    q [batch, kv_heads, group, head_dim]; k, v: `Quantized` [batch, kv_heads, slots, ...]; pos [batch, kv_heads,
    slots] (-1: empty); length [batch] (slots in use per row; slots >= length[b] are masked, and blocks past the
    longest row are never read). `layer`: k, v and pos are stacked over layers ([layers, batch, ...]) and that
    layer is read, a block at a time, straight from the stack. Returns acc [b, h, group, head_dim], m and l
    [b, h, group] (float32).
    """
    batch, kv_heads, group, head_dim = q.shape
    slots = pos.shape[-1]
    block = min(block, slots)
    scale = head_dim**-0.5 if scale is None else scale
    length = jnp.broadcast_to(jnp.clip(jnp.asarray(length, jnp.int32), 0, slots), (batch,))  # [b]
    used_blocks = (length.max() + block - 1) // block
    kg = max(k.scale.shape[-1], 1)  # key groups (a 16-bit side: one)
    qf = q.astype(jnp.float32) * scale  # [b, h, group, D]
    q_groups = qf.reshape(batch, kv_heads, group, kg, -1)  # [b, h, group, Gk, gk]
    q_sum = q_groups.sum(-1)  # [b, h, group, Gk]
    offsets = jnp.arange(block, dtype=jnp.int32)

    def update(i, carry):
        acc, m, l = carry
        start = jnp.minimum(i * block, slots - block)  # the last block shifted back to fit; its repeats masked
        at = start + offsets  # [block]
        k_codes, k_scale, k_low = _codes(k, start, block, layer, q.dtype)  # [b, h, blk, Gk, gk], [b, h, blk, Gk] x 2
        v_codes, v_scale, v_low = _codes(v, start, block, layer, q.dtype)  # [b, h, blk, Gv, gv], [b, h, blk, Gv] x 2
        p_blk = (lax.dynamic_slice_in_dim(pos, start, block, axis=2) if layer is None else
                 lax.dynamic_slice(pos, (layer, 0, 0, start), (1, *pos.shape[1:3], block))[0])  # [b, h, blk]
        valid = (p_blk >= 0) & (at >= i * block)[None, None] & (at[None, None] < length[:, None, None])
        per_group = jnp.einsum("bhgGc,bhsGc->bhgsG", q_groups, k_codes, precision=_HIGHEST)
        s = (jnp.einsum("bhgsG,bhsG->bhgs", per_group, k_scale, precision=_HIGHEST)
             + jnp.einsum("bhgG,bhsG->bhgs", q_sum, k_low, precision=_HIGHEST))  # [b, h, group, blk]
        s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))  # [b, h, group]
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])  # [b, h, group, blk]; 0 on invalid slots
        weighted = jnp.einsum("bhgs,bhsG->bhgsG", p, v_scale, precision=_HIGHEST)  # p_j scale_j[G]
        pv = jnp.einsum("bhgsG,bhsGc->bhgGc", weighted, v_codes, precision=_HIGHEST)  # [b, h, group, Gv, gv]
        pv = pv + jnp.einsum("bhgs,bhsG->bhgG", p, v_low, precision=_HIGHEST)[..., None]
        return acc * correction[..., None] + pv.reshape(acc.shape), m_new, l * correction + p.sum(-1)

    def body(state):
        i, carry = state
        return i + 1, update(i, carry)

    init = (jnp.zeros((batch, kv_heads, group, head_dim), jnp.float32),
            jnp.full((batch, kv_heads, group), _NEG, jnp.float32), jnp.zeros((batch, kv_heads, group), jnp.float32))
    _, (acc, m, l) = lax.while_loop(lambda st: st[0] < used_blocks, body, (jnp.int32(0), init))
    return acc, m, l


def merge(parts, dtype) -> jax.Array:
    """Attention output from the partials (acc, m, l) of disjoint segments, by log-sum-exp (module docstring)."""
    m_max = functools.reduce(jnp.maximum, [m for _, m, _ in parts])  # [b, h, group]
    acc = sum(a * jnp.exp(m - m_max)[..., None] for a, m, _ in parts)
    l = sum(w * jnp.exp(m - m_max) for _, m, w in parts)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.astype(dtype)


def tiered_attention(q: jax.Array, full: tuple, quant: tuple | None, *, block: int = 64,
                     layer: jax.Array | int | None = None) -> jax.Array:
    """Decode attention over a cache in two tiers: `full` = (k, v, pos, length) in 16 bits (or float32), read by
    `decode_attention_partials_reference` (stacked over layers when `layer` is given), and `quant` = (k, v, pos,
    length) quantized (`Quantized`, one layer), or None; merged by log-sum-exp. With no quantized slot the output
    is exactly `decode_attention_reference`'s on the 16-bit tier. q [batch, kv_heads, group, head_dim]."""
    parts = [decode_attention_partials_reference(q, *full, block_size=block, layer=layer)]
    if quant is not None:
        parts.append(quantized_partials(q, *quant, block=block))
    return merge(parts, q.dtype)
