"""Decode attention over a quantized cache segment, with the scales folded into the einsums (XLA path).

A quantized key or value is x_hat[c] = code[c] * scale[G(c)] + low[G(c)] (`vase_jax.kvquant`; G(c) the group of
channel c). For one query q (scaled by 1/sqrt(D)) and slot j, with q summed per group, qsum[G] = sum_{c in G} q[c]:

    s_j    = sum_c q[c] k_hat_j[c] = sum_G scale_j[G] (sum_{c in G} q[c] code_j[c]) + sum_G low_j[G] qsum[G]
    out[c] = sum_j p_j v_hat_j[c]  = sum_j (p_j scale_j[G(c)]) code_j[c] + sum_j p_j low_j[G(c)]

so a block's codes are unpacked and multiplied as they are, and no dequantized copy of the cache is made.

A cache held in segments (the 16-bit tier, then the quantized one) is read by one loop, `segments_partials`: the
used blocks of each segment in turn, every block one update of the same online softmax (the XLA reference's,
`pallas_kernels.decode_attention`), so the segments need no merge. The kernels read each segment on its own and
return its unnormalized partials (acc, m, l); `merge` joins them by log-sum-exp:

    M = max(m_a, m_b),   out = (e^{m_a - M} acc_a + e^{m_b - M} acc_b) / (e^{m_a - M} l_a + e^{m_b - M} l_b)

(0 where neither segment has a valid slot).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.decode_attention import stored_as
from pallas_kernels.dispatch import pairwise_sum
from vase_jax.kvquant import Quantized

_NEG = -1e30  # a finite start for the running max: exp(m_old - m_new) never sees inf - inf
_HIGHEST = lax.Precision.HIGHEST


def _block(a: jax.Array, start, block: int, layer, axis: int = 2) -> jax.Array:
    """Slots [start, start + block) of a [(layers,) batch, kv_heads, ...] array whose slots are on `axis` (of one
    layer; 2: [.., slots, ...], 3: a group-major [.., groups, slots]), layer `layer` when stacked, sliced straight
    from the stack: [batch, kv_heads, ...] with `block` slots."""
    if layer is None:
        return lax.dynamic_slice_in_dim(a, start, block, axis=axis)
    starts = [0] * a.ndim
    starts[0], starts[axis + 1] = layer, start
    sizes = list(a.shape)
    sizes[0], sizes[axis + 1] = 1, block
    return lax.dynamic_slice(a, starts, sizes)[0]


def _values16(x: Quantized, start, block: int, layer, dtype) -> jax.Array:
    """Slots [start, start + block) of a 16-bit side (`bits` 16: its values, or their bits, as `codes`), float32
    [b, h, block, D]."""
    return stored_as(_block(x.codes, start, block, layer), dtype).astype(jnp.float32)


def _planes(x: Quantized, start, block: int, layer, dtype) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """Slots [start, start + block) of a quantized segment (`_block`) as channel planes: codes as float32
    [b, h, block, G, g / n] per plane, scale and low [b, h, block, G]. 8 bits: one plane of every channel;
    4 bits: two, the low nibbles (the even channels) and the high nibbles (the odd ones), so the codes are never
    interleaved (q is split once per call, and a block's output [b, h, group, D] is joined). The stored scale and
    low are group-major (`kvquant.slots_last`); a block's are turned to [b, h, block, G] (inside the fusion)."""
    scale = jnp.swapaxes(_floats(_block(x.scale, start, block, layer, axis=3), dtype), 2, 3)  # [b, h, block, G]
    low = jnp.swapaxes(_floats(_block(x.low, start, block, layer, axis=3), dtype), 2, 3)
    codes = _block(x.codes, start, block, layer)  # [b, h, block, D * bits / 8] uint8
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


class Segment(NamedTuple):
    """One segment of a cache: keys and values as `Quantized` as a cache stores them (`kvquant.slots_last`:
    codes [(layers,) batch, kv_heads, slots, bytes], scale and low [(layers,) batch, kv_heads, groups, slots]; a
    16-bit side: `bits` 16, its values or their bits as `codes`), pos [(layers,) batch, kv_heads, slots] (-1:
    empty) and length [batch] (slots in use per row)."""

    k: Quantized
    v: Quantized
    pos: jax.Array
    length: jax.Array


def _block_scores(qf, q_planes, q_sum, k: Quantized, start, block: int, layer, dtype):
    """s [b, h, group, block] = q . k_hat over slots [start, start + block) (module docstring's folded form)."""
    if k.bits == 16:
        keys = _values16(k, start, block, layer, dtype)  # [b, h, blk, D]
        return jnp.einsum("bhgd,bhsd->bhgs", qf, keys, precision=_HIGHEST)
    k_planes, k_scale, k_low = _planes(k, start, block, layer, dtype)  # [b, h, blk, Gk, .], [b, h, blk, Gk]
    # one group: plain 4-D contractions, the low term a broadcast product (XLA:CPU runs the 5-D contractions
    # with a group axis about 1.3x slower at one group)
    if k_scale.shape[-1] == 1:
        s = q_sum[..., :1] * k_low[:, :, None, :, 0]  # [b, h, group, blk]
        for qp, kp in zip(q_planes, k_planes, strict=True):
            s = s + jnp.einsum("bhgc,bhsc->bhgs", qp[:, :, :, 0], kp[:, :, :, 0],
                               precision=_HIGHEST) * k_scale[:, :, None, :, 0]
        return s
    s = jnp.einsum("bhgG,bhsG->bhgs", q_sum, k_low, precision=_HIGHEST)  # [b, h, group, blk]
    for qp, kp in zip(q_planes, k_planes, strict=True):
        per_group = jnp.einsum("bhgGc,bhsGc->bhgsG", qp, kp, precision=_HIGHEST)  # [b, h, group, blk, Gk]
        s = s + (per_group * k_scale[:, :, None]).sum(-1)
    return s


def _block_values(p, v: Quantized, valid, start, block: int, layer, dtype):
    """sum_j p_j v_hat_j [b, h, group, D] over slots [start, start + block) (p [b, h, group, block], 0 on
    invalid slots; the invalid slots' values, garbage or NaN, are zeroed before they meet p)."""
    if v.bits == 16:
        values = jnp.where(valid[..., None], _values16(v, start, block, layer, dtype), 0.0)  # [b, h, blk, D]
        return jnp.einsum("bhgs,bhsd->bhgd", p, values, precision=_HIGHEST)
    v_planes, v_scale, v_low = _planes(v, start, block, layer, dtype)  # [b, h, blk, Gv, .], [b, h, blk, Gv]
    weighted = p[..., None] * jnp.where(valid[..., None], v_scale, 0.0)[:, :, None]  # [b, h, group, blk, Gv]
    v_low = jnp.where(valid[..., None], v_low, 0.0)  # [b, h, blk, Gv]
    if v_scale.shape[-1] == 1:
        low = (p * v_low[:, :, None, :, 0]).sum(-1)[..., None, None]  # [b, h, group, 1, 1]
        planes = [jnp.einsum("bhgs,bhsc->bhgc", weighted[..., 0], vp[:, :, :, 0], precision=_HIGHEST)[:, :, :, None]
                  for vp in v_planes]
    else:
        low = jnp.einsum("bhgs,bhsG->bhgG", p, v_low, precision=_HIGHEST)[..., None]  # [b, h, group, Gv, 1]
        planes = [jnp.einsum("bhgsG,bhsGc->bhgGc", weighted, vp, precision=_HIGHEST) for vp in v_planes]
    return _join_channels([x + low for x in planes])  # [b, h, group, D]


def sixteen_bit_segment(k: jax.Array, v: jax.Array, pos: jax.Array, length) -> Segment:
    """A segment of 16-bit (or float32) keys and values (their values, or their bits) [(layers,) batch,
    kv_heads, slots, head_dim], as `Segment` (`bits` 16, no scales)."""
    none = jnp.zeros((0, 0), jnp.float32)  # no scale, no low
    return Segment(Quantized(k, none, none, 16), Quantized(v, none, none, 16), pos, length)


def segments_partials(q: jax.Array, segments: Sequence[Segment], *, block: int = 64, scale: float | None = None,
                      layer: jax.Array | int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online-softmax partials of q against every segment, in one loop: the used blocks of the first segment,
    then those of the next, each block one update of the same running (acc, m, l), so no merge is needed.

    q [batch, kv_heads, group, head_dim]; `segments` (`Segment`, stacked over layers when `layer` is given: that
    layer is read a block at a time, straight from the stack). A row's slots >= its length are masked, and a
    segment's blocks past its longest row are never read. Returns acc [b, h, group, head_dim], m and l
    [b, h, group] (float32).
    """
    batch, kv_heads, group, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    qf = q.astype(jnp.float32) * scale  # [b, h, group, D]
    branches, ends, end = [], [], jnp.int32(0)
    for seg in segments:
        slots = seg.pos.shape[-1]
        blk = min(block, slots)
        length = jnp.broadcast_to(jnp.clip(jnp.asarray(seg.length, jnp.int32), 0, slots), (batch,))  # [b]
        first, end = end, end + (length.max() + blk - 1) // blk  # the segment's blocks: [first, end)
        ends.append(end)
        kg = seg.k.scale.shape[-2] if seg.k.bits < 16 else 1  # key groups (a 16-bit side: one)
        query = (qf, _split_channels(qf, seg.k.bits, kg), qf.reshape(batch, kv_heads, group, kg, -1).sum(-1))

        def update(i, carry, seg=seg, blk=blk, length=length, first=first, query=query, slots=slots):
            acc, m, l = carry  # [b, h, group(, D)]
            j = i - first  # the segment's own block
            start = jnp.minimum(j * blk, slots - blk)  # the last block shifted back to fit; its repeats masked
            at = start + jnp.arange(blk, dtype=jnp.int32)  # [blk]
            live = (at >= j * blk)[None, :] & (at[None, :] < length[:, None])  # [b, blk]
            valid = (_block(seg.pos, start, blk, layer) >= 0) & live[:, None]  # [b, h, blk]
            s = _block_scores(*query, seg.k, start, blk, layer, q.dtype)
            s = jnp.where(valid[:, :, None, :], s, -jnp.inf)  # [b, h, group, blk]
            m_new = jnp.maximum(m, s.max(-1))  # [b, h, group]
            correction = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])  # 0 on invalid slots
            pv = _block_values(p, seg.v, valid, start, blk, layer, q.dtype)
            return acc * correction[..., None] + pv, m_new, l * correction + pairwise_sum(p)[..., 0]  # as 16-bit

        branches.append(update)

    def body(state):
        i, carry = state
        # The branch of the segment that block i belongs to (the last, "none", never taken inside the loop). As in
        # the 16-bit reference, the branches keep XLA:CPU from hoisting the 16-bit values' conversion (no bf16
        # dynamic-slice there) out of the loop, over the whole segment; inside, it fuses into one block's slice.
        which = sum((i >= e).astype(jnp.int32) for e in ends)
        fns = [functools.partial(f, i) for f in branches] + [lambda c: c]
        return i + 1, lax.switch(which, fns, carry)

    init = (jnp.zeros((batch, kv_heads, group, head_dim), jnp.float32),
            jnp.full((batch, kv_heads, group), _NEG, jnp.float32), jnp.zeros((batch, kv_heads, group), jnp.float32))
    _, partials = lax.while_loop(lambda st: st[0] < end, body, (jnp.int32(0), init))
    return partials


def quantized_partials(q: jax.Array, k: Quantized, v: Quantized, pos: jax.Array, length: jax.Array, *,
                       block: int = 64, scale: float | None = None, layer: jax.Array | int | None = None):
    """Online-softmax partials of q against one quantized segment (`segments_partials` of that segment).

    q [batch, kv_heads, group, head_dim]; k, v: `Quantized` as stored (`Segment`); pos [batch, kv_heads,
    slots] (-1: empty); length [batch] (slots in use per row; slots >= length[b] are masked, and blocks past the
    longest row are never read). `layer`: k, v and pos are stacked over layers ([layers, batch, ...]) and that
    layer is read, a block at a time, straight from the stack. Returns acc [b, h, group, head_dim], m and l
    [b, h, group] (float32).
    """
    return segments_partials(q, [Segment(k, v, pos, length)], block=block, scale=scale, layer=layer)


def quantized_partials_of_arrays(q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos, length, layer=None, *,
                                key_bits: int, value_bits: int, block_size: int | None = None,
                                scale: float | None = None, **launch):
    """`quantized_partials` with the kernels' signature (codes, scale and low as separate arrays): the XLA path
    of `pallas_kernels.get_quant_decode_partials`. The kernels' other launch parameters (`launch`) do not apply."""
    block = {} if block_size is None else {"block": block_size}
    return quantized_partials(q, Quantized(k_codes, k_scale, k_low, key_bits), Quantized(v_codes, v_scale, v_low,
                              value_bits), pos, length, layer=layer, scale=scale, **block)


def merge(parts, dtype) -> jax.Array:
    """Attention output from the partials (acc, m, l) of disjoint segments, by log-sum-exp (module docstring)."""
    m_max = functools.reduce(jnp.maximum, [m for _, m, _ in parts])  # [b, h, group]
    acc = sum(a * jnp.exp(m - m_max)[..., None] for a, m, _ in parts)
    l = sum(w * jnp.exp(m - m_max) for _, m, w in parts)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.astype(dtype)


def tiered_attention(q: jax.Array, full: tuple, quant: tuple | None, *, block: int = 64,
                     layer: jax.Array | int | None = None) -> jax.Array:
    """Decode attention over a cache in two tiers (the XLA path): `full` = (k, v, pos, length) in 16 bits (or
    float32; their values or their bits) and `quant` = (k, v, pos, length) quantized (`Quantized` as stored,
    `Segment`), or None; both stacked over layers when `layer` is given. One loop over the 16-bit blocks, then the
    quantized ones (`segments_partials`): no second loop and no merge. With no quantized slot the output is
    exactly `decode_attention_reference`'s on the 16-bit tier. q [batch, kv_heads, group, head_dim]."""
    segments = [sixteen_bit_segment(*full)]
    if quant is not None:
        segments.append(Segment(*quant))
    return merge([segments_partials(q, segments, block=block, layer=layer)], q.dtype)
