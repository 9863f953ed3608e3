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
from vase_jax.kvquant import Quantized

_NEG = -1e30  # a finite start for the running max: exp(m_old - m_new) never sees inf - inf
_HIGHEST = lax.Precision.HIGHEST


def _planes(x: Quantized, start, block: int, layer, dtype) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """Slots [start, start + block) of a quantized segment [(layers,) batch, kv_heads, slots, ...] (layer `layer`
    when stacked, sliced straight from the stack), as channel planes: codes as float32 [b, h, block, G, g / n]
    per plane, scale and low [b, h, block, G]. 8 bits: one plane of every channel; 4 bits: two, the low nibbles
    (the even channels) and the high nibbles (the odd ones), so nothing is interleaved per block (q and the
    output are split and joined once per call). A 16-bit side (`bits` 16, its values or their bits as `codes`)
    is one plane, one group of scale 1."""

    def take(a):
        if layer is None:
            return lax.dynamic_slice_in_dim(a, start, block, axis=2)
        starts = (layer, 0, 0, start) + (0,) * (a.ndim - 4)
        return lax.dynamic_slice(a, starts, (1, *a.shape[1:3], block, *a.shape[4:]))[0]

    if x.bits == 16:
        values = stored_as(take(x.codes), dtype).astype(jnp.float32)  # [b, h, block, D]
        ones = jnp.ones(values.shape[:3] + (1,), jnp.float32)
        return [values[..., None, :]], ones, jnp.zeros_like(ones)
    scale = _floats(take(x.scale), dtype)  # [b, h, block, G]
    low = _floats(take(x.low), dtype)
    codes = take(x.codes)  # [b, h, block, D * bits / 8] uint8
    lead = codes.shape[:3] + (scale.shape[-1], -1)
    if x.bits == 8:
        return [codes.astype(jnp.float32).reshape(lead)], scale, low
    planes = [(codes & 0x0F).astype(jnp.float32).reshape(lead), (codes >> 4).astype(jnp.float32).reshape(lead)]
    return planes, scale, low


def _floats(x: jax.Array, dtype) -> jax.Array:
    """Scales as float32: stored as floats, or as the bits (uint16) of the 16-bit `dtype`."""
    return (stored_as(x, dtype) if x.dtype == jnp.uint16 else x).astype(jnp.float32)


def _split_channels(x: jax.Array, bits: int, groups: int) -> list[jax.Array]:
    """x [..., D] as the planes of `_planes`: [..., G, g / n] each (4 bits: even channels, then odd)."""
    planes = [x] if bits != 4 else [x[..., 0::2], x[..., 1::2]]
    return [p.reshape(*p.shape[:-1], groups, -1) for p in planes]


