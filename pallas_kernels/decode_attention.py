"""Decode attention over the fixed-size KV cache: a Pallas (Triton) flash-decoding kernel and a pure-JAX twin.

One new query token per row attends over the cache slots in use. For row b, kv head h and group member g:

    s_j = scale * q[b,h,g] . k[b,h,j]     for the valid slots j: j < length[b] and pos[b,h,j] >= 0
                                          (and block_mask[b,h,j // block_size] when a block mask is given)
    out = sum_j softmax(s)_j v[b,h,j]     float32 accumulation, cast back to q's dtype
    out = 0                               when no slot of the row is valid (never NaN)

`length` is one count for every row (a scalar) or one per row ([batch]); a scalar acts as that count for every
row, so both give identical results. All query heads of a kv head (the GQA group) are processed together, so K
and V are read once per kv head.

Kernel (flash-decoding): the grid is (batch, kv_heads, num_splits). A (row, kv head) program pair's used blocks,
`used = ceil(length[b] / block_size)`, are dealt to `active = clip(used // min_blocks_per_split, 1, num_splits)`
splits, split s taking blocks [s * used // active, (s + 1) * used // active) (sizes differ by at most one; the
splits past `active` are empty), so each program loops over its own row's blocks only, never past its length.
Each split runs an online softmax over its blocks (blocks past `length` are never loaded; loads inside the last
block are masked) and writes its unnormalized accumulator `o_s`, running max `m_s` and sum `l_s` for the group's
rows only (the group is padded to 16 rows for the tensor cores in registers, not in memory). A second small
kernel, grid (batch, kv_heads), merges the splits by log-sum-exp in one pass over them:

    M = max_s m_s,   w_s = exp(m_s - M),   out = sum_s w_s o_s / sum_s w_s l_s   (0 where the sum is 0)

With one split the first kernel normalizes and writes the output itself (no partials, no merge). Nothing runs
around the kernels: q is read unpadded, `length` and `layer` reach them as they are (the clip to the capacity
happens inside), so a call is one kernel launch (two with splits). `decode_tuning` picks block size, splits and
Triton parameters per device and shape.

Reference: the same online softmax as a `lax.while_loop` over blocks of `block_size` that stops at
ceil(max_b length[b] / block_size), masking each row at its own length; each step `dynamic_slice`s one block, so
its cost follows the longest row, not the capacity, and it never copies the cache. It is the production path on
CPU.

Stacked caches: with `layer`, k, v and pos carry a leading layers axis and the kernel reads layer `layer`'s
blocks straight from the stack (one indexer per load: `k_ref.at[layer, block, :]`), so a `lax.scan` over layers
never copies a layer out. `decode_attention_tpu.py` is the TPU twin.

SeerAttention-R hook: `block_mask [batch, kv_heads, ceil(capacity / block_size)]` bool switches whole blocks
off. In the kernel a switched-off block issues no memory reads (its loads are masked out). With a block mask the
block size is `DEFAULT_BLOCK_SIZE` unless given (the mask's granularity), whatever the tuning table says.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode_tuning import DecodeParams, decode_params
from pallas_kernels.dispatch import is_power_of_2, next_power_of_2, pairwise_sum, triton_params

DEFAULT_BLOCK_SIZE = 64  # the reference's block, a block mask's granularity, and the capacity alignment of vase_jax
_NEG = -1e30  # finite start for running maxima: exp(m_old - m_new) never sees inf - inf
_MIN_ROWS = 16  # Triton's tensor-core dot wants M, N, K >= 16: the GQA group is padded to this many rows
_MERGE_WARPS = 4
_MERGE_LOADS = 8  # splits whose partials the merge loads at once (8 x 16 rows x head_dim 128 float32: 64 regs/thread)


# ------------------------------------------------------------------------------------------------------------
# argument checks (shapes are static, so these raise at trace time with a clear message)
# ------------------------------------------------------------------------------------------------------------
def check_decode_args(q, k, v, pos, length, block_size: int, block_mask, layer=None) -> None:
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
    if jnp.shape(length) not in ((), (batch,)):
        raise ValueError(f"length has shape {jnp.shape(length)}; expected a scalar or [batch] = ({batch},)")
    if not jnp.issubdtype(jnp.result_type(length), jnp.integer):
        raise ValueError(f"length has dtype {jnp.result_type(length)}; expected an integer dtype (int32)")
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


def row_lengths(length, batch: int, capacity: int) -> jax.Array:
    """[batch] int32: `length` (a scalar or one per row) for every row, clipped to [0, capacity]."""
    length = jnp.clip(jnp.asarray(length).astype(jnp.int32), 0, capacity)
    return jnp.broadcast_to(length, (batch,))


def _scale(scale: float | None, head_dim: int) -> float:
    return float(head_dim**-0.5 if scale is None else scale)


def _dot_precision(dtype) -> lax.Precision:
    # float32 inputs: full IEEE float32 (Triton and XLA:GPU would otherwise use TF32). bf16: native.
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


# ------------------------------------------------------------------------------------------------------------
# Pallas kernels
# ------------------------------------------------------------------------------------------------------------
def _split_range(used, split, num_splits: int, min_blocks: int):
    """Blocks [first, stop) of split `split` among a row's `used` blocks (module docstring): the used blocks are
    dealt to `active = clip(used // min_blocks, 1, num_splits)` splits as evenly as they go; later splits get none."""
    if num_splits == 1:
        return 0, used
    active = jnp.clip(lax.div(used, min_blocks), 1, num_splits)
    first = lax.div(jnp.minimum(split, active) * used, active)
    stop = lax.div(jnp.minimum(split + 1, active) * used, active)
    return first, stop


def _decode_kernel(
    length_ref,  # [1] or [batch] int32: slots in use (one count for all rows, or one per row)
    layer_ref,  # [1] int32
    q_ref,  # [rows, head_dim]: the GQA group's `group` rows, read masked up to `rows`
    k_ref,  # [layers, capacity, head_dim] (layers = 1 for an unstacked cache)
    v_ref,  # [layers, capacity, head_dim]
    pos_ref,  # [layers, capacity] int32
    *refs,
    group: int,
    params: DecodeParams,
    scale: float,
    has_block_mask: bool,
    partials: bool = False,
):
    """One (row, kv head, split) program: online softmax over the split's blocks. With one split (and not
    `partials`) it writes the normalized output (q's dtype), else its accumulator, max and sum (float32) for the
    merge, or, with `partials` and one split, as the result."""
    block_mask_ref = refs[0] if has_block_mask else None  # [num_blocks] int32
    out_refs = refs[1:] if has_block_mask else refs
    block_size = params.block_size
    capacity = k_ref.shape[1]
    row = pl.program_id(0) if length_ref.shape[0] > 1 else 0
    length = jnp.clip(length_ref[row], 0, capacity)
    layer = layer_ref[0]
    used_blocks = lax.div(length + (block_size - 1), block_size)  # blocks holding slots < length
    first, stop = _split_range(used_blocks, pl.program_id(2), params.num_splits, params.min_blocks_per_split)

    rows, head_dim = q_ref.shape
    row_ok = jnp.arange(rows, dtype=jnp.int32) < group  # [rows]: the group's rows; the rest are padding
    q = plgpu.load(q_ref.at[pl.ds(0, rows), :], mask=row_ok[:, None], other=0)  # [rows, head_dim]
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
    if params.num_splits == 1 and not partials:
        (out_ref,) = out_refs  # [rows, head_dim] in q's dtype
        plgpu.store(out_ref.at[pl.ds(0, rows), :], _normalized(acc, l).astype(out_ref.dtype), mask=row_ok[:, None])
    else:
        o_ref, m_ref, l_ref = out_refs  # [rows, head_dim], [rows], [rows] float32
        plgpu.store(o_ref.at[pl.ds(0, rows), :], acc, mask=row_ok[:, None])
        plgpu.store(m_ref.at[pl.ds(0, rows)], m, mask=row_ok)
        plgpu.store(l_ref.at[pl.ds(0, rows)], l, mask=row_ok)


def _normalized(acc, l):
    """acc / l per row, 0 where l = 0 (a row without a valid slot). acc [rows, head_dim], l [rows]."""
    return jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)


def _merge_kernel(o_ref, m_ref, l_ref, *out_refs, group: int, num_splits: int, partials: bool = False):
    """One (row, kv head) program: the splits' partials merged by log-sum-exp in one pass (online over splits).
    o_ref [splits, rows, head_dim], m_ref, l_ref [splits, rows] float32 -> out_refs: the output [rows, head_dim]
    (acc / l), or with `partials` the merged (acc [rows, head_dim], m [rows], l [rows]) float32, unnormalized:

        M = max_s m_s,   acc = sum_s e^{m_s - M} o_s,   l = sum_s e^{m_s - M} l_s,   m = M

    Unrolled (num_splits is static and small): the partials of `_MERGE_LOADS` splits are loaded together, then
    combined, so a program waits for one memory round trip per that many splits, not per split."""
    rows, head_dim = out_refs[0].shape
    row_ok = jnp.arange(rows, dtype=jnp.int32) < group
    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), _NEG, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    for first in range(0, num_splits, _MERGE_LOADS):
        loaded = []
        for split in range(first, min(first + _MERGE_LOADS, num_splits)):
            s = jnp.int32(split)  # an array index (the interpreter's load takes no Python int)
            loaded.append((
                plgpu.load(m_ref.at[s, pl.ds(0, rows)], mask=row_ok, other=_NEG),  # [rows]
                plgpu.load(l_ref.at[s, pl.ds(0, rows)], mask=row_ok, other=0.0),  # [rows]
                plgpu.load(o_ref.at[s, pl.ds(0, rows), :], mask=row_ok[:, None], other=0.0),  # [rows, head_dim]
            ))
        for m_s, l_s, o_s in loaded:
            m_new = jnp.maximum(m, m_s)
            # weights exactly 1 for the larger max (not exp(0), which a fast exp need not return exactly) and
            # exactly 0 for an empty split (m_s = _NEG): empty splits change no bit, and one split in use gives
            # the unsplit result
            old = jnp.where(m == m_new, 1.0, jnp.exp(m - m_new))
            new = jnp.where(m_s == m_new, 1.0, jnp.exp(m_s - m_new))
            acc, m, l = acc * old[:, None] + o_s * new[:, None], m_new, l * old + l_s * new
    if partials:
        acc_ref, m_out_ref, l_out_ref = out_refs  # [rows, head_dim], [rows], [rows] float32
        plgpu.store(acc_ref.at[pl.ds(0, rows), :], acc, mask=row_ok[:, None])
        plgpu.store(m_out_ref.at[pl.ds(0, rows)], m, mask=row_ok)
        plgpu.store(l_out_ref.at[pl.ds(0, rows)], l, mask=row_ok)
        return
    (out_ref,) = out_refs  # [rows, head_dim]
    plgpu.store(out_ref.at[pl.ds(0, rows), :], _normalized(acc, l).astype(out_ref.dtype), mask=row_ok[:, None])


def merge_splits(o_s, m_s, l_s, *, group: int, rows: int, interpret: bool, out_dtype=None):
    """The merge kernel over a call's split partials: o_s [batch, kv_heads, splits, group, head_dim], m_s, l_s
    [batch, kv_heads, splits, group] float32 -> the output [batch, kv_heads, group, head_dim] in `out_dtype`, or
    with `out_dtype=None` the merged partials (acc, m, l) float32 (`_merge_kernel`). One program per (row, kv
    head); `rows` is the group padded for the kernel's register tiles."""
    batch, kv_heads, num_splits, _, head_dim = o_s.shape
    partials = out_dtype is None
    if partials:
        out_shape = [
            jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, group), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, group), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, rows), lambda b, h: (b, h, 0)),
            pl.BlockSpec((None, None, rows), lambda b, h: (b, h, 0)),
        ]
    else:
        out_shape = jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), out_dtype)
        out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda b, h: (b, h, 0, 0))
    return pl.pallas_call(
        functools.partial(_merge_kernel, group=group, num_splits=num_splits, partials=partials),
        grid=(batch, kv_heads),
        in_specs=[
            pl.BlockSpec((None, None, num_splits, rows, head_dim), lambda b, h: (b, h, 0, 0, 0)),
            pl.BlockSpec((None, None, num_splits, rows), lambda b, h: (b, h, 0, 0)),
            pl.BlockSpec((None, None, num_splits, rows), lambda b, h: (b, h, 0, 0)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(_MERGE_WARPS, 2),
        interpret=interpret,
        name="vase_decode_attention_merge" + ("_partials" if partials else ""),
    )(o_s, m_s, l_s)


@functools.partial(jax.jit, static_argnames=("params", "scale", "interpret", "partials"))
def _decode_pallas(q, k, v, pos, length, block_mask, layer, *, params: DecodeParams, scale, interpret,
                   partials=False):
    batch, kv_heads, group, head_dim = q.shape
    if layer is None:  # one layer: a stack of 1 (free reshapes)
        k, v, pos, layer = k[None], v[None], pos[None], 0
    layers, capacity = k.shape[0], k.shape[3]
    rows = max(_MIN_ROWS, next_power_of_2(group))
    num_splits = params.num_splits
    lengths = jnp.asarray(length).astype(jnp.int32).reshape(-1)  # [1] or [batch]; clipped in the kernel
    layer = jnp.asarray(layer).astype(jnp.int32).reshape(1)  # [1]
    has_block_mask = block_mask is not None

    # q, k, v, pos blocks: the (row, kv head) pair's; q's block overhangs the group (masked reads)
    in_specs = [
        pl.BlockSpec((lengths.shape[0],), lambda b, h, s: (0,)),
        pl.BlockSpec((1,), lambda b, h, s: (0,)),
        pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
        pl.BlockSpec((layers, None, None, capacity, head_dim), lambda b, h, s: (0, b, h, 0, 0)),
        pl.BlockSpec((layers, None, None, capacity, head_dim), lambda b, h, s: (0, b, h, 0, 0)),
        pl.BlockSpec((layers, None, None, capacity), lambda b, h, s: (0, b, h, 0)),
    ]
    args = [lengths, layer, q, k, v, pos.astype(jnp.int32)]
    if has_block_mask:
        num_blocks = block_mask.shape[2]
        in_specs.append(pl.BlockSpec((None, None, num_blocks), lambda b, h, s: (b, h, 0)))
        args.append(block_mask.astype(jnp.int32))  # [batch, kv_heads, num_blocks]
    if num_splits == 1 and not partials:  # the output itself
        out_shape = jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), q.dtype)
        out_specs = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))
    else:  # per split: the unnormalized accumulator o_s, the running max m_s and the running sum l_s
        out_shape = [
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, group), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        ]
    kernel = functools.partial(
        _decode_kernel, group=group, params=params, scale=scale, has_block_mask=has_block_mask, partials=partials
    )
    result = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(params.num_warps, params.num_stages),
        interpret=interpret,
        name="vase_decode_attention",
    )(*args)
    if num_splits == 1:
        # the output, or with `partials` the one split's (acc, m, l): dropping the split axis is a free reshape
        return tuple(x[:, :, 0] for x in result) if partials else result
    o_s, m_s, l_s = result  # [batch, kv_heads, splits, group(, head_dim)]
    return merge_splits(o_s, m_s, l_s, group=group, rows=rows, interpret=interpret,
                        out_dtype=None if partials else q.dtype)


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    length: jax.Array | int,
    *,
    block_size: int | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
    scale: float | None = None,
    block_mask: jax.Array | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    layer: jax.Array | int | None = None,
    device_kind: str | None = None,
    **unused,
) -> jax.Array:
    """Flash-decoding attention (Pallas, Triton lowering); see the module docstring for the math.

    Args:
      q: [batch, kv_heads, group, head_dim], one query token per row, the GQA group of each kv head.
      k, v: [batch, kv_heads, capacity, head_dim], same dtype as q (bfloat16 or float32), or for a 16-bit q
        its bits as uint16 (`holds_bits_of`).
      pos: [batch, kv_heads, capacity] int32, -1 marks an empty slot.
      length: int32, slots in use: a scalar for every row, or [batch] one per row; a row's slots >= its length
        are never read (each program loops over its own row's blocks).
      block_size, num_splits, num_warps, num_stages: the kernel's launch parameters; None (default) takes them
        from `decode_tuning` (the table entry of the device kind, head_dim, group and dtype; splits from the
        shape). Given values are validated (block_size a power of two >= 16, num_splits >= 1, num_warps a power
        of two <= 32, num_stages >= 1); num_splits is clipped to the capacity's blocks. With a block mask,
        block_size defaults to `DEFAULT_BLOCK_SIZE` (the mask's granularity).
      interpret: run through the Pallas interpreter (CPU tests).
      scale: logit scale, default head_dim ** -0.5.
      block_mask: optional [batch, kv_heads, ceil(capacity / block_size)] bool; False blocks are skipped.
      layer: with a stacked cache (k, v [layers, batch, kv_heads, capacity, head_dim], pos [layers, batch,
        kv_heads, capacity]), the layer to attend over (int32 scalar, may be traced); the kernel reads its
        blocks straight from the stack, so the layer is never copied out.
      device_kind: the table's device kind; default `decode_tuning.current_device_kind()` at trace time.
      unused: kernel parameters of the other platforms, ignored.

    Returns:
      [batch, kv_heads, group, head_dim] in q's dtype; 0 for rows without a valid slot.
    """
    del unused
    if block_mask is not None and block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    check_decode_args(q, k, v, pos, length, DEFAULT_BLOCK_SIZE if block_size is None else block_size, block_mask, layer)
    params = _launch(q, k.shape[-2], device_kind, block_size, num_splits, num_warps, num_stages)
    return _decode_pallas(
        q, k, v, pos, length, block_mask, layer, params=params, scale=_scale(scale, q.shape[3]),
        interpret=bool(interpret),
    )


