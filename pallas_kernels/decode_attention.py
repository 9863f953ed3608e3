"""Decode attention over the fixed-size KV cache: a Pallas (Triton) flash-decoding kernel and a pure-JAX twin.

One new query token per row attends over the cache slots in use. For row b, kv head h and group member g:

    s_j = scale * q[b,h,g] . k[b,h,j]     for the valid slots j: j < length and pos[b,h,j] >= 0
                                          (and block_mask[b,h,j // block_size] when a block mask is given)
    out = sum_j softmax(s)_j v[b,h,j]     float32 accumulation, cast back to q's dtype
    out = 0                               when no slot of the row is valid (never NaN)

All query heads of a kv head (the GQA group) are processed together, so K and V are read once per kv head.

Kernel (flash-decoding): the grid is (batch, kv_heads, num_splits). The blocks that hold slots < length are
dealt evenly to the splits; each split runs an online softmax over its blocks (a loop whose trip count depends
on `length`, so blocks past `length` are never loaded, and loads inside the last block are masked) and writes
its unnormalized accumulator `o_s`, running max `m_s` and sum `l_s`. The combine step (plain JAX) is

    M = max_s m_s,   w_s = exp(m_s - M),   out = sum_s w_s o_s / sum_s w_s l_s.

Reference: the same online softmax as a `lax.while_loop` over blocks of `block_size` that stops at
ceil(length / block_size); each step `dynamic_slice`s one block, so its cost follows `length`, not the
capacity, and it never copies the cache. It is the production path on CPU.

Stacked caches: with `layer`, k, v and pos carry a leading layers axis and the kernel reads layer `layer`'s
blocks straight from the stack (one indexer per load: `k_ref.at[layer, block, :]`), so a `lax.scan` over layers
never copies a layer out. `decode_attention_tpu.py` is the TPU twin.

SeerAttention-R hook: `block_mask [batch, kv_heads, ceil(capacity / block_size)]` bool switches whole blocks
off. In the kernel a switched-off block issues no memory reads (its loads are masked out).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import is_power_of_2, next_power_of_2, triton_params

DEFAULT_BLOCK_SIZE = 64
DEFAULT_NUM_SPLITS = 16
_NEG = -1e30  # finite start for running maxima: exp(m_old - m_new) never sees inf - inf
_MIN_ROWS = 16  # Triton's tensor-core dot wants M, N, K >= 16: the GQA group is padded to this many rows


# ------------------------------------------------------------------------------------------------------------
# argument checks (shapes are static, so these raise at trace time with a clear message)
# ------------------------------------------------------------------------------------------------------------
def _check_args(q, k, v, pos, length, block_size: int, block_mask, layer=None) -> None:
    """Shape and dtype checks; with `layer`, k, v and pos are stacked over layers and one layer is checked."""
    if layer is not None:
        k, v, pos = (jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in (k, v, pos))
    if q.ndim != 4:
        raise ValueError(f"q has shape {q.shape}; expected [batch, kv_heads, group, head_dim]")
    batch, kv_heads, _, head_dim = q.shape
    if k.ndim != 4 or k.shape[:2] != (batch, kv_heads) or k.shape[3] != head_dim:
        raise ValueError(
            f"k has shape {k.shape}; expected [{batch}, {kv_heads}, capacity, {head_dim}] to match q"
        )
    if v.shape != k.shape:
        raise ValueError(f"v has shape {v.shape}; expected the shape of k, {k.shape}")
    if pos.shape != k.shape[:3]:
        raise ValueError(f"pos has shape {pos.shape}; expected [batch, kv_heads, capacity] = {k.shape[:3]}")
    if not jnp.issubdtype(pos.dtype, jnp.integer):
        raise ValueError(f"pos has dtype {pos.dtype}; expected an integer dtype (int32)")
    if jnp.ndim(length) != 0:
        raise ValueError(f"length has shape {jnp.shape(length)}; expected a scalar")
    if k.dtype != v.dtype or not (k.dtype == q.dtype or holds_bits_of(k.dtype, q.dtype)):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; expected one dtype (k and v "
                         f"may also hold the bits of a 16-bit q dtype as uint16)")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    if block_mask is not None:
        expected = (batch, kv_heads, pl.cdiv(k.shape[2], block_size))
        if block_mask.shape != expected:
            raise ValueError(
                f"block_mask has shape {block_mask.shape}; expected"
                f" [batch, kv_heads, ceil(capacity / block_size)] = {expected}"
            )
        if block_mask.dtype != jnp.bool_:
            raise ValueError(f"block_mask has dtype {block_mask.dtype}; expected bool")


def holds_bits_of(stored, dtype) -> bool:
    """Whether arrays of dtype `stored` hold the bits of a 16-bit float `dtype` (uint16 for bfloat16 / float16).

    vase_jax keeps 16-bit caches as such bits on CPU, where XLA has no bfloat16 dynamic-update-slice (every write
    would convert the whole cache); every decode implementation reads them back with `stored_as`."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(stored) == jnp.uint16 and dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)


