"""VaSE eviction scores: the window-attention score (spec section 3.0) and value magnitudes (Range, L2, Var).

Window-attention score, for row b, kv head h, group member g, window query t and candidate j:

    a[b,h,g,t,j] = softmax over the valid candidates j of  q[b,h,g,t] . k[b,h,j] / (sqrt(D) * temperature)
    p[b,h,j]     = (1 / (G * n_q[b])) * sum_g sum_{t valid} a[b,h,g,t,j]   n_q = valid window queries of row b
    s[b,h,:]     = AvgPool1d(p[b,h,:], kernel 5, stride 1, zero padding 2, always / 5)   if smooth, else p
    s[b,h,j]     = 0 for invalid candidates (before and after pooling)

Pooling and the means are linear, so pooling the group/window mean equals the mean of pooled rows. Rows
without a valid candidate and batches without a valid query give 0. Everything is float32.

Kernel: two passes over the keys, the (group x window) queries forming the rows of a matmul.
  pass 1, grid (batch, kv_heads, row blocks, splits): per query row, the running max and sum of exp over
          the key blocks of its split; the splits are combined in plain JAX.
  pass 2, grid (batch, kv_heads, key blocks): for its key block, loop over the row blocks and accumulate the
          normalized, weighted probabilities into one score per candidate.
The pooling and the final masking are cheap [batch, kv_heads, L] operations done in plain JAX.

Value magnitudes: XLA already computes each of them in a single fused read of `values`, so a Pallas kernel
would read no fewer bytes; `value_magnitude` therefore runs the pure-JAX code on every backend (and fusing it
into the score kernel would save only a kernel launch, since keys and values are different arrays).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dispatch import is_power_of_2, next_power_of_2, triton_params

MAGNITUDE_KINDS = ("range", "l2", "var")
POOL_KERNEL = 5
_NEG = -1e30  # finite start for running maxima
_MIN_ROWS = 16  # Triton's dot wants M, N, K >= 16


# ------------------------------------------------------------------------------------------------------------
# shared pieces
# ------------------------------------------------------------------------------------------------------------
def _drop_invalid_queries(queries: jax.Array, query_valid: jax.Array) -> jax.Array:
    """Zero the queries of invalid window slots, so that whatever they hold (even NaN) cannot reach the score."""
    return jnp.where(query_valid[:, None, None, :, None], queries, jnp.zeros((), queries.dtype))


def _check_score_args(queries, keys, valid, query_valid, temperature: float) -> None:
    if queries.ndim != 5:
        raise ValueError(
            f"queries has shape {queries.shape}; expected [batch, kv_heads, group, window, head_dim]"
        )
    batch, kv_heads, _, window, head_dim = queries.shape
    if keys.ndim != 4 or keys.shape[:2] != (batch, kv_heads) or keys.shape[3] != head_dim:
        raise ValueError(
            f"keys has shape {keys.shape}; expected [{batch}, {kv_heads}, L, {head_dim}] to match queries"
        )
    if valid.shape != keys.shape[:3]:
        raise ValueError(f"valid has shape {valid.shape}; expected [batch, kv_heads, L] = {keys.shape[:3]}")
    if valid.dtype != jnp.bool_:
        raise ValueError(f"valid has dtype {valid.dtype}; expected bool")
    if query_valid.shape != (batch, window):
        raise ValueError(
            f"query_valid has shape {query_valid.shape}; expected [batch, window] = {(batch, window)}"
        )
    if query_valid.dtype != jnp.bool_:
        raise ValueError(f"query_valid has dtype {query_valid.dtype}; expected bool")
    if queries.dtype != keys.dtype:
        raise ValueError(f"queries and keys dtypes differ: {queries.dtype}, {keys.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")


def _query_weights(query_valid: jax.Array, group: int) -> jax.Array:
    """[batch, window] bool -> [batch, window] float32: 1 / (G * n_q) on valid queries, 0 elsewhere."""
    qv = query_valid.astype(jnp.float32)
    n_q = qv.sum(axis=-1, keepdims=True)  # [batch, 1]
    return qv / (group * jnp.maximum(n_q, 1.0))


def _finish(p: jax.Array, valid: jax.Array, smooth: bool) -> jax.Array:
    """Average-pool (kernel 5, zero padding, / 5) over slots if smooth; zero the invalid candidates."""
    p = jnp.where(valid, p, 0.0)  # [batch, kv_heads, L]
    if smooth:
        half = POOL_KERNEL // 2
        length = p.shape[-1]
        padded = jnp.pad(p, ((0, 0), (0, 0), (half, half)))
        p = sum(padded[..., i : i + length] for i in range(POOL_KERNEL)) / POOL_KERNEL
        p = jnp.where(valid, p, 0.0)
    return p


def _dot_precision(dtype) -> lax.Precision:
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


# ------------------------------------------------------------------------------------------------------------
# pure-JAX reference
# ------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("smooth", "temperature"))
def _scores_reference(queries, keys, valid, query_valid, *, smooth, temperature):
    group, head_dim = queries.shape[2], queries.shape[4]
    c = 1.0 / (head_dim**0.5 * temperature)
    logits = jnp.einsum(
        "bhgwd,bhld->bhgwl",
        queries.astype(jnp.float32),
        keys.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
    )  # [batch, kv_heads, group, window, L]
    logits = jnp.where(valid[:, :, None, None, :], logits * c, -jnp.inf)
    m = jnp.maximum(logits.max(axis=-1, keepdims=True), _NEG)  # finite even when no candidate is valid
    e = jnp.exp(logits - m)  # 0 on invalid candidates
    den = e.sum(axis=-1, keepdims=True)  # [batch, kv_heads, group, window, 1]
    w = _query_weights(query_valid, group)[:, None, None, :, None]  # [batch, 1, 1, window, 1]
    coef = jnp.where(den > 0, w / jnp.where(den > 0, den, 1.0), 0.0)
    p = (e * coef).sum(axis=(2, 3))  # [batch, kv_heads, L]; a fused reduce (an einsum here is slow on CPU)
    return _finish(p, valid, smooth)


def window_scores_reference(
    queries: jax.Array,
    keys: jax.Array,
    valid: jax.Array,
    query_valid: jax.Array,
    *,
    smooth: bool = True,
    temperature: float = 1.0,
    **unused,
) -> jax.Array:
    """Pure-JAX VaSE window-attention score (module docstring); kernel-only arguments are ignored.

    Args:
      queries: [batch, kv_heads, group, window, head_dim], the post-RoPE window queries (query head i belongs
        to kv head i // group).
      keys: [batch, kv_heads, L, head_dim], the candidate keys.
      valid: [batch, kv_heads, L] bool, the candidates that exist.
      query_valid: [batch, window] bool, the window queries that exist.
    Returns:
      [batch, kv_heads, L] float32.
    """
    del unused
    _check_score_args(queries, keys, valid, query_valid, temperature)
    queries = _drop_invalid_queries(queries, query_valid)
    return _scores_reference(
        queries, keys, valid, query_valid, smooth=bool(smooth), temperature=float(temperature)
    )


# ------------------------------------------------------------------------------------------------------------
# Pallas kernel
# ------------------------------------------------------------------------------------------------------------
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
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = jnp.where(ok[None, :], s * c, -jnp.inf)  # [row_block, block]
        m_new = jnp.maximum(m, s.max(axis=1))
        l_new = l * jnp.exp(m - m_new) + jnp.exp(s - m_new[:, None]).sum(axis=1)
        return m_new, l_new

    rows = q.shape[0]
    m, l = lax.fori_loop(
        first, stop, body, (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    )
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
        coef = coef_ref[rows]  # [row_block]: query weight / softmax denominator (0 for padding rows)
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = jnp.where(ok[None, :], s * c, -jnp.inf)  # [row_block, block]
        p = jnp.exp(s - m[:, None]) * coef[:, None]
        return acc + p.sum(axis=0)

    out_ref[...] = lax.fori_loop(0, num_row_blocks, body, jnp.zeros((block_keys,), jnp.float32))


@functools.partial(
    jax.jit,
    static_argnames=(
        "smooth",
        "temperature",
        "block_keys",
        "block_rows",
        "num_splits",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def _scores_pallas(
    queries,
    keys,
    valid,
    query_valid,
    *,
    smooth,
    temperature,
    block_keys,
    block_rows,
    num_splits,
    num_warps,
    num_stages,
    interpret,
):
    batch, kv_heads, group, window, head_dim = queries.shape
    num_keys = keys.shape[2]
    c = 1.0 / (head_dim**0.5 * temperature)
    n_rows = group * window
    rows = max(_MIN_ROWS, next_power_of_2(n_rows))
    row_block = min(rows, block_rows)
    num_row_blocks = rows // row_block
    num_blocks = pl.cdiv(num_keys, block_keys)
    num_splits = min(num_splits, num_blocks)
    blocks_per_split = pl.cdiv(num_blocks, num_splits)
    params = triton_params(num_warps, num_stages)

    q_rows = queries.reshape(batch, kv_heads, n_rows, head_dim)  # row r = g * window + t
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows - n_rows), (0, 0)))  # [batch, kv_heads, rows, D]
    valid_i = valid.astype(jnp.int32)  # [batch, kv_heads, L]

    # pass 1: per-row max and sum of exp, per split of the key blocks
    m_s, l_s = pl.pallas_call(
        functools.partial(
            _stats_kernel,
            block_keys=block_keys,
            blocks_per_split=blocks_per_split,
            num_blocks=num_blocks,
            c=c,
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
    )(q_rows, keys, valid_i)
    m = m_s.max(axis=2)  # [batch, kv_heads, rows]
    den = (l_s * jnp.exp(m_s - m[:, :, None])).sum(axis=2)  # [batch, kv_heads, rows]
    w = _query_weights(query_valid, group)  # [batch, window]
    w = jnp.pad(jnp.tile(w, (1, group)), ((0, 0), (0, rows - n_rows)))  # [batch, rows]
    coef = w[:, None, :] * jnp.where(
        den > 0, 1.0 / jnp.where(den > 0, den, 1.0), 0.0
    )  # [batch, kv_heads, rows]

    # pass 2: normalized probabilities, summed over the rows, one key block per program
    p = pl.pallas_call(
        functools.partial(_accumulate_kernel, block_keys=block_keys, row_block=row_block, c=c),
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
    )(q_rows, m, coef, keys, valid_i)
    return _finish(p[:, :, :num_keys], valid, smooth)


def window_scores(
    queries: jax.Array,
    keys: jax.Array,
    valid: jax.Array,
    query_valid: jax.Array,
    *,
    smooth: bool = True,
    temperature: float = 1.0,
    interpret: bool = False,
    block_keys: int = 64,
    block_rows: int = 64,
    num_splits: int = 4,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:
    """VaSE window-attention score with the two-pass Pallas (Triton) kernel; same result as the reference.

    Args: as `window_scores_reference`, plus
      interpret: run through the Pallas interpreter (CPU tests).
      block_keys: candidates per block (power of two >= 16).
      block_rows: query rows (group x window) per matmul tile (power of two >= 16).
      num_splits: parallel chunks of the candidates in pass 1.
      num_warps, num_stages: Triton compiler parameters.
    """
    _check_score_args(queries, keys, valid, query_valid, temperature)
    queries = _drop_invalid_queries(queries, query_valid)
    head_dim = queries.shape[4]
    for name, value in (("block_keys", block_keys), ("block_rows", block_rows), ("head_dim", head_dim)):
        if not is_power_of_2(value) or value < 16:
            raise ValueError(f"{name}={value} must be a power of two >= 16 for the Pallas kernel")
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    return _scores_pallas(
        queries,
        keys,
        valid,
        query_valid,
        smooth=bool(smooth),
        temperature=float(temperature),
        block_keys=block_keys,
        block_rows=block_rows,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=bool(interpret),
    )


# ------------------------------------------------------------------------------------------------------------
# value magnitudes
# ------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("kind",))
def _magnitude(values, valid, *, kind):
    x = values.astype(jnp.float32)  # [batch, kv_heads, L, head_dim]
    if kind == "range":
        m = x.max(axis=-1) - x.min(axis=-1)
    elif kind == "l2":
        m = jnp.sqrt((x * x).sum(axis=-1))
    else:  # "var", unbiased (ddof = 1) like torch.var
        mean = x.mean(axis=-1, keepdims=True)
        m = ((x - mean) ** 2).sum(axis=-1) / (x.shape[-1] - 1)
    return jnp.where(valid, m, 0.0)  # [batch, kv_heads, L]


def value_magnitude_reference(values: jax.Array, valid: jax.Array, kind: str, **unused) -> jax.Array:
    """Per-candidate magnitude of the value vector over head_dim, float32, 0 on invalid candidates.

    kind: "range" (max - min), "l2" (Euclidean norm) or "var" (variance with ddof = 1).
    values: [batch, kv_heads, L, head_dim]; valid: [batch, kv_heads, L] bool -> [batch, kv_heads, L].
    """
    del unused
    if kind not in MAGNITUDE_KINDS:
        raise ValueError(f"kind={kind!r} is not a value magnitude; allowed: {', '.join(MAGNITUDE_KINDS)}")
    if values.ndim != 4:
        raise ValueError(f"values has shape {values.shape}; expected [batch, kv_heads, L, head_dim]")
    if valid.shape != values.shape[:3] or valid.dtype != jnp.bool_:
        raise ValueError(
            f"valid has shape {valid.shape} and dtype {valid.dtype}; expected {values.shape[:3]} bool"
        )
    if kind == "var" and values.shape[3] < 2:
        raise ValueError(f"kind='var' needs head_dim >= 2 (ddof = 1); got head_dim={values.shape[3]}")
    return _magnitude(values, valid, kind=kind)


def value_magnitude(values: jax.Array, valid: jax.Array, kind: str, interpret: bool = False) -> jax.Array:
    """Same as `value_magnitude_reference` on every backend: XLA fuses each magnitude into one read of
    `values`, which is all a kernel could do (module docstring). `interpret` is accepted and ignored."""
    del interpret
    return value_magnitude_reference(values, valid, kind)
