"""The VaSE window-attention score (spec section 3.0): its one definition, with the Pallas kernels as the
implementations of its heavy step.

For row b, kv head h, group member g, window query t and candidate j:

    a[b,h,g,t,j] = softmax over the valid candidates j of  q[b,h,g,t] . k[b,h,j] / (sqrt(D) * temperature)
    p[b,h,j]     = (1 / (G * n_q[b])) * sum_g sum_{t valid} a[b,h,g,t,j]   n_q = valid window queries of row b
    s[b,h,:]     = AvgPool1d(p[b,h,:], kernel 5, stride 1, zero padding 2, always / 5)   if smooth, else p
    s[b,h,j]     = 0 for invalid candidates (before and after pooling)

Pooling and the means are linear, so pooling the group/window mean equals the mean of pooled rows; an invalid
prefix of candidates acts as the zero padding of the unpadded array. Rows without a valid candidate and batches
without a valid query give 0. Everything is float32.

Computation: the (group, window) queries of a kv head become R = G * W rows with weights w[b, r] = 1 / (G * n_q)
on valid queries and 0 elsewhere (invalid queries are zeroed first, so whatever they hold, even NaN, cannot reach
the score). The *window mass*

    p[b,h,j] = sum_r w[b,r] softmax_{j' valid}(q[b,h,r] . k[b,h,j'] / (sqrt(D) T))_j

is the only step that reads the keys: `window_mass_reference` here (XLA), `pallas_kernels.window_mass` (Triton,
GPU) or `pallas_kernels.window_mass_tpu` (Mosaic, TPU), chosen by `impl` (`pallas_kernels.dispatch`). Pooling and
masking are cheap [batch, kv_heads, L] operations in plain JAX.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import get_window_mass

POOL_KERNEL = 5
_NEG = -1e30  # finite floor for row maxima: exp(-inf - m) stays 0 when a row has no valid candidate


def _check_args(queries, query_valid, keys, valid, temperature: float) -> None:
    if queries.ndim != 5:
        raise ValueError(f"queries has shape {queries.shape}; expected [batch, kv_heads, group, window, head_dim]")
    batch, kv_heads, _, window, head_dim = queries.shape
    if keys.ndim != 4 or keys.shape[:2] != (batch, kv_heads) or keys.shape[3] != head_dim:
        raise ValueError(f"keys has shape {keys.shape}; expected [{batch}, {kv_heads}, L, {head_dim}] to match queries")
    if valid.shape != keys.shape[:3]:
        raise ValueError(f"valid has shape {valid.shape}; expected [batch, kv_heads, L] = {keys.shape[:3]}")
    if valid.dtype != jnp.bool_:
        raise ValueError(f"valid has dtype {valid.dtype}; expected bool")
    if query_valid.shape != (batch, window):
        raise ValueError(f"query_valid has shape {query_valid.shape}; expected [batch, window] = {(batch, window)}")
    if query_valid.dtype != jnp.bool_:
        raise ValueError(f"query_valid has dtype {query_valid.dtype}; expected bool")
    if queries.dtype != keys.dtype:
        raise ValueError(f"queries and keys dtypes differ: {queries.dtype}, {keys.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")


def query_rows(queries: jax.Array, query_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[b, h, G, W, D] queries, [b, W] validity -> rows [b, h, G * W, D] (row g * W + t), weights [b, G * W] f32.

    Invalid queries become zero rows of weight 0; valid ones weigh 1 / (G * n_q)."""
    batch, kv_heads, group, window, head_dim = queries.shape
    queries = jnp.where(query_valid[:, None, None, :, None], queries, jnp.zeros((), queries.dtype))
    qv = query_valid.astype(jnp.float32)  # [b, W]
    w = qv / (group * jnp.maximum(qv.sum(axis=-1, keepdims=True), 1.0))  # [b, W]
    rows = queries.reshape(batch, kv_heads, group * window, head_dim)
    return rows, jnp.tile(w, (1, group))  # [b, h, R, D], [b, R]


