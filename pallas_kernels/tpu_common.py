"""Small helpers shared by the Pallas TPU (Mosaic) kernels: the (8, 128) vector tile and lane broadcasts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

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


def _no_op(x_ref, o_ref):
    del x_ref, o_ref  # the output is the input's buffer (aliased): nothing to move


def pin_layout(x: jax.Array, *, interpret=False) -> jax.Array:
    """x itself, through a Mosaic call that reads and writes nothing: its operand and result take the default
    (row-major, tiled) layout that the Mosaic kernels read, and alias one buffer.

    Why: XLA:TPU's layout assignment gives each loop's carried arrays the layout its own ops prefer. A stacked
    cache array with a small minor dim (4-bit codes [.., slots, 64], group-major scales [.., groups, slots]) is
    read by the decode kernels in one layout and gathered or scattered by the ticks' loops in another, and XLA then
    copies the whole stack between them at every decode step, around each loop, even one that runs zero times.
    Pinned at the start and end of the ticks' loop bodies, the stacks keep the kernels' layout everywhere; the
    ticks' gathers and scatters relayout inside their fusions (one layer, at a tick) instead."""
    return pl.pallas_call(_no_op, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          in_specs=[pl.BlockSpec(memory_space=pl.ANY)], out_specs=pl.BlockSpec(memory_space=pl.ANY),
                          input_output_aliases={0: 0}, interpret=interpret, name="vase_pin_layout")(x)
