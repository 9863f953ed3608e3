"""The window-attention mass for TPU: a Pallas (Mosaic TPU) kernel, the twin of the Triton kernel in
`eviction_scores.py` (same arguments, same result). The VaSE window score (`vase_jax.eviction.window_score`)
is this mass, average-pooled over slots:

    p[b,h,j] = sum_r w[b,r] softmax_{j' valid}(scale * q[b,h,r] . k[b,h,j'])_j     for valid j, else 0

with rows r = (group member, window query) and row weights w = 1 / (G * n_q) on valid window queries, 0 elsewhere.
A row without any valid candidate contributes nothing. Everything is float32.

Layout for the TPU's (8, 128) tiles: head_dim is the lane axis of the query rows and the keys; the candidate
axis is cut into blocks of `block_keys` (a multiple of 128: one block of `valid` and of the output fills whole
lanes); all rows (G x W, e.g. 8 x 64 = 512) form the sublane axis of one matmul.

One kernel, two phases over the same key blocks, grid (batch, kv_heads, phase, blocks):

    phase 0: per row, the running max m and sum l of exp(s - m) over the key blocks (online softmax)
    phase 1: coef = w / l (0 where l = 0); per key block, out[j] = sum_r exp(s[r, j] - m[r]) coef[r]

m and l stay in VMEM scratch between the phases, so the keys are read twice and nothing else goes back to
HBM. The output block index is (b, h, j * phase): it stays on block 0 during phase 0 (nothing is written back
until phase 1 has filled it) and walks the blocks in phase 1. Slots past the number of candidates (the
padding of a partial last block) are masked by index, so their contents never matter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu_common import LANES, dot_precision, lanes_to

DEFAULT_BLOCK_KEYS_TPU = 512
_NEG = -1e30  # finite start for running maxima


def check_mass_args(q_rows, keys, valid, row_weights) -> None:
    """Shape and dtype checks shared by the window-mass kernels (raise ValueError at trace time)."""
    if q_rows.ndim != 4:
        raise ValueError(f"q_rows has shape {q_rows.shape}; expected [batch, kv_heads, rows, head_dim]")
    batch, kv_heads, rows, head_dim = q_rows.shape
    if keys.ndim != 4 or keys.shape[:2] != (batch, kv_heads) or keys.shape[3] != head_dim:
        raise ValueError(f"keys has shape {keys.shape}; expected [{batch}, {kv_heads}, L, {head_dim}] to match q_rows")
    if valid.shape != keys.shape[:3] or valid.dtype != jnp.bool_:
        raise ValueError(f"valid has shape {valid.shape} and dtype {valid.dtype}; expected {keys.shape[:3]} bool")
    if row_weights.shape != (batch, rows):
        raise ValueError(f"row_weights has shape {row_weights.shape}; expected [batch, rows] = {(batch, rows)}")
    if q_rows.dtype != keys.dtype:
        raise ValueError(f"q_rows and keys dtypes differ: {q_rows.dtype}, {keys.dtype}")


def _mass_kernel(
    q_ref,  # [rows, head_dim]
    w_ref,  # [rows, 1] f32, row weights
    k_ref,  # [block, head_dim]
    valid_ref,  # [1, block] int32
    o_ref,  # [1, block] f32
    m_ref,  # VMEM scratch [rows, LANES] f32: running max (phase 0), final max (phase 1)
    l_ref,  # VMEM scratch [rows, LANES] f32: running sum (phase 0), w / sum (phase 1)
    *,
    scale: float,
    num_keys: int,
):
    phase = pl.program_id(2)
    j = pl.program_id(3)
    block = k_ref.shape[0]
    q = q_ref[...]  # [rows, head_dim]
    s = lax.dot_general(
        q, k_ref[...], (((1,), (1,)), ((), ())), precision=dot_precision(q.dtype), preferred_element_type=jnp.float32
    )  # [rows, block]
    slot = j * block + lax.broadcasted_iota(jnp.int32, (1, block), 1)  # [1, block]
    ok = (slot < num_keys) & (valid_ref[...] != 0)  # [1, block]
    s = jnp.where(ok, s * scale, -jnp.inf)

    @pl.when((phase == 0) & (j == 0))
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)

    @pl.when(phase == 0)
    def _stats():
        m_prev = m_ref[...]  # [rows, LANES]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - lanes_to(m_next, block))  # [rows, block]
        l_ref[...] = jnp.exp(m_prev - m_next) * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next

    @pl.when((phase == 1) & (j == 0))
    def _coefficients():
        l = l_ref[...]  # [rows, LANES]
        l_ref[...] = jnp.where(l > 0.0, w_ref[...] / jnp.where(l > 0.0, l, 1.0), 0.0)

    @pl.when(phase == 1)
    def _accumulate():
        p = jnp.exp(s - lanes_to(m_ref[...], block)) * lanes_to(l_ref[...], block)  # [rows, block]
        o_ref[...] = jnp.sum(p, axis=0, keepdims=True)  # [1, block]


@functools.partial(jax.jit, static_argnames=("scale", "block_keys", "interpret"))
def _mass_tpu(q_rows, keys, valid, row_weights, *, scale, block_keys, interpret):
    batch, kv_heads, rows, head_dim = q_rows.shape
    num_keys = keys.shape[2]
    block = num_keys if num_keys <= block_keys else block_keys  # few candidates: one (full-dim) block
    num_blocks = pl.cdiv(num_keys, block)
    valid4 = valid.astype(jnp.int32).reshape(batch, kv_heads, 1, num_keys)  # [batch, kv_heads, 1, L]
    w3 = row_weights.astype(jnp.float32).reshape(batch, rows, 1)  # [batch, rows, 1]
    out = pl.pallas_call(
        functools.partial(_mass_kernel, scale=scale, num_keys=num_keys),
        grid=(batch, kv_heads, 2, num_blocks),
        in_specs=[
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, p, j: (b, h, 0, 0)),
            pl.BlockSpec((None, rows, 1), lambda b, h, p, j: (b, 0, 0)),
            pl.BlockSpec((None, None, block, head_dim), lambda b, h, p, j: (b, h, j, 0)),
            pl.BlockSpec((None, None, 1, block), lambda b, h, p, j: (b, h, 0, j)),
        ],
        out_specs=pl.BlockSpec((None, None, 1, block), lambda b, h, p, j: (b, h, 0, j * p)),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, 1, num_keys), jnp.float32),
        scratch_shapes=[pltpu.VMEM((rows, LANES), jnp.float32), pltpu.VMEM((rows, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary")
        ),
        interpret=interpret,
        name="vase_window_mass_tpu",
    )(q_rows, w3, keys, valid4)
    return out.reshape(batch, kv_heads, num_keys)


def window_mass_tpu(
    q_rows: jax.Array,
    keys: jax.Array,
    valid: jax.Array,
    row_weights: jax.Array,
    *,
    scale: float,
    block_keys: int = DEFAULT_BLOCK_KEYS_TPU,
    interpret=False,
    **unused,
) -> jax.Array:
    """Window-attention mass with the Pallas TPU kernel (module docstring).

    Args:
      q_rows: [batch, kv_heads, rows, head_dim], the window queries of each kv head's group (row = g * W + t).
        Rows with weight 0 must hold finite values (zero them).
      keys: [batch, kv_heads, L, head_dim], the candidate keys, q_rows' dtype.
      valid: [batch, kv_heads, L] bool, the candidates that exist.
      row_weights: [batch, rows] float32 >= 0.
      scale: logit scale, 1 / (sqrt(head_dim) * temperature).
      block_keys: candidates per grid step, a multiple of 128 (at most `block_keys` candidates are one block).
      interpret: False (compiled for TPU), `pltpu.InterpretParams()` (TPU interpret mode on CPU) or True.
      unused: kernel parameters of the other platforms, ignored.

    Returns:
      [batch, kv_heads, L] float32, 0 on invalid candidates.
    """
    del unused
    check_mass_args(q_rows, keys, valid, row_weights)
    if block_keys < LANES or block_keys % LANES:
        raise ValueError(f"block_keys={block_keys} must be a multiple of {LANES} for the TPU kernel")
    return _mass_tpu(q_rows, keys, valid, row_weights, scale=float(scale), block_keys=block_keys, interpret=interpret)
