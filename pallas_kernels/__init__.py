"""Pallas kernels for GPU (Triton) and TPU (Mosaic): decode attention and the window-attention mass of eviction.

| operation | Triton (GPU) | Mosaic TPU | pure JAX (XLA) |
|---|---|---|---|
| decode attention | `decode_attention` | `decode_attention_tpu` | `decode_attention_reference` |
| its launch parameters | `decode_tuning.decode_params` (per device kind and shape) | - | - |
| window-attention mass | `window_mass` | `window_mass_tpu` | in `vase_jax.eviction.window_score` |

`get_decode_attention(impl)` / `get_window_mass(impl, xla)` return the implementation for `impl` (see
`dispatch`: "auto" picks the kernel of the platform being lowered for, the XLA path elsewhere). This package
imports nothing from `vase_jax`: the window score's equation and its reference live there, and call in here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.decode_attention_tpu import decode_attention_tpu
from pallas_kernels.decode_tuning import DecodeParams, DecodeTuning, current_device_kind, decode_params
from pallas_kernels.dispatch import IMPLS, check_impl, per_device, select
from pallas_kernels.eviction_scores import window_mass
from pallas_kernels.eviction_scores_tpu import window_mass_tpu

__all__ = [
    "IMPLS",
    "DecodeParams",
    "DecodeTuning",
    "check_impl",
    "current_device_kind",
    "decode_attention",
    "decode_attention_reference",
    "decode_attention_tpu",
    "decode_params",
    "get_decode_attention",
    "get_window_mass",
    "select",
    "window_mass",
    "window_mass_tpu",
]


def get_decode_attention(impl: str = "auto", **kernel_options) -> Callable:
    """f(q, k, v, pos, length, layer=None) for `impl`; `kernel_options` (e.g. `block_size`) go to every
    implementation (each ignores the options of the others). `length`: a scalar for every row or [batch] one per
    row. `layer`: attend over that layer of a cache stacked over layers (k, v [layers, batch, kv_heads, capacity,
    head_dim]) without copying it out."""

    def bind(fn: Callable, **fixed) -> Callable:
        def call(q, k, v, pos, length, *layer):  # layer, when given, is a traced positional argument
            return fn(q, k, v, pos, length, layer=layer[0] if layer else None, **fixed, **kernel_options)

        return call

    chosen = select(
        impl,
        xla=bind(decode_attention_reference),
        triton=lambda interpret: bind(decode_attention, interpret=interpret),
        tpu=lambda interpret: bind(decode_attention_tpu, interpret=interpret),
    )

    def attend(q, k, v, pos, length, layer=None):
        if impl == "xla":  # the SPMD partitioner splits the XLA path itself
            return chosen(q, k, v, pos, length) if layer is None else chosen(q, k, v, pos, length, layer)
        # Under a mesh each device attends over its own rows and kv heads (`dispatch.per_device`).
        rows_heads = P("data", "model")  # q [batch, kv_heads, group, head_dim], the output likewise
        kv = P(*((None,) if layer is not None else ()), "data", "model")  # [(layers,) batch, kv_heads, slots, ...]
        args = (q, k, v, pos, length) + (() if layer is None else (layer,))
        lengths = P("data") if jnp.ndim(length) else P()  # one per row: each device gets its rows' lengths
        specs = (rows_heads, kv, kv, kv, lengths) + (() if layer is None else (P(),))
        return per_device(chosen, specs, rows_heads)(*args)

    return attend


def get_window_mass(impl: str, xla: Callable, **kernel_options) -> Callable:
    """f(q_rows, keys, valid, row_weights) for `impl`, with `xla` as the pure-JAX implementation.

    `kernel_options` (`scale` included) go to both kernels; `xla` is called with the positional arguments only.
    """
    chosen = select(
        impl,
        xla=xla,
        triton=lambda interpret: functools.partial(window_mass, interpret=interpret, **kernel_options),
        tpu=lambda interpret: functools.partial(window_mass_tpu, interpret=interpret, **kernel_options),
    )
    if impl == "xla":
        return chosen
    # Under a mesh: per device over its rows and kv heads. q_rows, keys [b, h, ., d], valid [b, h, L],
    # row_weights [b, rows] -> [b, h, L].
    rows_heads = P("data", "model")

    def run(q_rows, keys, valid, row_weights):
        return per_device(chosen, (rows_heads, rows_heads, rows_heads, P("data")), rows_heads)(
            q_rows, keys, valid, row_weights)

    return run
