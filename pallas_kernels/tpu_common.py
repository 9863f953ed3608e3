"""Small helpers shared by the Pallas TPU (Mosaic) kernels: the (8, 128) vector tile and lane broadcasts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

LANES = 128  # minor (lane) axis of a TPU vector register
SUBLANES = 8  # second-minor (sublane) axis, for 32-bit values


def sublane_multiple(n: int, dtype) -> int:
    """n rounded up to whole sublane tiles: 8 rows of a 32-bit type, 16 of a 16-bit one (two rows per sublane)."""
    packing = max(1, 4 // jnp.dtype(dtype).itemsize)
    tile = SUBLANES * packing
    return -(-n // tile) * tile


def lanes_to(x: jax.Array, n: int) -> jax.Array:
    """[rows, LANES] lane-replicated values -> [rows, n], for broadcasting against a [rows, n] tile.

    Whole vregs are repeated when n is a multiple of 128 (no cross-lane work); otherwise the first lane is
    broadcast."""
    rows, lanes = x.shape
    if n == lanes:
        return x
    if n % lanes == 0:
        return jnp.tile(x, (1, n // lanes))
    if n < lanes:
        return x[:, :n]
    return jnp.broadcast_to(x[:, :1], (rows, n))


def dot_precision(dtype) -> lax.Precision:
    """float32 operands: full-precision MXU passes (HIGHEST); bfloat16: one native pass."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT
