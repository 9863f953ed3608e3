"""Decode attention over a quantized KV-cache segment for TPU: a Pallas (Mosaic TPU) kernel returning partials,
the twin of the Triton kernel in `quant_decode_attention.py` (same signature, same math, same partials).

For row b, kv head h and group member r, over the valid slots j (j < length[b] and pos[b,h,j] >= 0), with
x_hat[c] = code[c] * scale[G(c)] + low[G(c)] (`vase_jax.kvquant`):

    s_j = scale_qk * q . k_hat_j,   m = max_j s_j,   l = sum_j e^{s_j - m},   acc = sum_j e^{s_j - m} v_hat_j

returned unnormalized (acc [b, h, group, head_dim], m, l [b, h, group], float32; acc = 0, l = 0, m = -1e30 where
no slot is valid), to be merged with the 16-bit tier's partials by log-sum-exp (`vase_jax.quant_attention.merge`).

Layout (the TPU's (8, 128) vector tiles): slots on the sublane axis of the code blocks, channels on lanes, as K
and V in `decode_attention_tpu.py`; the logits [rows, block] have the slots on lanes. The scales and lows are
read group-major, [groups, block] (slots on lanes, like `pos`), so the kernel folds them into the products as
`vase_jax.quant_attention` does, without a dequantized block and without a transpose (the cache stores them so,
`vase_jax.kvquant.slots_last`):

    s[r, j]   = scale * sum_G ( k_scale[G, j] (q_G[r] . k_code_j) + k_low[G, j] qsum_G[r] )
    acc[r, c] += sum_j (p[r, j] v_scale[G(c), j]) v_code_j[c] + sum_j p[r, j] v_low[G(c), j]

where q_G is q with the channels outside group G zeroed (made outside the kernel, a few rows), so each group's
key product is a full-width MXU product, and each value group's product is selected onto its channels' lanes by
a lane iota (a few extra MXU passes for a tiny `rows`; decode is bound by the bytes read). The codes are exact in
q's dtype; products accumulate in float32 (float32: full-precision passes).

4-bit codes: a byte holds the even channel of a pair in its low nibble and the odd one in its high nibble. The
kernel keeps the two nibble planes apart ([block, head_dim / 2] each: all even channels, all odd channels), so no
lane interleaving happens in the kernel: the query arrives split the same way ([2, rows, head_dim / 2], q[0::2]
and q[1::2], a copy of q's few rows made outside), s = q_even . k_even + q_odd . k_odd, the value accumulator is
held as the two planes and interleaved back outside (the [batch, kv_heads, group, head_dim] result, not the
cache). 8-bit codes are one plane of head_dim channels.

Grid (batch, kv_heads, blocks) as in `decode_attention_tpu.py`: the block axis is the online-softmax reduction;
the pipeline fetches block min(i, last) with last the row's last block holding a slot < length[b], so steps past
a row's own length issue no copy and skip their compute (`pl.when`); lengths and `layer` (a stacked cache's layer,
read straight from the stack) reach the index maps as one scalar-prefetch array. Value rows at slots >= length
are zeroed before the value product (the last block may hold garbage there, in the scales too); slots < length
with pos < 0 contribute p = 0 and must hold finite scales (the cache initializes them to zero).

`interpret` takes `pallas_kernels.dispatch.tpu_interpret_params()` to run on CPU with TPU semantics (tests).
Launch parameters other than `block_size` (a multiple of 128 slots) are the Triton kernel's and are ignored.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.decode_attention import row_lengths, stored_as
from pallas_kernels.quant_decode_attention import check_quant_args
from pallas_kernels.tpu_common import LANES, dot_precision, lanes_to, sublane_multiple

DEFAULT_BLOCK_SIZE_TPU = 512  # slots per grid step: [512, 128] uint8 codes and their float32 planes in VMEM
_NEG = -1e30  # finite start for running maxima: exp(m_old - m_new) never sees inf - inf


def planes(bits: int) -> int:
    """Channel planes of a token's codes: 1 at 8 bits (all channels), 2 at 4 bits (even channels, odd channels)."""
    return 1 if bits == 8 else 2


