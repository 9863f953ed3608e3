"""Decode attention for TPU: a Pallas (Mosaic TPU) kernel, the twin of the Triton kernel in `decode_attention.py`.

Same math and the same reference (`decode_attention_reference`): for row b, kv head h and group member g,

    s_j = scale * q[b,h,g] . k[b,h,j]     for the valid slots j: j < length[b] and pos[b,h,j] >= 0
    out = sum_j softmax(s)_j v[b,h,j]     float32 accumulation, cast back to q's dtype
    out = 0                               when no slot of the row is valid (never NaN)

Layout for the TPU's (8, 128) vector tiles: head_dim (128 for every Qwen3) is the lane axis of q, K and V; the
slot axis is cut into blocks of `block_size` slots (a multiple of 128, so that a block of `pos` and a row of
logits fill whole lanes). The GQA group of one kv head forms the sublane axis of the query tile (padded to 8
rows in float32, 16 in bfloat16: a bf16 tile packs two rows per sublane), so K and V are read once per kv head.

Grid (batch, kv_heads, blocks): the block axis is the online-softmax reduction ("arbitrary"), the others are
independent ("parallel", split across the TensorCores of a megacore chip). The pipeline fetches block
min(i, last) where last = ceil(length[b] / block_size) - 1 is row b's last block holding a slot < length[b];
Pallas' TPU pipeline issues no copy when a block index repeats, so the grid steps past a row's own length
neither read memory nor compute (`pl.when`). `length` is a scalar for every row or [batch] one per row (a scalar
is broadcast to every row, so both give identical results); the per-row lengths and `layer` (for a cache stacked
over layers) reach the index maps as one scalar-prefetch array (SMEM, [batch + 1] int32).

Per step, with running max m, sum l and accumulator acc in VMEM scratch (m and l replicated over 128 lanes):

    s = scale * q k^T                     [rows, block], float32 (MXU, fp32 accumulation)
    s = -inf where slot >= length or pos < 0
    m' = max(m, max_j s),  alpha = exp(m - m'),  p = exp(s - m')
    l  = alpha l + sum_j p,  acc = alpha acc + p V,  m = m'
    out = acc / l  (0 where l = 0)        at the last grid step

V rows at slots >= length are zeroed before `p V` (0 * NaN would be NaN): garbage or NaN past `length` never
leaks. Like the Triton kernel, slots < length with pos < 0 contribute p = 0, so they must hold finite values
(the cache initializes them to zero).

`interpret` takes `pltpu.InterpretParams()` to run the kernel on CPU with TPU semantics (tests), or True for
the generic Pallas interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.decode_attention import check_decode_args, row_lengths, stored_as
from pallas_kernels.tpu_common import LANES, dot_precision, lanes_to, sublane_multiple

DEFAULT_BLOCK_SIZE_TPU = 1024  # 2 x 256 KiB of bf16 K and V per grid step: amortizes the ~0.35 us cost of a step
_NEG = -1e30  # finite start for running maxima: exp(m_old - m_new) never sees inf - inf


def _check_args(q, k, v, pos, length, block_size: int, layer=None) -> None:
    """The decode kernels' shape and dtype checks, plus the TPU kernel's block size (a multiple of the lanes)."""
    check_decode_args(q, k, v, pos, length, 1, None, layer)
    if block_size < LANES or block_size % LANES:
        raise ValueError(f"block_size={block_size} must be a multiple of {LANES} for the TPU kernel")


def _decode_kernel(
    scalars_ref,  # SMEM [batch + 1] int32 (scalar prefetch): length per row, then layer
    q_ref,  # [rows, head_dim]
    k_ref,  # [block, head_dim]
    v_ref,  # [block, head_dim]
    pos_ref,  # [1, block] int32
    *refs,
    scale: float,
    partials: bool = False,
):
    """One (row, kv head) pair's online softmax, one block per grid step. Outputs: o_ref [rows, head_dim] (the
    normalized output), or with `partials` the unnormalized acc [rows, head_dim] and m, l [rows, LANES] (float32,
    lane-replicated). Scratch: m_ref, l_ref [rows, LANES] (running max and sum, replicated over lanes), acc_ref
    [rows, head_dim] (float32)."""
    out_refs, (m_ref, l_ref, acc_ref) = refs[:-3], refs[-3:]
    i = pl.program_id(2)
    block = k_ref.shape[0]
    head_dim = k_ref.shape[1]
    length = scalars_ref[pl.program_id(0)]

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(i * block < length)
    def _step():
        q = q_ref[...]  # [rows, head_dim]
        k = stored_as(k_ref[...], q.dtype)  # [block, head_dim] (a cache kept as bits: `holds_bits_of`)
        precision = dot_precision(q.dtype)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # [rows, block]
        lane_slot = i * block + lax.broadcasted_iota(jnp.int32, (1, block), 1)  # [1, block]
        valid = (lane_slot < length) & (pos_ref[...] >= 0)  # [1, block]
        s = jnp.where(valid, s * scale, -jnp.inf)
        m_prev = m_ref[...]  # [rows, LANES]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [rows, LANES]
        alpha = jnp.exp(m_prev - m_next)  # [rows, LANES]
        p = jnp.exp(s - lanes_to(m_next, block))  # [rows, block]; exactly 0 on invalid slots
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        # zero V past `length` (the last block may hold garbage there); select in f32, then back to V's dtype
        sublane_slot = i * block + lax.broadcasted_iota(jnp.int32, (block, head_dim), 0)  # [block, head_dim]
        v = stored_as(v_ref[...], q.dtype).astype(jnp.float32)
        v = jnp.where(sublane_slot < length, v, 0.0).astype(q.dtype)
        pv = lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # [rows, head_dim]
        acc_ref[...] = lanes_to(alpha, head_dim) * acc_ref[...] + pv

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish():
        if partials:
            acc_out_ref, m_out_ref, l_out_ref = out_refs
            acc_out_ref[...] = acc_ref[...]
            m_out_ref[...] = m_ref[...]
            l_out_ref[...] = l_ref[...]
            return
        (o_ref,) = out_refs
        l = lanes_to(l_ref[...], head_dim)  # [rows, head_dim]
        out = jnp.where(l > 0.0, acc_ref[...] / jnp.where(l > 0.0, l, 1.0), 0.0)
        o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "interpret", "partials"))
def _decode_tpu(q, k, v, pos, length, layer, *, block_size, scale, interpret, partials=False):
    batch, kv_heads, group, head_dim = q.shape
    if layer is None:  # one layer: a stack of 1 (free reshapes)
        k, v, pos, layer = k[None], v[None], pos[None], 0
    layers, capacity = k.shape[0], k.shape[3]
    block = capacity if capacity <= block_size else block_size  # a whole small cache is one (full-dim) block
    num_blocks = pl.cdiv(capacity, block)
    rows = sublane_multiple(group, q.dtype)
    q_rows = jnp.pad(q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))  # [batch, kv_heads, rows, head_dim]
    pos5 = pos.astype(jnp.int32).reshape(layers, batch, kv_heads, 1, capacity)  # [layers, batch, kv_heads, 1, cap]
    scalars = jnp.concatenate(
        [row_lengths(length, batch, capacity), jnp.asarray(layer, jnp.int32).reshape(1)]
    )  # [batch + 1]: length per row, layer

    def kv_index(b, h, i, scalars_ref):
        last = jnp.maximum(lax.div(scalars_ref[b] + (block - 1), block) - 1, 0)  # row b's last block in use
        return scalars_ref[batch], b, h, jnp.minimum(i, last), 0

    def pos_index(b, h, i, scalars_ref):
        layer, b, h, j, _ = kv_index(b, h, i, scalars_ref)
        return layer, b, h, 0, j

    out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, i, n: (b, h, 0, 0))
    out_shape = jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), q.dtype)
    if partials:  # acc [batch, kv_heads, rows, head_dim], m and l [batch, kv_heads, rows, LANES] (lane-replicated)
        out_specs = [out_specs, *[pl.BlockSpec((None, None, rows, LANES), lambda b, h, i, n: (b, h, 0, 0))] * 2]
        out_shape = [jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), jnp.float32),
                     *[jax.ShapeDtypeStruct((batch, kv_heads, rows, LANES), jnp.float32)] * 2]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, kv_heads, num_blocks),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, i, n: (b, h, 0, 0)),
            pl.BlockSpec((None, None, None, block, head_dim), kv_index),
            pl.BlockSpec((None, None, None, block, head_dim), kv_index),
            pl.BlockSpec((None, None, None, 1, block), pos_index),
        ],
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, LANES), jnp.float32),
            pltpu.VMEM((rows, head_dim), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale, partials=partials),
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="vase_decode_attention_tpu" + ("_partials" if partials else ""),
    )(scalars, q_rows, k, v, pos5)
    if partials:
        acc, m, l = out
        return acc[:, :, :group], m[:, :, :group, 0], l[:, :, :group, 0]
    return out[:, :, :group]


def decode_attention_tpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    length: jax.Array | int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE_TPU,
    scale: float | None = None,
    interpret=False,
    layer: jax.Array | int | None = None,
    **unused,
) -> jax.Array:
    """Decode attention with the Pallas TPU kernel (module docstring); same result as `decode_attention_reference`.

    Args:
      q: [batch, kv_heads, group, head_dim], one query token per row, the GQA group of each kv head.
      k, v: [batch, kv_heads, capacity, head_dim], same dtype as q (bfloat16 or float32), or for a 16-bit q
        its bits as uint16 (`holds_bits_of`).
      pos: [batch, kv_heads, capacity] int32, -1 marks an empty slot.
      length: int32, slots in use: a scalar for every row or [batch] one per row; no block past a row's own
        length is read.
      block_size: slots per grid step, a multiple of 128 (a cache of at most `block_size` slots is one block).
      scale: logit scale, default head_dim ** -0.5.
      interpret: False (compiled for TPU), `pltpu.InterpretParams()` (TPU interpret mode on CPU) or True.
      layer: with a stacked cache (k, v [layers, batch, kv_heads, capacity, head_dim], pos [layers, batch,
        kv_heads, capacity]), the layer to attend over (int32 scalar, may be traced). It reaches the index maps
        as a scalar-prefetch argument, so the pipeline copies that layer's blocks straight from the stack.
      unused: kernel parameters of the other platforms (`num_splits`, `num_warps`, ...), ignored.

    Returns:
      [batch, kv_heads, group, head_dim] in q's dtype; 0 for rows without a valid slot.
    """
    del unused
    _check_args(q, k, v, pos, length, block_size, layer)
    head_dim = q.shape[3]
    scale = float(head_dim**-0.5 if scale is None else scale)
    return _decode_tpu(q, k, v, pos, length, layer, block_size=block_size, scale=scale, interpret=interpret)


def decode_attention_partials_tpu(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    length: jax.Array | int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE_TPU,
    scale: float | None = None,
    interpret=False,
    layer: jax.Array | int | None = None,
    **unused,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`decode_attention_tpu`'s kernel (same arguments) returning the unnormalized partials instead of the output:

        m = max_j s_j,   l = sum_j e^{s_j - m},   acc = sum_j e^{s_j - m} v_j      over the valid slots j

    acc [batch, kv_heads, group, head_dim], m and l [batch, kv_heads, group], float32; a (row, kv head) without a
    valid slot has acc = 0, l = 0, m = -1e30 (as `decode_attention_partials_reference`), for a cache held in
    several segments merged by log-sum-exp (`vase_jax.quant_attention.merge`)."""
    del unused
    _check_args(q, k, v, pos, length, block_size, layer)
    head_dim = q.shape[3]
    scale = float(head_dim**-0.5 if scale is None else scale)
    return _decode_tpu(q, k, v, pos, length, layer, block_size=block_size, scale=scale, interpret=interpret,
                       partials=True)
