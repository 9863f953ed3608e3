"""Decode attention over a quantized KV-cache segment: a Pallas (Triton) flash-decoding kernel returning partials.

The quantized tier of the mixed-precision cache holds, per token j and kv head, the codes of its key and value
packed into bytes (8 bits: one code per byte; 4 bits: two per byte, the even channel in the low nibble) and one
`scale` and one `low` per group of g channels (`vase_jax.kvquant`): x_hat[c] = code[c] * scale[G(c)] + low[G(c)].
The kernel never forms x_hat in memory: it unpacks a block's codes in registers and folds the group parameters
into the two products (the math of `vase_jax.quant_attention`). For row b, kv head h, group member (query) r,
with qsum[G] = sum_{c in G} q[c]:

    s_j    = scale * ( sum_G k_scale_j[G] (q_G . k_code_j,G) + sum_G k_low_j[G] qsum[G] )
    valid  = j < length[b] and pos[b,h,j] >= 0
    m = max_{valid j} s_j,   p_j = e^{s_j - m},   l = sum_j p_j
    acc[c] = sum_j (p_j v_scale_j[G(c)]) v_code_j[c] + sum_j p_j v_low_j[G(c)]

and returns the unnormalized partials (acc [b, h, group, head_dim], m, l [b, h, group], float32), which
`vase_jax.quant_attention.merge` combines with the 16-bit tier's by log-sum-exp (a (row, kv head) without a valid
slot: acc = 0, l = 0, m = -1e30, as in `decode_attention_partials_reference`).

Registers and products: a 4-bit byte block [block, g / 2] is split into its low nibbles (the group's even
channels) and high nibbles (odd channels), each an exact integer in q's dtype, and the query is read in the same
two strided halves (channels G g, G g + 2, ... and G g + 1, G g + 3, ...), so q_G . code_j,G is the sum of two
dots over g / 2 channels and no interleaving is ever needed; the value accumulator is held in the same pieces and
stored back with the same strides. An 8-bit group is one piece of g channels. Products in q's dtype with float32
accumulation (the codes are exact in bfloat16), the scales applied in float32 after the key dot and to p before
the value dot (rounded to q's dtype there, as p is in the 16-bit kernel).

Kernel (flash-decoding, as `decode_attention`): grid (batch, kv_heads, num_splits); a (row, kv head) pair's used
blocks, ceil(length[b] / block_size), are dealt to the splits (`decode_attention._split_range`), each program
runs an online softmax over its blocks only (blocks past a row's length are never loaded; loads in its last block
are masked) and writes (acc, m, l) of its split; the merge kernel's partials variant combines the splits:

    M = max_s m_s,   acc = sum_s e^{m_s - M} acc_s,   l = sum_s e^{m_s - M} l_s,   m = M

With one split the first kernel's partials are the result. Launch parameters come from `decode_tuning` (the
16-bit kernel's table: the quantized tier's blocks are smaller in bytes, so its block sizes fit a fortiori).
Stacked caches: with `layer`, every cache array has a leading layers axis and the kernel reads layer `layer`'s
blocks straight from the stack (one indexer per load). `quant_decode_attention_tpu.py` is the TPU twin.

The scales and lows are stored group-major ([..., groups, slots], `vase_jax.kvquant.slots_last`): a group's
parameters of a block of slots are one contiguous load.

Value parameters of slots that are not valid are zeroed before they multiply p (p = 0 there, but 0 * NaN is NaN):
garbage in a hole's or a stale slot's scale never leaks; the codes are bytes and always finite.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode_attention import (
    _MIN_ROWS,
    _NEG,
    DEFAULT_BLOCK_SIZE,
    _dot_precision,
    _launch,
    _scale,
    _split_range,
    holds_bits_of,
    merge_splits,
    stored_as,
)
from pallas_kernels.decode_tuning import DecodeParams
from pallas_kernels.dispatch import is_power_of_2, next_power_of_2, triton_params

QUANT_BITS = (8, 4)
_MIN_PIECE = 16  # Triton's dot wants every dimension >= 16: a piece (g channels at 8 bits, g / 2 at 4) as well


@dataclasses.dataclass(frozen=True)
class Piece:
    """Channels of one group that one dot reads: `start`, `start + stride`, ... (`width` of them), from the bytes
    [byte_start, byte_start + width) of a token's packed codes; `nibble` 0 / 1 (low / high) at 4 bits, None at 8."""

    group: int
    start: int
    stride: int
    width: int
    byte_start: int
    nibble: int | None


