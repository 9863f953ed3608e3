"""The window-attention mass for GPU: a Pallas (Triton) kernel. The VaSE window score
(`vase_jax.eviction.window_score`, where the whole equation and its pure-JAX reference live) is this mass,
average-pooled over slots:

    p[b,h,j] = sum_r w[b,r] softmax_{j' valid}(scale * q[b,h,r] . k[b,h,j'])_j     for valid j, else 0

with rows r = (group member, window query) and row weights w = 1 / (G * n_q) on valid window queries, 0 elsewhere.
A row without any valid candidate contributes nothing. Everything is float32. `eviction_scores_tpu.py` is the
TPU twin (same arguments, same result).

Kernel: two passes over the keys, the query rows forming the rows of a matmul.
  pass 1, grid (batch, kv_heads, row blocks, splits): per query row, the running max and sum of exp over
          the key blocks of its split; the splits are combined in plain JAX into m and coef = w / sum.
  pass 2, grid (batch, kv_heads, key blocks): for its key block, loop over the row blocks and accumulate
          exp(s - m) * coef into one mass per candidate.

Value magnitudes (Range, L2, Var) have no kernel: XLA computes each in a single fused read of `values`, which
is all a kernel could do (`vase_jax.eviction.scores.value_magnitude`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import is_power_of_2, next_power_of_2, triton_params
from pallas_kernels.eviction_scores_tpu import check_mass_args

_NEG = -1e30  # finite start for running maxima
_MIN_ROWS = 16  # Triton's dot wants M, N, K >= 16


def _dot_precision(dtype) -> lax.Precision:
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _stats_kernel(q_ref, k_ref, valid_ref, m_ref, l_ref, *, block_keys, blocks_per_split, num_blocks, c):
    """Pass 1. q_ref [row_block, D]; k_ref [L, D]; valid_ref [L] int32 -> m_ref, l_ref [row_block]."""
    num_keys = k_ref.shape[0]
    split = pl.program_id(3)
    first = split * blocks_per_split
    stop = jnp.minimum(first + blocks_per_split, num_blocks)
    q = q_ref[...]  # [row_block, D]
    precision = _dot_precision(q.dtype)
    offsets = jnp.arange(block_keys, dtype=jnp.int32)

    def body(j, carry):
        m, l = carry  # [row_block]
        slots = j * block_keys + offsets
        inside = slots < num_keys
        block = pl.ds(j * block_keys, block_keys)
        k = plgpu.load(k_ref.at[block, :], mask=inside[:, None], other=0.0)  # [block, D]
        ok = plgpu.load(valid_ref.at[block], mask=inside, other=0) != 0  # [block]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
        s = jnp.where(ok[None, :], s * c, -jnp.inf)  # [row_block, block]
        m_new = jnp.maximum(m, s.max(axis=1))
        l_new = l * jnp.exp(m - m_new) + jnp.exp(s - m_new[:, None]).sum(axis=1)
        return m_new, l_new

    rows = q.shape[0]
    m, l = lax.fori_loop(first, stop, body, (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32)))
    m_ref[...] = m
    l_ref[...] = l


def _accumulate_kernel(q_ref, m_ref, coef_ref, k_ref, valid_ref, out_ref, *, block_keys, row_block, c):
    """Pass 2. q_ref [rows, D]; m_ref, coef_ref [rows]; k_ref [L, D]; valid_ref [L] -> out_ref [block] f32."""
    num_keys = k_ref.shape[0]
    j = pl.program_id(2)
    slots = j * block_keys + jnp.arange(block_keys, dtype=jnp.int32)
    inside = slots < num_keys
    block = pl.ds(j * block_keys, block_keys)
    k = plgpu.load(k_ref.at[block, :], mask=inside[:, None], other=0.0)  # [block, D]
    ok = plgpu.load(valid_ref.at[block], mask=inside, other=0) != 0  # [block]
    precision = _dot_precision(k.dtype)
    num_row_blocks = q_ref.shape[0] // row_block

    def body(r, acc):
        rows = pl.ds(r * row_block, row_block)
        q = q_ref[rows, :]  # [row_block, D]
        m = m_ref[rows]  # [row_block]
        coef = coef_ref[rows]  # [row_block]: row weight / softmax denominator (0 for padding rows)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
        s = jnp.where(ok[None, :], s * c, -jnp.inf)  # [row_block, block]
        p = jnp.exp(s - m[:, None]) * coef[:, None]
        return acc + p.sum(axis=0)

    out_ref[...] = lax.fori_loop(0, num_row_blocks, body, jnp.zeros((block_keys,), jnp.float32))


@functools.partial(
    jax.jit,
    static_argnames=("scale", "block_keys", "block_rows", "num_splits", "num_warps", "num_stages", "interpret"),
)
def _mass_pallas(
    q_rows, keys, valid, row_weights, *, scale, block_keys, block_rows, num_splits, num_warps, num_stages, interpret
):
    batch, kv_heads, n_rows, head_dim = q_rows.shape
    num_keys = keys.shape[2]
    rows = max(_MIN_ROWS, next_power_of_2(n_rows))
    row_block = min(rows, block_rows)
    num_row_blocks = rows // row_block
    num_blocks = pl.cdiv(num_keys, block_keys)
    num_splits = min(num_splits, num_blocks)
    blocks_per_split = pl.cdiv(num_blocks, num_splits)
    params = triton_params(num_warps, num_stages)

    q_pad = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - n_rows), (0, 0)))  # [batch, kv_heads, rows, D]
    valid_i = valid.astype(jnp.int32)  # [batch, kv_heads, L]

    # pass 1: per-row max and sum of exp, per split of the key blocks
    m_s, l_s = pl.pallas_call(
        functools.partial(
            _stats_kernel, block_keys=block_keys, blocks_per_split=blocks_per_split, num_blocks=num_blocks, c=scale
        ),
        grid=(batch, kv_heads, num_row_blocks, num_splits),
        in_specs=[
            pl.BlockSpec((None, None, row_block, head_dim), lambda b, h, r, s: (b, h, r, 0)),
            pl.BlockSpec((None, None, num_keys, head_dim), lambda b, h, r, s: (b, h, 0, 0)),
            pl.BlockSpec((None, None, num_keys), lambda b, h, r, s: (b, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, row_block), lambda b, h, r, s: (b, h, s, r)),
            pl.BlockSpec((None, None, None, row_block), lambda b, h, r, s: (b, h, s, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="vase_window_scores_stats",
    )(q_pad, keys, valid_i)
    m = m_s.max(axis=2)  # [batch, kv_heads, rows]
    den = (l_s * jnp.exp(m_s - m[:, :, None])).sum(axis=2)  # [batch, kv_heads, rows]
    w = jnp.pad(row_weights.astype(jnp.float32), ((0, 0), (0, rows - n_rows)))  # [batch, rows]
    coef = w[:, None, :] * jnp.where(den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0)  # [batch, kv_heads, rows]

    # pass 2: normalized probabilities, summed over the rows, one key block per program
    p = pl.pallas_call(
        functools.partial(_accumulate_kernel, block_keys=block_keys, row_block=row_block, c=scale),
        grid=(batch, kv_heads, num_blocks),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, j: (b, h, 0, 0)),
            pl.BlockSpec((None, None, rows), lambda b, h, j: (b, h, 0)),
            pl.BlockSpec((None, None, rows), lambda b, h, j: (b, h, 0)),
            pl.BlockSpec((None, None, num_keys, head_dim), lambda b, h, j: (b, h, 0, 0)),
            pl.BlockSpec((None, None, num_keys), lambda b, h, j: (b, h, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, block_keys), lambda b, h, j: (b, h, j)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, num_blocks * block_keys), jnp.float32),
        compiler_params=params,
        interpret=interpret,
        name="vase_window_scores_accumulate",
    )(q_pad, m, coef, keys, valid_i)
    return jnp.where(valid, p[:, :, :num_keys], 0.0)


def window_mass(
    q_rows: jax.Array,
    keys: jax.Array,
    valid: jax.Array,
    row_weights: jax.Array,
    *,
    scale: float,
    interpret: bool = False,
    block_keys: int = 64,
    block_rows: int = 64,
    num_splits: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
    **unused,
) -> jax.Array:
    """Window-attention mass with the two-pass Pallas (Triton) kernel (module docstring).

    Args: as `eviction_scores_tpu.window_mass_tpu` (q_rows [batch, kv_heads, rows, head_dim], keys
    [batch, kv_heads, L, head_dim], valid [batch, kv_heads, L] bool, row_weights [batch, rows] float32, scale), plus
      interpret: run through the Pallas interpreter (CPU tests).
      block_keys: candidates per block (power of two >= 16).
      block_rows: query rows (group x window) per matmul tile (power of two >= 16).
      num_splits: parallel chunks of the candidates in pass 1.
      num_warps, num_stages: Triton compiler parameters.
      unused: kernel parameters of the other platforms, ignored.
    Returns:
      [batch, kv_heads, L] float32, 0 on invalid candidates.
    """
    del unused
    check_mass_args(q_rows, keys, valid, row_weights)
    head_dim = q_rows.shape[3]
    for name, value in (("block_keys", block_keys), ("block_rows", block_rows), ("head_dim", head_dim)):
        if not is_power_of_2(value) or value < 16:
            raise ValueError(f"{name}={value} must be a power of two >= 16 for the Pallas kernel")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    return _mass_pallas(
        q_rows,
        keys,
        valid,
        row_weights,
        scale=float(scale),
        block_keys=block_keys,
        block_rows=block_rows,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=bool(interpret),
    )