def _join_channels(planes: list[jax.Array]) -> jax.Array:
    """The inverse of `_split_channels`: planes [..., G, g / n] -> [..., D]."""
    planes = [p.reshape(*p.shape[:-2], -1) for p in planes]
    if len(planes) == 1:
        return planes[0]
    return jnp.stack(planes, axis=-1).reshape(*planes[0].shape[:-1], -1)


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
    vg = max(v.scale.shape[-1], 1)
    qf = q.astype(jnp.float32) * scale  # [b, h, group, D]
    q_planes = _split_channels(qf, k.bits, kg)  # [b, h, group, Gk, gk / n] each
    q_sum = qf.reshape(batch, kv_heads, group, kg, -1).sum(-1)  # [b, h, group, Gk]
    offsets = jnp.arange(block, dtype=jnp.int32)

    def update(i, carry):
        acc, m, l = carry  # acc: the value planes, [b, h, group, Gv, gv / n] each
        start = jnp.minimum(i * block, slots - block)  # the last block shifted back to fit; its repeats masked
        at = start + offsets  # [block]
        k_planes, k_scale, k_low = _planes(k, start, block, layer, q.dtype)  # [b, h, blk, Gk, .], [b, h, blk, Gk]
        v_planes, v_scale, v_low = _planes(v, start, block, layer, q.dtype)  # [b, h, blk, Gv, .], [b, h, blk, Gv]
        p_blk = (lax.dynamic_slice_in_dim(pos, start, block, axis=2) if layer is None else
                 lax.dynamic_slice(pos, (layer, 0, 0, start), (1, *pos.shape[1:3], block))[0])  # [b, h, blk]
        valid = (p_blk >= 0) & (at >= i * block)[None, None] & (at[None, None] < length[:, None, None])
        # s = sum_G scale[G] (q_G . code_G) + sum_G low[G] qsum[G]; one group: plain 4-D contractions (XLA:CPU
        # runs the 5-D ones with a group axis about 1.3x slower at one group)
        if kg == 1:  # one group: the low term is a broadcast product, not a contraction
            s = q_sum[..., :1] * k_low[:, :, None, :, 0]  # [b, h, group, blk]
        else:
            s = jnp.einsum("bhgG,bhsG->bhgs", q_sum, k_low, precision=_HIGHEST)  # [b, h, group, blk]
        for qp, kp in zip(q_planes, k_planes, strict=True):
            if kg == 1:
                s = s + jnp.einsum("bhgc,bhsc->bhgs", qp[:, :, :, 0], kp[:, :, :, 0],
                                   precision=_HIGHEST) * k_scale[:, :, None, :, 0]
            else:
                per_group = jnp.einsum("bhgGc,bhsGc->bhgsG", qp, kp, precision=_HIGHEST)  # [b, h, g, blk, Gk]
                s = s + (per_group * k_scale[:, :, None]).sum(-1)
        s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))  # [b, h, group]
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])  # [b, h, group, blk]; 0 on invalid slots
        weighted = p[..., None] * jnp.where(valid[..., None], v_scale, 0.0)[:, :, None]  # [b, h, g, blk, Gv]
        v_low = jnp.where(valid[..., None], v_low, 0.0)  # [b, h, blk, Gv]
        if vg == 1:
            low = (p * v_low[:, :, None, :, 0]).sum(-1)[..., None, None]  # [b, h, group, 1, 1]
        else:
            low = jnp.einsum("bhgs,bhsG->bhgG", p, v_low, precision=_HIGHEST)[..., None]  # [b, h, group, Gv, 1]
        def values(vp):  # [b, h, group, Gv, gv / n]
            if vg == 1:
                out = jnp.einsum("bhgs,bhsc->bhgc", weighted[..., 0], vp[:, :, :, 0], precision=_HIGHEST)
                return out[:, :, :, None]
            return jnp.einsum("bhgsG,bhsGc->bhgGc", weighted, vp, precision=_HIGHEST)

        acc = tuple(a * correction[..., None, None] + low + values(vp) for a, vp in zip(acc, v_planes, strict=True))
        return acc, m_new, l * correction + p.sum(-1)

    def body(state):
        i, carry = state
        # Always taken (i < used_blocks in the loop): as in the 16-bit reference, the cond keeps XLA:CPU from
        # hoisting the 16-bit scales' conversion (no bf16 dynamic-slice there) out of the loop, over the whole
        # segment; inside it the conversion fuses into the slice of one block.
        return i + 1, lax.cond(i < used_blocks, functools.partial(update, i), lambda c: c, carry)

    planes = 2 if v.bits == 4 else 1
    acc0 = tuple(jnp.zeros((batch, kv_heads, group, vg, head_dim // vg // planes), jnp.float32)
                 for _ in range(planes))
    init = (acc0, jnp.full((batch, kv_heads, group), _NEG, jnp.float32), jnp.zeros((batch, kv_heads, group),
                                                                                    jnp.float32))
    _, (acc, m, l) = lax.while_loop(lambda st: st[0] < used_blocks, body, (jnp.int32(0), init))
    return _join_channels(list(acc)), m, l


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