def _code_planes(codes_ref, bits: int, dtype) -> list[jax.Array]:
    """A block's codes per plane in `dtype` (exact integers): [block, head_dim] at 8 bits, or [block, head_dim / 2]
    even and odd channels at 4 bits."""
    raw = codes_ref[...].astype(jnp.int32)  # [block, bytes]
    planes_ = [raw] if bits == 8 else [raw & 0x0F, raw >> 4]
    return [c.astype(jnp.float32).astype(dtype) for c in planes_]


def _per_group_lanes(parts: list[jax.Array], width: int) -> jax.Array:
    """[rows, width] from one [rows, width] (or [rows, 1]) array per group: lane i takes its group's,
    group i // (width / groups). One group: the array itself."""
    if len(parts) == 1:
        return jnp.broadcast_to(parts[0], (parts[0].shape[0], width))
    lane_group = lax.div(lax.broadcasted_iota(jnp.int32, (parts[0].shape[0], width), 1),
                         jnp.int32(width // len(parts)))  # [rows, width] (lax.div: no sign handling to lower)
    out = jnp.zeros((parts[0].shape[0], width), jnp.float32)
    for g, x in enumerate(parts):
        out = jnp.where(lane_group == g, x, out)
    return out


def _quant_kernel(
    scalars_ref,  # SMEM [batch + 1] int32 (scalar prefetch): length per row, then layer
    q_ref,  # [key groups, key planes, rows, key width]: q's plane channels of each group (zero elsewhere)
    k_codes_ref,  # [block, head_dim * key_bits / 8] uint8
    k_scale_ref,  # [key groups, block]
    k_low_ref,  # [key groups, block]
    v_codes_ref,  # [block, head_dim * value_bits / 8] uint8
    v_scale_ref,  # [value groups, block]
    v_low_ref,  # [value groups, block]
    pos_ref,  # [1, block] int32
    acc_out_ref,  # [value planes, rows, value width] float32
    m_out_ref,  # [rows, LANES] float32
    l_out_ref,  # [rows, LANES] float32
    m_ref,  # VMEM scratch [rows, LANES] f32, running max (replicated over lanes)
    l_ref,  # VMEM scratch [rows, LANES] f32, running sum
    acc_ref,  # VMEM scratch [value planes, rows, value width] f32
    *,
    scale: float,
    key_bits: int,
    value_bits: int,
):
    i = pl.program_id(2)
    block = k_codes_ref.shape[0]
    length = scalars_ref[pl.program_id(0)]
    dtype = q_ref.dtype
    precision = dot_precision(dtype)
    key_groups, value_groups = k_scale_ref.shape[0], v_scale_ref.shape[0]

    def group_row(ref, g, valid=None):  # [1, block] float32: a group's scale or low per slot (slots on lanes)
        x = stored_as(ref[pl.ds(g, 1), :], dtype).astype(jnp.float32)  # a cache kept as bits, too
        return x if valid is None else jnp.where(valid, x, 0.0)

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(i * block < length)
    def _step():
        lane_slot = i * block + lax.broadcasted_iota(jnp.int32, (1, block), 1)  # [1, block]
        valid = (lane_slot < length) & (pos_ref[...] >= 0)  # [1, block]
        keys = _code_planes(k_codes_ref, key_bits, dtype)  # [block, key width] per plane
        s = jnp.zeros((q_ref.shape[2], block), jnp.float32)  # [rows, block]
        for g in range(key_groups):
            q_sum = sum(jnp.sum(q_ref[g, n].astype(jnp.float32), axis=1, keepdims=True)
                        for n in range(len(keys)))  # [rows, 1]: qsum[G]
            group_dot = functools.reduce(operator.add, (  # [rows, block]: q_G . code_j,G
                lax.dot_general(q_ref[g, n], k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)
                for n, k in enumerate(keys)
            ))
            s = s + group_dot * group_row(k_scale_ref, g) + q_sum * group_row(k_low_ref, g)
        s = jnp.where(valid, s * scale, -jnp.inf)
        m_prev = m_ref[...]  # [rows, LANES]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [rows, LANES]
        alpha = jnp.exp(m_prev - m_next)  # [rows, LANES]
        p = jnp.exp(s - lanes_to(m_next, block))  # [rows, block]; exactly 0 on invalid slots
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        values = _code_planes(v_codes_ref, value_bits, dtype)  # [block, value width] per plane
        # per group: p_j scale_j[G] (rounded to q's dtype for the product) and sum_j p_j low_j[G]; the parameters
        # of invalid slots are zeroed first (p = 0 there, but 0 * NaN is NaN)
        weighted = [(p * group_row(v_scale_ref, g, valid)).astype(dtype) for g in range(value_groups)]
        low_terms = [jnp.sum(p * group_row(v_low_ref, g, valid), axis=1, keepdims=True)
                     for g in range(value_groups)]  # [rows, 1] each
        for n, v in enumerate(values):
            width = v.shape[1]
            pv = _per_group_lanes([  # [rows, width]: each lane from its own group's weights
                lax.dot_general(w, v, (((1,), (0,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)
                for w in weighted
            ], width) + _per_group_lanes(low_terms, width)
            acc_ref[n] = lanes_to(alpha, width) * acc_ref[n] + pv

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish():
        acc_out_ref[...] = acc_ref[...]
        m_out_ref[...] = m_ref[...]
        l_out_ref[...] = l_ref[...]


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "interpret", "key_bits", "value_bits"))
def _quant_tpu(q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos, length, layer, *, block_size, scale,
               interpret, key_bits, value_bits):
    batch, kv_heads, group, head_dim = q.shape
    cache = (k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos)
    if layer is None:  # one layer: a stack of 1 (free reshapes)
        cache, layer = tuple(x[None] for x in cache), 0
    k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos = cache
    layers, capacity = pos.shape[0], pos.shape[3]
    block = capacity if capacity <= block_size else block_size  # a whole small segment is one (full-dim) block
    num_blocks = pl.cdiv(capacity, block)
    rows = sublane_multiple(group, q.dtype)
    key_planes, value_planes = planes(key_bits), planes(value_bits)
    key_width, value_width = head_dim // key_planes, head_dim // value_planes
    key_groups = k_scale.shape[-2]
    q_rows = jnp.pad(q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))  # [batch, kv_heads, rows, head_dim]
    # [batch, kv_heads, key planes, rows, key width]: plane n holds channels n, n + planes, ... (4 bits: even, odd)
    q_planes = q_rows.reshape(batch, kv_heads, rows, key_width, key_planes).transpose(0, 1, 4, 2, 3)
    # [batch, kv_heads, key groups, key planes, rows, key width]: group G's lanes of each plane, zero elsewhere
    lane_group = jnp.arange(key_width) // (key_width // key_groups)  # [key width]
    q_groups = jnp.stack([jnp.where(lane_group == g, q_planes, 0) for g in range(key_groups)], axis=2)

    pos5 = pos.astype(jnp.int32).reshape(layers, batch, kv_heads, 1, capacity)  # [layers, batch, kv_heads, 1, cap]
    scalars = jnp.concatenate(
        [row_lengths(length, batch, capacity), jnp.asarray(layer, jnp.int32).reshape(1)]
    )  # [batch + 1]: length per row, layer

    def cache_index(b, h, i, scalars_ref):
        last = jnp.maximum(lax.div(scalars_ref[b] + (block - 1), block) - 1, 0)  # row b's last block in use
        return scalars_ref[batch], b, h, jnp.minimum(i, last), 0

    def pos_index(b, h, i, scalars_ref):
        layer, b, h, j, _ = cache_index(b, h, i, scalars_ref)
        return layer, b, h, 0, j

    def per_slot(x):  # a block of a cache array [layers, batch, kv_heads, slots, last]: [block, last]
        return pl.BlockSpec((None, None, None, block, x.shape[-1]), cache_index)

    def per_group(x):  # a block of a group-major array [layers, batch, kv_heads, G, slots]: [G, block]
        return pl.BlockSpec((None, None, None, x.shape[3], block), pos_index)

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, kv_heads, num_blocks),
        in_specs=[
            pl.BlockSpec((None, None, key_groups, key_planes, rows, key_width), lambda b, h, i, n: (b, h, 0, 0, 0, 0)),
            per_slot(k_codes), per_group(k_scale), per_group(k_low),
            per_slot(v_codes), per_group(v_scale), per_group(v_low),
            pl.BlockSpec((None, None, None, 1, block), pos_index),
        ],
        out_specs=[
            pl.BlockSpec((None, None, value_planes, rows, value_width), lambda b, h, i, n: (b, h, 0, 0, 0)),
            pl.BlockSpec((None, None, rows, LANES), lambda b, h, i, n: (b, h, 0, 0)),
            pl.BlockSpec((None, None, rows, LANES), lambda b, h, i, n: (b, h, 0, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((value_planes, rows, value_width), jnp.float32),
        ],
    )
    acc, m, l = pl.pallas_call(
        functools.partial(_quant_kernel, scale=scale, key_bits=key_bits, value_bits=value_bits),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, value_planes, rows, value_width), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, rows, LANES), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, rows, LANES), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=f"vase_quant_decode_tpu_k{key_bits}v{value_bits}",
    )(scalars, q_groups, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos5)
    # [batch, kv_heads, rows, head_dim]: the planes interleaved back (channel c = width index * planes + plane)
    acc = acc.transpose(0, 1, 3, 4, 2).reshape(batch, kv_heads, rows, head_dim)
    return acc[:, :, :group], m[:, :, :group, 0], l[:, :, :group, 0]