def stored_as(x: jax.Array, dtype) -> jax.Array:
    """`x` read as `dtype`: the identity, or a same-width bitcast when x holds `dtype`'s bits (`holds_bits_of`)."""
    return x if x.dtype == jnp.dtype(dtype) else lax.bitcast_convert_type(x, dtype)


def _scale(scale: float | None, head_dim: int) -> float:
    return float(head_dim**-0.5 if scale is None else scale)


def _dot_precision(dtype) -> lax.Precision:
    # float32 inputs: full IEEE float32 (Triton and XLA:GPU would otherwise use TF32). bf16: native.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


# ------------------------------------------------------------------------------------------------------------
# Pallas kernel
# ------------------------------------------------------------------------------------------------------------
def _decode_kernel(
    scalars_ref,  # [2] int32: length, layer
    q_ref,  # [rows, head_dim], the GQA group padded to `rows`
    k_ref,  # [layers, capacity, head_dim] (layers = 1 for an unstacked cache)
    v_ref,  # [layers, capacity, head_dim]
    pos_ref,  # [layers, capacity] int32
    *refs,
    block_size: int,
    num_splits: int,
    scale: float,
    has_block_mask: bool,
):
    if has_block_mask:
        block_mask_ref, o_ref, m_ref, l_ref = refs  # block_mask_ref: [num_blocks] int32
    else:
        block_mask_ref = None
        o_ref, m_ref, l_ref = refs  # o_ref: [rows, head_dim] f32; m_ref, l_ref: [rows] f32
    split = pl.program_id(2)
    length = scalars_ref[0]
    layer = scalars_ref[1]
    used_blocks = lax.div(length + (block_size - 1), block_size)  # blocks holding slots < length
    per_split = lax.div(used_blocks + (num_splits - 1), num_splits)
    first = split * per_split
    stop = jnp.minimum(first + per_split, used_blocks)

    q = q_ref[...]  # [rows, head_dim]
    rows, head_dim = q.shape
    precision = _dot_precision(q.dtype)
    offsets = jnp.arange(block_size, dtype=jnp.int32)  # [block]

    def body(i, carry):
        acc, m, l = carry  # [rows, head_dim], [rows], [rows]
        slots = i * block_size + offsets  # [block]
        live = slots < length  # slots at or past `length` are never loaded
        if block_mask_ref is not None:
            live = live & (block_mask_ref[i] != 0)
        block = pl.ds(i * block_size, block_size)
        # one indexer per load (the Triton lowering takes no chained `.at`): layer, slots, head_dim
        k = plgpu.load(k_ref.at[layer, block, :], mask=live[:, None], other=0)  # [block, head_dim]
        v = plgpu.load(v_ref.at[layer, block, :], mask=live[:, None], other=0)  # [block, head_dim]
        k, v = stored_as(k, q.dtype), stored_as(v, q.dtype)  # a cache kept as bits (`holds_bits_of`)
        p_slot = plgpu.load(pos_ref.at[layer, block], mask=live, other=-1)  # [block]
        valid = live & (p_slot >= 0)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = jnp.where(valid[None, :], s * scale, -jnp.inf)  # [rows, block]
        m_new = jnp.maximum(m, s.max(axis=1))  # [rows]
        correction = jnp.exp(m - m_new)  # [rows]
        p = jnp.exp(s - m_new[:, None])  # [rows, block]; exactly 0 on invalid slots
        l_new = l * correction + p.sum(axis=1)
        pv = lax.dot_general(
            p.astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )  # [rows, head_dim]
        return acc * correction[:, None] + pv, m_new, l_new

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), _NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, m, l = lax.fori_loop(first, stop, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit, static_argnames=("block_size", "num_splits", "scale", "num_warps", "num_stages", "interpret")
)
def _decode_pallas(
    q, k, v, pos, length, block_mask, layer, *, block_size, num_splits, scale, num_warps, num_stages, interpret
):
    batch, kv_heads, group, head_dim = q.shape
    if layer is None:  # one layer: a stack of 1 (free reshapes)
        k, v, pos, layer = k[None], v[None], pos[None], 0
    layers, capacity = k.shape[0], k.shape[3]
    rows = max(_MIN_ROWS, next_power_of_2(group))
    q_rows = jnp.pad(q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))  # [batch, kv_heads, rows, head_dim]
    scalars = jnp.stack(
        [jnp.clip(jnp.asarray(length, jnp.int32), 0, capacity), jnp.asarray(layer, jnp.int32)]
    )  # [2]: length, layer
    has_block_mask = block_mask is not None

    in_specs = [
        pl.BlockSpec((2,), lambda b, h, s: (0,)),
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
        pl.BlockSpec((layers, None, None, capacity, head_dim), lambda b, h, s: (0, b, h, 0, 0)),
        pl.BlockSpec((layers, None, None, capacity, head_dim), lambda b, h, s: (0, b, h, 0, 0)),
        pl.BlockSpec((layers, None, None, capacity), lambda b, h, s: (0, b, h, 0)),
    ]
    args = [scalars, q_rows, k, v, pos.astype(jnp.int32)]
    if has_block_mask:
        num_blocks = block_mask.shape[2]
        in_specs.append(pl.BlockSpec((None, None, num_blocks), lambda b, h, s: (b, h, 0)))
        args.append(block_mask.astype(jnp.int32))  # [batch, kv_heads, num_blocks]
    # per split: the unnormalized accumulator o_s, the running max m_s and the running sum l_s
    out_shape = [
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
    ]
    kernel = functools.partial(
        _decode_kernel,
        block_size=block_size,
        num_splits=num_splits,
        scale=scale,
        has_block_mask=has_block_mask,
    )
    o_s, m_s, l_s = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="vase_decode_attention",
    )(*args)

    # combine the splits: [batch, kv_heads, splits, rows(, head_dim)] -> [batch, kv_heads, rows(, head_dim)]
    m_max = m_s.max(axis=2, keepdims=True)
    w = jnp.exp(m_s - m_max)  # [batch, kv_heads, splits, rows]; 0 for splits that saw no valid slot
    l_tot = (w * l_s).sum(axis=2)  # [batch, kv_heads, rows]
    o_tot = (w[..., None] * o_s).sum(axis=2)  # [batch, kv_heads, rows, head_dim]
    out = jnp.where(l_tot[..., None] > 0, o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None], 0.0)
    return out[:, :, :group].astype(q.dtype)


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    length: jax.Array | int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_splits: int = DEFAULT_NUM_SPLITS,
    interpret: bool = False,
    scale: float | None = None,
    block_mask: jax.Array | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    layer: jax.Array | int | None = None,
    **unused,
) -> jax.Array:
    """Flash-decoding attention (Pallas, Triton lowering); see the module docstring for the math.

    Args:
      q: [batch, kv_heads, group, head_dim], one query token per row, the GQA group of each kv head.
      k, v: [batch, kv_heads, capacity, head_dim], same dtype as q (bfloat16 or float32), or for a 16-bit q
        its bits as uint16 (`holds_bits_of`).
      pos: [batch, kv_heads, capacity] int32, -1 marks an empty slot.
      length: int32 scalar, slots in use (shared by all rows); slots >= length are never read.
      block_size: slots per step of the loop; a power of two >= 16. Also the granularity of `block_mask`.
      num_splits: parallel chunks of the used blocks per (row, kv head); clipped to the number of blocks.
      interpret: run through the Pallas interpreter (CPU tests).
      scale: logit scale, default head_dim ** -0.5.
      block_mask: optional [batch, kv_heads, ceil(capacity / block_size)] bool; False blocks are skipped.
      num_warps, num_stages: Triton compiler parameters.
      layer: with a stacked cache (k, v [layers, batch, kv_heads, capacity, head_dim], pos [layers, batch,
        kv_heads, capacity]), the layer to attend over (int32 scalar, may be traced); the kernel reads its
        blocks straight from the stack, so the layer is never copied out.
      unused: kernel parameters of the other platforms, ignored.

    Returns:
      [batch, kv_heads, group, head_dim] in q's dtype; 0 for rows without a valid slot.
    """
    del unused
    _check_args(q, k, v, pos, length, block_size, block_mask, layer)
    head_dim = q.shape[3]
    if not is_power_of_2(block_size) or block_size < 16:
        raise ValueError(f"block_size={block_size} must be a power of two >= 16 for the Pallas kernel")
    if not is_power_of_2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 for the Pallas kernel")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    num_splits = min(num_splits, pl.cdiv(k.shape[-2], block_size))
    return _decode_pallas(
        q,
        k,
        v,
        pos,
        length,
        block_mask,
        layer,
        block_size=block_size,
        num_splits=num_splits,
        scale=_scale(scale, head_dim),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=bool(interpret),
    )