def _launch(q, capacity: int, device_kind, block_size, num_splits, num_warps, num_stages) -> DecodeParams:
    """The launch parameters of one call (`decode_tuning.decode_params`), after the kernel's head_dim check."""
    batch, kv_heads, group, head_dim = q.shape
    if not is_power_of_2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 for the Pallas kernel")
    return decode_params(
        batch=batch, kv_heads=kv_heads, group=group, head_dim=head_dim, capacity=capacity, dtype=q.dtype,
        device_kind=device_kind, block_size=block_size, num_splits=num_splits, num_warps=num_warps,
        num_stages=num_stages,
    )


def decode_attention_partials(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    length: jax.Array | int,
    *,
    block_size: int | None = None,
    num_splits: int | None = None,
    interpret: bool = False,
    scale: float | None = None,
    block_mask: jax.Array | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    layer: jax.Array | int | None = None,
    device_kind: str | None = None,
    **unused,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`decode_attention`'s kernels (same arguments, same launch parameters), returning the unnormalized partials
    instead of the output, for a cache held in several segments (`vase_jax.quant_attention.merge`):

        m = max_j s_j,   l = sum_j e^{s_j - m},   acc = sum_j e^{s_j - m} v_j      over the valid slots j

    acc [batch, kv_heads, group, head_dim], m and l [batch, kv_heads, group], float32; a (row, kv head) without a
    valid slot has acc = 0, l = 0 and m = -1e30 (the convention of `decode_attention_partials_reference`). The
    splits are merged inside (the merge kernel's partials variant); with one split the kernel writes them itself.
    `acc / l` (0 where l = 0) is `decode_attention`'s output before its cast to q's dtype. `block_mask` is
    accepted as in `decode_attention`.
    """
    del unused
    if block_mask is not None and block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    check_decode_args(q, k, v, pos, length, DEFAULT_BLOCK_SIZE if block_size is None else block_size, block_mask, layer)
    params = _launch(q, k.shape[-2], device_kind, block_size, num_splits, num_warps, num_stages)
    return _decode_pallas(
        q, k, v, pos, length, block_mask, layer, params=params, scale=_scale(scale, q.shape[3]),
        interpret=bool(interpret), partials=True,
    )


# ------------------------------------------------------------------------------------------------------------
# pure-JAX reference (the CPU production path)
# ------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("block_size", "scale"))
def _decode_reference(q, k, v, pos, length, block_mask, layer=None, *, block_size, scale):
    acc, _, l = _reference_partials(q, k, v, pos, length, block_mask, layer, block_size=block_size, scale=scale)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.astype(q.dtype)


def _reference_partials(q, k, v, pos, length, block_mask, layer=None, *, block_size, scale):
    """The reference's online softmax: (acc [b, h, group, head_dim], m, l [b, h, group]) in float32."""
    batch, kv_heads, group, head_dim = q.shape
    capacity = k.shape[-2]

    def block_of(x, start, block):  # slots [start, start + block) of x (of layer `layer` when x is stacked)
        if layer is None:
            return lax.dynamic_slice_in_dim(x, start, block, axis=2)
        starts = (layer, 0, 0, start) + (0,) * (x.ndim - 4)
        return lax.dynamic_slice(x, starts, (1, *x.shape[1:3], block, *x.shape[4:]))[0]

    block = min(block_size, capacity)
    lengths = row_lengths(length, batch, capacity)  # [batch]
    used_blocks = (jnp.max(lengths) + block - 1) // block  # the longest row's; shorter rows are masked
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
        live = (slots >= i * block)[None, :] & (slots[None, :] < lengths[:, None])  # [batch, block]
        valid = (p_blk >= 0) & live[:, None, :]
        if block_mask is not None:
            valid = valid & lax.dynamic_index_in_dim(block_mask, i, axis=2, keepdims=True)
        s = jnp.einsum("bhgd,bhsd->bhgs", qf, k_blk, precision=lax.Precision.HIGHEST)
        s = jnp.where(valid[:, :, None, :], s, -jnp.inf)  # [batch, kv_heads, group, block]
        m_new = jnp.maximum(m, s.max(axis=-1))  # [batch, kv_heads, group]
        correction = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])  # exactly 0 on invalid slots
        v_blk = jnp.where(valid[..., None], v_blk, 0.0)  # garbage (even NaN) in masked slots must not leak
        pv = jnp.einsum("bhgs,bhsd->bhgd", p, v_blk, precision=lax.Precision.HIGHEST)
        return acc * correction[..., None] + pv, m_new, l * correction + pairwise_sum(p)[..., 0]

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
    _, partials = lax.while_loop(
        lambda state: state[0] < used_blocks, body, (jnp.zeros((), jnp.int32), init)
    )
    return partials