def pieces(head_dim: int, bits: int, group_size: int) -> tuple[Piece, ...]:
    """The pieces of a token's channels at `bits` bits in groups of `group_size` channels, group by group."""
    out = []
    for g in range(head_dim // group_size):
        if bits == 8:
            out.append(Piece(g, g * group_size, 1, group_size, g * group_size, None))
        else:  # the group's bytes hold its even channels (low nibbles) and its odd ones (high nibbles)
            half = group_size // 2
            out.extend(Piece(g, g * group_size + n, 2, half, g * half, n) for n in (0, 1))
    return tuple(out)


def codes_of(byte_block: jax.Array, piece: Piece) -> jax.Array:
    """The integer codes of `piece` from its bytes [block, width] (uint8), still uint8."""
    if piece.nibble is None:
        return byte_block
    return byte_block & 0x0F if piece.nibble == 0 else byte_block >> 4


# ------------------------------------------------------------------------------------------------------------
# argument checks (static shapes: they raise at trace time)
# ------------------------------------------------------------------------------------------------------------
def check_quant_args(q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos, length, *, key_bits: int,
                     value_bits: int, layer=None, min_piece: int = 1) -> tuple[int, int]:
    """Shape and dtype checks of a quantized segment; returns (key_group, value_group), channels per scale."""
    if q.ndim != 4:
        raise ValueError(f"q has shape {q.shape}; expected [batch, kv_heads, group, head_dim]")
    batch, kv_heads, _, head_dim = q.shape
    lead = 1 if layer is not None else 0
    if pos.ndim != 3 + lead or pos.shape[lead:lead + 2] != (batch, kv_heads):
        stacked = "layers, " if lead else ""
        raise ValueError(f"pos has shape {pos.shape}; expected [{stacked}{batch}, {kv_heads}, slots]")
    if not jnp.issubdtype(pos.dtype, jnp.integer):
        raise ValueError(f"pos has dtype {pos.dtype}; expected an integer dtype (int32)")
    if jnp.shape(length) not in ((), (batch,)):
        raise ValueError(f"length has shape {jnp.shape(length)}; expected a scalar or [batch] = ({batch},)")
    if not jnp.issubdtype(jnp.result_type(length), jnp.integer):
        raise ValueError(f"length has dtype {jnp.result_type(length)}; expected an integer dtype (int32)")
    groups = []
    for which, bits, codes, scale, low in (("key", key_bits, k_codes, k_scale, k_low),
                                           ("value", value_bits, v_codes, v_scale, v_low)):
        if bits not in QUANT_BITS or isinstance(bits, bool):
            raise ValueError(f"{which}_bits={bits!r}; the quantized tier takes {' or '.join(map(str, QUANT_BITS))}")
        if codes.shape != pos.shape + (head_dim * bits // 8,):
            raise ValueError(f"{which} codes have shape {codes.shape}; expected {pos.shape + (head_dim * bits // 8,)}"
                             f" (pos's shape and head_dim * {bits} / 8 bytes)")
        if codes.dtype != jnp.uint8:
            raise ValueError(f"{which} codes have dtype {codes.dtype}; expected uint8 (packed codes)")
        if (scale.shape != low.shape or scale.ndim != pos.ndim + 1
                or scale.shape[:-2] + scale.shape[-1:] != pos.shape or scale.shape[-2] < 1):
            raise ValueError(f"{which} scale / low have shapes {scale.shape}, {low.shape}; expected group-major "
                             f"{pos.shape[:-1] + ('groups', pos.shape[-1])}")
        if head_dim % scale.shape[-2]:
            raise ValueError(f"{which}: {scale.shape[-2]} groups do not divide head_dim={head_dim}")
        if scale.dtype != low.dtype or not (jnp.issubdtype(scale.dtype, jnp.floating)
                                            or holds_bits_of(scale.dtype, q.dtype)):
            raise ValueError(f"{which} scale / low have dtypes {scale.dtype}, {low.dtype}; expected one float "
                             f"dtype (or the bits of a 16-bit q dtype as uint16)")
        group_size = head_dim // scale.shape[-2]
        width = group_size if bits == 8 else group_size // 2
        if width < min_piece or not is_power_of_2(width) or (bits == 4 and group_size % 2):
            raise ValueError(f"{which} group of {group_size} channels at {bits} bits: the kernel needs a power of "
                             f"two of at least {min_piece} channels per {'nibble half' if bits == 4 else 'group'}")
        groups.append(group_size)
    return groups[0], groups[1]


# ------------------------------------------------------------------------------------------------------------
# Pallas kernel
# ------------------------------------------------------------------------------------------------------------
def _piece_view(ref, piece: Piece, rows: int):
    """`ref` [rows, head_dim] at the piece's channels: [rows, width]. A strided piece is indexed by arrays (row and
    channel indices, broadcast): the Pallas interpreter takes no strided slice, and Triton lowers both to the same
    pointer arithmetic."""
    if piece.stride == 1:
        return ref.at[pl.ds(0, rows), pl.ds(piece.start, piece.width)]
    row_idx = jnp.arange(rows, dtype=jnp.int32)[:, None]  # [rows, 1]
    channel_idx = piece.start + piece.stride * jnp.arange(piece.width, dtype=jnp.int32)[None, :]  # [1, width]
    return ref.at[row_idx, channel_idx]


def _quant_kernel(
    length_ref,  # [1] or [batch] int32: slots in use
    layer_ref,  # [1] int32
    q_ref,  # [rows, head_dim]: the GQA group's `group` rows, read masked up to `rows`
    k_codes_ref,  # [layers, slots, head_dim * key_bits / 8] uint8
    k_scale_ref,  # [layers, key groups, slots]
    k_low_ref,  # [layers, key groups, slots]
    v_codes_ref,  # [layers, slots, head_dim * value_bits / 8] uint8
    v_scale_ref,  # [layers, value groups, slots]
    v_low_ref,  # [layers, value groups, slots]
    pos_ref,  # [layers, slots] int32
    o_ref,  # [rows, head_dim] float32: this split's acc
    m_ref,  # [rows] float32
    l_ref,  # [rows] float32
    *,
    group: int,
    params: DecodeParams,
    scale: float,
    key_pieces: tuple[Piece, ...],
    value_pieces: tuple[Piece, ...],
):
    """One (row, kv head, split) program: online softmax over the split's blocks of the quantized segment."""
    block_size = params.block_size
    capacity = pos_ref.shape[1]
    row = pl.program_id(0) if length_ref.shape[0] > 1 else 0
    length = jnp.clip(length_ref[row], 0, capacity)
    layer = layer_ref[0]
    used_blocks = lax.div(length + (block_size - 1), block_size)
    first, stop = _split_range(used_blocks, pl.program_id(2), params.num_splits, params.min_blocks_per_split)

    rows = o_ref.shape[0]
    dtype = q_ref.dtype
    precision = _dot_precision(dtype)
    row_ok = jnp.arange(rows, dtype=jnp.int32) < group  # [rows]
    q_pieces = [  # [rows, width] each: the channels of a key piece
        plgpu.load(_piece_view(q_ref, pc, rows), mask=row_ok[:, None], other=0) for pc in key_pieces
    ]
    key_groups = key_pieces[-1].group + 1
    q_sums = [jnp.zeros((rows,), jnp.float32) for _ in range(key_groups)]  # [rows] per key group: qsum[G]
    for pc, qp in zip(key_pieces, q_pieces, strict=True):
        q_sums[pc.group] = q_sums[pc.group] + qp.astype(jnp.float32).sum(axis=1)
    offsets = jnp.arange(block_size, dtype=jnp.int32)  # [block]

    def params_of(ref, g, block, live, valid=None):  # [block] float32: a group's scale or low per slot
        x = plgpu.load(ref.at[layer, jnp.int32(g), block], mask=live, other=0)  # [block]
        x = stored_as(x, dtype).astype(jnp.float32)  # a cache kept as bits (`holds_bits_of`)
        return x if valid is None else jnp.where(valid, x, 0.0)

    def bytes_of(ref, pc: Piece, block, live):  # [block, width] uint8
        return plgpu.load(ref.at[layer, block, pl.ds(pc.byte_start, pc.width)], mask=live[:, None], other=0)

    def body(i, carry):
        accs, m, l = carry  # [rows, width] per value piece, [rows], [rows]
        slots = i * block_size + offsets  # [block]
        live = slots < length  # slots at or past `length` are never loaded
        block = pl.ds(i * block_size, block_size)
        p_slot = plgpu.load(pos_ref.at[layer, block], mask=live, other=-1)  # [block]
        valid = live & (p_slot >= 0)

        s = jnp.zeros((rows, block_size), jnp.float32)  # [rows, block]
        for g in range(key_groups):
            members = [(pc, qp) for pc, qp in zip(key_pieces, q_pieces, strict=True) if pc.group == g]
            byte_block = bytes_of(k_codes_ref, members[0][0], block, live)  # [block, width]: both nibble pieces'
            group_dot = functools.reduce(operator.add, (  # [rows, block]: q_G . code_j,G, one dot per piece
                lax.dot_general(qp, codes_of(byte_block, pc).astype(dtype), (((1,), (1,)), ((), ())),
                                precision=precision, preferred_element_type=jnp.float32)
                for pc, qp in members
            ))
            k_scale = params_of(k_scale_ref, g, block, live)  # [block]
            k_low = params_of(k_low_ref, g, block, live)  # [block]
            s = s + group_dot * k_scale[None, :] + q_sums[g][:, None] * k_low[None, :]
        s = jnp.where(valid[None, :], s * scale, -jnp.inf)  # [rows, block]
        m_new = jnp.maximum(m, s.max(axis=1))  # [rows]
        correction = jnp.exp(m - m_new)  # [rows]
        p = jnp.exp(s - m_new[:, None])  # [rows, block]; exactly 0 on invalid slots
        l_new = l * correction + p.sum(axis=1)

        new_accs = []
        loaded = {}
        for pc, acc in zip(value_pieces, accs, strict=True):
            if pc.group not in loaded:
                v_scale = params_of(v_scale_ref, pc.group, block, live, valid)  # [block], 0 where invalid
                v_low = params_of(v_low_ref, pc.group, block, live, valid)  # [block]
                weighted = (p * v_scale[None, :]).astype(dtype)  # [rows, block]: p_j scale_j[G]
                low_term = (p * v_low[None, :]).sum(axis=1)  # [rows]: sum_j p_j low_j[G]
                loaded[pc.group] = (bytes_of(v_codes_ref, pc, block, live), weighted, low_term)
            byte_block, weighted, low_term = loaded[pc.group]
            codes = codes_of(byte_block, pc).astype(dtype)  # [block, width]
            pv = lax.dot_general(weighted, codes, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)  # [rows, width]
            new_accs.append(acc * correction[:, None] + pv + low_term[:, None])
        return tuple(new_accs), m_new, l_new

    init = (
        tuple(jnp.zeros((rows, pc.width), jnp.float32) for pc in value_pieces),
        jnp.full((rows,), _NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    accs, m, l = lax.fori_loop(first, stop, body, init)
    for pc, acc in zip(value_pieces, accs, strict=True):  # each piece back to its channels (strided at 4 bits)
        plgpu.store(_piece_view(o_ref, pc, rows), acc, mask=row_ok[:, None])
    plgpu.store(m_ref.at[pl.ds(0, rows)], m, mask=row_ok)
    plgpu.store(l_ref.at[pl.ds(0, rows)], l, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("params", "scale", "interpret", "key_bits", "value_bits"))
def _quant_pallas(q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos, length, layer, *, params, scale,
                  interpret, key_bits, value_bits):
    batch, kv_heads, group, head_dim = q.shape
    cache = (k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos)
    if layer is None:  # one layer: a stack of 1 (free reshapes)
        cache, layer = tuple(x[None] for x in cache), 0
    k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos = cache
    layers, capacity = pos.shape[0], pos.shape[3]
    rows = max(_MIN_ROWS, next_power_of_2(group))
    num_splits = params.num_splits
    lengths = jnp.asarray(length).astype(jnp.int32).reshape(-1)  # [1] or [batch]; clipped in the kernel
    layer = jnp.asarray(layer).astype(jnp.int32).reshape(1)  # [1]
    key_pieces = pieces(head_dim, key_bits, head_dim // k_scale.shape[-2])
    value_pieces = pieces(head_dim, value_bits, head_dim // v_scale.shape[-2])

    def whole(x):  # the (row, kv head) pair's slots of every layer: [layers, capacity(, last)]
        tail = x.shape[4:]
        return pl.BlockSpec((layers, None, None, capacity, *tail), lambda b, h, s: (0, b, h, 0) + (0,) * len(tail))

    in_specs = [
        pl.BlockSpec((lengths.shape[0],), lambda b, h, s: (0,)),
        pl.BlockSpec((1,), lambda b, h, s: (0,)),
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
        *(whole(x) for x in (k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos)),
    ]
    out_shape = [  # per split: the unnormalized accumulator, the running max and the running sum
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
    ]
    kernel = functools.partial(_quant_kernel, group=group, params=params, scale=scale, key_pieces=key_pieces,
                               value_pieces=value_pieces)
    o_s, m_s, l_s = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(params.num_warps, params.num_stages),
        interpret=interpret,
        name=f"vase_quant_decode_k{key_bits}v{value_bits}",
    )(lengths, layer, q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos.astype(jnp.int32))
    if num_splits == 1:
        return o_s[:, :, 0], m_s[:, :, 0], l_s[:, :, 0]  # dropping the split axis: free reshapes
    return merge_splits(o_s, m_s, l_s, group=group, rows=rows, interpret=interpret)


def quant_decode_partials(
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
    interpret: bool = False,
    scale: float | None = None,
    device_kind: str | None = None,
    **unused,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online-softmax partials of q over a quantized cache segment (Pallas, Triton lowering; module docstring).

    Args:
      q: [batch, kv_heads, group, head_dim] (bfloat16 or float32), one query token per row, the GQA group.
      k_codes, v_codes: [batch, kv_heads, slots, head_dim * bits / 8] uint8, the packed codes
        (`vase_jax.kvquant.pack`) at `key_bits` / `value_bits` (8 or 4, static).
      k_scale, k_low, v_scale, v_low: group-major [batch, kv_heads, head_dim / group_size, slots] in a float dtype
        (or the bits of q's 16-bit dtype as uint16; `vase_jax.kvquant.slots_last`); x_hat = code * scale + low per
        group. The group sizes are head_dim / scale.shape[-2] (a power of two, at least 16 channels at 8 bits and
        32 at 4 bits).
      pos: [batch, kv_heads, slots] int32, -1 marks an empty slot.
      length: int32, slots in use: a scalar for every row or [batch] one per row; a row's slots >= its length are
        never read.
      layer: with a stacked segment (every array above but q with a leading layers axis), the layer to attend over
        (int32 scalar, may be traced), read straight from the stack.
      block_size, num_splits, num_warps, num_stages, device_kind: launch parameters as in `decode_attention`
        (`decode_tuning`); the splits are merged inside.
      interpret: run through the Pallas interpreter (CPU tests).
      scale: logit scale, default head_dim ** -0.5.
      unused: kernel parameters of the other platforms, ignored.

    Returns:
      (acc [batch, kv_heads, group, head_dim], m [batch, kv_heads, group], l [batch, kv_heads, group]) float32,
      unnormalized; acc = 0, l = 0, m = -1e30 where no slot is valid.
    """
    del unused
    check_quant_args(q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos, length, key_bits=key_bits,
                     value_bits=value_bits, layer=layer, min_piece=_MIN_PIECE)
    if block_size is not None and block_size < _MIN_PIECE:
        raise ValueError(f"block_size={block_size} must be a power of two >= {_MIN_PIECE}")
    params = _launch(q, pos.shape[-1], device_kind, block_size, num_splits, num_warps, num_stages)
    return _quant_pallas(q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos, length, layer, params=params,
                         scale=_scale(scale, q.shape[3]), interpret=bool(interpret), key_bits=key_bits,
                         value_bits=value_bits)


__all__ = ["DEFAULT_BLOCK_SIZE", "QUANT_BITS", "check_quant_args", "pieces", "quant_decode_partials"]