def pool_and_mask(p: jax.Array, valid: jax.Array, smooth: bool) -> jax.Array:
    """Zero the invalid candidates, average-pool over slots if `smooth` (kernel 5, zero padding, / 5), re-zero."""
    p = jnp.where(valid, p, 0.0)  # [b, h, L]
    if smooth:
        half = POOL_KERNEL // 2
        length = p.shape[-1]
        padded = jnp.pad(p, ((0, 0), (0, 0), (half, half)))
        p = sum(padded[..., i : i + length] for i in range(POOL_KERNEL)) / POOL_KERNEL
        p = jnp.where(valid, p, 0.0)
    return p


@functools.partial(jax.jit, static_argnames=("scale",))
def window_mass_reference(
    q_rows: jax.Array, keys: jax.Array, valid: jax.Array, row_weights: jax.Array, *, scale: float
) -> jax.Array:
    """Pure-JAX window mass (module docstring): q_rows [b, h, R, D], keys [b, h, L, D], valid [b, h, L] bool,
    row_weights [b, R] -> [b, h, L] float32 (0 on invalid candidates)."""
    logits = jnp.einsum(
        "bhrd,bhld->bhrl", q_rows.astype(jnp.float32), keys.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )  # [b, h, R, L]
    logits = jnp.where(valid[:, :, None, :], logits * scale, -jnp.inf)
    m = jnp.maximum(logits.max(axis=-1, keepdims=True), _NEG)  # finite even when no candidate is valid
    e = jnp.exp(logits - m)  # 0 on invalid candidates
    den = e.sum(axis=-1, keepdims=True)  # [b, h, R, 1]
    w = row_weights.astype(jnp.float32)[:, None, :, None]  # [b, 1, R, 1]
    coef = jnp.where(den > 0, w / jnp.where(den > 0, den, 1.0), 0.0)
    return (e * coef).sum(axis=2)  # [b, h, L]; a fused reduce (an einsum here is slow on CPU)


def window_score(
    queries: jax.Array,
    query_valid: jax.Array,
    keys: jax.Array,
    valid: jax.Array,
    *,
    temperature: float = 1.0,
    smooth: bool = True,
    impl: str = "xla",
    **kernel_options,
) -> jax.Array:
    """The VaSE window-attention score s (module docstring), float32 [batch, kv_heads, L].

    Args:
      queries: [batch, kv_heads, group, window, head_dim], the post-RoPE window queries (query head i belongs to
        kv head i // group).
      query_valid: [batch, window] bool, the window queries that exist.
      keys: [batch, kv_heads, L, head_dim], the candidate keys (queries' dtype).
      valid: [batch, kv_heads, L] bool, the candidates that exist.
      temperature: logit temperature T.
      smooth: average-pool (kernel 5) the mass over slots.
      impl: "auto" | "xla" | "pallas" | "pallas_gpu" | "pallas_tpu" (`pallas_kernels.dispatch`).
      kernel_options: block sizes etc. for the kernels (e.g. `block_keys`); give them with an explicit kernel
        family ("pallas_gpu" / "pallas_tpu"), since the two families accept different values.
    """
    _check_args(queries, query_valid, keys, valid, temperature)
    scale = 1.0 / (queries.shape[-1] ** 0.5 * float(temperature))
    rows, weights = query_rows(queries, query_valid)
    xla = functools.partial(window_mass_reference, scale=scale)
    mass = get_window_mass(impl, xla, scale=scale, **kernel_options)(rows, keys, valid, weights)  # [b, h, L]
    return pool_and_mask(mass, valid, bool(smooth))


def window_score_reference(
    queries: jax.Array,
    query_valid: jax.Array,
    keys: jax.Array,
    valid: jax.Array,
    *,
    temperature: float = 1.0,
    smooth: bool = True,
) -> jax.Array:
    """`window_score` on the pure-JAX path: the reference the kernels are tested against."""
    return window_score(queries, query_valid, keys, valid, temperature=temperature, smooth=smooth, impl="xla")