def decode_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    length: jax.Array | int,
    *,
    block_size: int | None = None,
    scale: float | None = None,
    block_mask: jax.Array | None = None,
    layer: jax.Array | int | None = None,
    **unused,
) -> jax.Array:
    """Pure-JAX twin of `decode_attention` (same arguments; kernel-only ones like `num_splits` are ignored).

    A `lax.while_loop` over blocks of `block_size` slots (default `DEFAULT_BLOCK_SIZE`) that stops after
    ceil(max_b length[b] / block_size) blocks, each row masked at its own length (`length`: a scalar or
    [batch]), with an online softmax in float32. Any block size >= 1 works here (the kernel needs a power of two).

    `layer`: with a stacked cache (k, v `[layers, batch, kv_heads, capacity, head_dim]`, pos `[layers, batch,
    kv_heads, capacity]`), attend over that layer: each block is sliced straight from the stack, so the layer is
    never copied out (a traced index works, as inside a `lax.scan` over layers).
    """
    del unused
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    check_decode_args(q, k, v, pos, length, block_size, block_mask, layer)
    return _decode_reference(
        q, k, v, pos, length, block_mask, layer, block_size=block_size, scale=_scale(scale, q.shape[3])
    )


def decode_attention_partials_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pos: jax.Array,
    length: jax.Array | int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale: float | None = None,
    layer: jax.Array | int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`decode_attention_reference`'s unnormalized partials (acc, running max m, running sum l; float32), for
    attention over a cache held in several segments, merged by log-sum-exp (`vase_jax.quant_attention.merge`).
    Normalizing them (acc / l, 0 where l = 0) is exactly `decode_attention_reference`'s output."""
    check_decode_args(q, k, v, pos, length, block_size, None, layer)
    return _reference_partials(q, k, v, pos, length, None, layer, block_size=block_size,
                               scale=_scale(scale, q.shape[3]))