def quant_decode_partials_tpu(
    q: jax.Array,
    k_codes: jax.Array,
    k_scale: jax.Array,
    k_low: jax.Array,
    v_codes: jax.Array,
    v_scale: jax.Array,
    v_low: jax.Array,
    pos: jax.Array,
    length: jax.Array | int,
    *,
    key_bits: int,
    value_bits: int,
    layer: jax.Array | int | None = None,
    block_size: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret=False,
    scale: float | None = None,
    device_kind: str | None = None,
    **unused,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online-softmax partials of q over a quantized cache segment with the Pallas TPU kernel (module docstring);
    the arguments of `quant_decode_attention.quant_decode_partials`, with `block_size` (default
    `DEFAULT_BLOCK_SIZE_TPU`) a multiple of 128 slots and `interpret` False, `pltpu.InterpretParams()` or True.
    `num_splits`, `num_warps`, `num_stages` and `device_kind` are the Triton kernel's and are ignored.

    Returns (acc [batch, kv_heads, group, head_dim], m, l [batch, kv_heads, group]) float32, unnormalized.
    """
    del unused, num_splits, num_warps, num_stages, device_kind
    check_quant_args(q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos, length, key_bits=key_bits,
                     value_bits=value_bits, layer=layer)
    block_size = DEFAULT_BLOCK_SIZE_TPU if block_size is None else block_size
    if block_size < LANES or block_size % LANES:
        raise ValueError(f"block_size={block_size} must be a multiple of {LANES} for the TPU kernel")
    head_dim = q.shape[3]
    scale = float(head_dim**-0.5 if scale is None else scale)
    return _quant_tpu(q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos, length, layer, block_size=block_size,
                      scale=scale, interpret=interpret, key_bits=key_bits, value_bits=value_bits)