# ------------------------------------------------------------------------------------------------------------
# pure-JAX reference (the CPU production path)
# ------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("block_size", "scale"))
def _decode_reference(q, k, v, pos, length, block_mask, layer=None, *, block_size, scale):
    batch, kv_heads, group, head_dim = q.shape
    capacity = k.shape[-2]

    def block_of(x, start, block):  # slots [start, start + block) of x (of layer `layer` when x is stacked)
        if layer is None:
            return lax.dynamic_slice_in_dim(x, start, block, axis=2)
        starts = (layer, 0, 0, start) + (0,) * (x.ndim - 4)
        return lax.dynamic_slice(x, starts, (1, *x.shape[1:3], block, *x.shape[4:]))[0]

    block = min(block_size, capacity)
    length = jnp.clip(jnp.asarray(length, jnp.int32), 0, capacity)
    used_blocks = (length + block - 1) // block
    qf = q.astype(jnp.float32) * scale  # [batch, kv_heads, group, head_dim]
    offsets = jnp.arange(block, dtype=jnp.int32)  # [block]

    def update(i, carry):
        acc, m, l = carry  # [batch, kv_heads, group(, head_dim)]
        # The last block may be shifted back so that it fits the capacity; its slots before i * block were
        # already counted and are masked out.
        start = jnp.minimum(i * block, capacity - block)
        slots = start + offsets  # [block]
        k_blk = stored_as(block_of(k, start, block), q.dtype).astype(jnp.float32)  # [batch, kv_heads, block, hd]
        v_blk = stored_as(block_of(v, start, block), q.dtype).astype(jnp.float32)  # [batch, kv_heads, block, hd]
        p_blk = block_of(pos, start, block)  # [batch, kv_heads, block]
        valid = (p_blk >= 0) & ((slots >= i * block) & (slots < length))[None, None, :]
        if block_mask is not None:
            valid = valid & lax.dynamic_index_in_dim(block_mask, i, axis=2, keepdims=True)
        s = jnp.einsum("bhgd,bhsd->bhgs", qf, k_blk, precision=lax.Precision.HIGHEST)
        s = jnp.where(valid[:, :, None, :], s, -jnp.inf)  # [batch, kv_heads, group, block]
        m_new = jnp.maximum(m, s.max(axis=-1))  # [batch, kv_heads, group]
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])  # exactly 0 on invalid slots
        v_blk = jnp.where(valid[..., None], v_blk, 0.0)  # garbage (even NaN) in masked slots must not leak
        pv = jnp.einsum("bhgs,bhsd->bhgd", p, v_blk, precision=lax.Precision.HIGHEST)
        return acc * correction[..., None] + pv, m_new, l * correction + p.sum(axis=-1)

    def body(state):
        i, carry = state
        # The cond is always taken (i < used_blocks inside the loop). It keeps XLA:CPU from converting the
        # whole bf16 cache to float32 on every call: XLA:CPU has no bf16 dynamic-slice, so it converts the
        # sliced operand, and without the cond that convert is loop-invariant and is hoisted out of the loop,
        # over the full cache. Inside the cond it fuses into the slice and converts one block.
        carry = lax.cond(i < used_blocks, functools.partial(update, i), lambda c: c, carry)
        return i + 1, carry

    init = (
        jnp.zeros((batch, kv_heads, group, head_dim), jnp.float32),
        jnp.full((batch, kv_heads, group), _NEG, jnp.float32),
        jnp.zeros((batch, kv_heads, group), jnp.float32),
    )
    _, (acc, _, l) = lax.while_loop(
        lambda state: state[0] < used_blocks, body, (jnp.zeros((), jnp.int32), init)
    )
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.astype(q.dtype)


def decode_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    length: jax.Array | int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: float | None = None,
    block_mask: jax.Array | None = None,
    layer: jax.Array | int | None = None,
    **unused,
) -> jax.Array:
    """Pure-JAX twin of `decode_attention` (same arguments; kernel-only ones like `num_splits` are ignored).

    A `lax.while_loop` over blocks of `block_size` slots that stops after ceil(length / block_size) blocks,
    with an online softmax in float32. Any block size >= 1 works here (the kernel needs a power of two).

    `layer`: with a stacked cache (k, v `[layers, batch, kv_heads, capacity, head_dim]`, pos `[layers, batch,
    kv_heads, capacity]`), attend over that layer: each block is sliced straight from the stack, so the layer is
    never copied out (a traced index works, as inside a `lax.scan` over layers).
    """
    del unused
    _check_args(q, k, v, pos, length, block_size, block_mask, layer)
    return _decode_reference(
        q, k, v, pos, length, block_mask, layer, block_size=block_size, scale=_scale(scale, q.shape[3])
    )
