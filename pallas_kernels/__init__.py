"""Pallas kernels for GPU (Triton) and TPU (Mosaic): decode attention and the window-attention mass of eviction.

| operation | Triton (GPU) | Mosaic TPU | pure JAX (XLA) |
|---|---|---|---|
| decode attention | `decode_attention` | `decode_attention_tpu` | `decode_attention_reference` |
| its partials (acc, m, l) | `decode_attention_partials` | `..._partials_tpu` | `..._partials_reference` |
| partials, quantized segment | `quant_decode_partials` | `quant_decode_partials_tpu` | `vase_jax.quant_attention` |
| its launch parameters | `decode_tuning.decode_params` (per device kind and shape) | - | - |
| window-attention mass | `window_mass` | `window_mass_tpu` | in `vase_jax.eviction.window_score` |

`get_decode_attention(impl)`, `get_decode_partials(impl)`, `get_quant_decode_partials(impl)` and
`get_window_mass(impl, xla)` return the implementation for `impl` (see `dispatch`: "auto" picks the kernel of the
platform being lowered for, the XLA path elsewhere). This package imports nothing from `vase_jax`: the window
score's equation and its reference live there and call in here, and the quantized segment's XLA reference
(`vase_jax.quant_attention`) is passed in by its caller.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.decode_attention import (
    decode_attention,
    decode_attention_partials,
    decode_attention_partials_reference,
    decode_attention_reference,
)
from pallas_kernels.decode_attention_tpu import decode_attention_partials_tpu, decode_attention_tpu
from pallas_kernels.decode_tuning import DecodeParams, DecodeTuning, current_device_kind, decode_params
from pallas_kernels.dispatch import IMPLS, check_impl, per_device, select
from pallas_kernels.eviction_scores import window_mass
from pallas_kernels.eviction_scores_tpu import window_mass_tpu
from pallas_kernels.quant_decode_attention import quant_decode_partials
from pallas_kernels.quant_decode_attention_tpu import quant_decode_partials_tpu
from pallas_kernels.tpu_common import pin_layout

__all__ = [
    "IMPLS",
    "DecodeParams",
    "DecodeTuning",
    "check_impl",
    "current_device_kind",
    "decode_attention",
    "decode_attention_partials",
    "decode_attention_partials_reference",
    "decode_attention_partials_tpu",
    "decode_attention_reference",
    "decode_attention_tpu",
    "decode_params",
    "get_decode_attention",
    "get_decode_partials",
    "get_layout_pin",
    "get_quant_decode_partials",
    "get_window_mass",
    "pin_layout",
    "quant_decode_partials",
    "quant_decode_partials_tpu",
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


def get_decode_partials(impl: str = "auto", **kernel_options) -> Callable:
    """f(q, k, v, pos, length, layer=None) -> (acc, m, l) for `impl`: the unnormalized partials of decode attention
    over a 16-bit segment (`decode_attention_partials_reference` and its kernels), float32, acc [batch, kv_heads,
    group, head_dim], m and l [batch, kv_heads, group]; arguments as `get_decode_attention`'s. Under a mesh each
    device runs the kernel on its own rows ("data") and kv heads ("model")."""

    def bind(fn: Callable, **fixed) -> Callable:
        def call(q, k, v, pos, length, *layer):
            return fn(q, k, v, pos, length, layer=layer[0] if layer else None, **fixed, **kernel_options)

        return call

    def reference(q, k, v, pos, length, layer=None, **options):  # the reference takes its own options only
        keep = {name: options[name] for name in ("block_size", "scale") if options.get(name) is not None}
        return decode_attention_partials_reference(q, k, v, pos, length, layer=layer, **keep)

    chosen = select(
        impl,
        xla=bind(reference),
        triton=lambda interpret: bind(decode_attention_partials, interpret=interpret),
        tpu=lambda interpret: bind(decode_attention_partials_tpu, interpret=interpret),
    )

    def attend(q, k, v, pos, length, layer=None):
        args = (q, k, v, pos, length) + (() if layer is None else (layer,))
        if impl == "xla":
            return chosen(*args)
        kv = P(*((None,) if layer is not None else ()), "data", "model")  # [(layers,) batch, kv_heads, slots, ...]
        lengths = P("data") if jnp.ndim(length) else P()
        specs = (_ROWS_HEADS, kv, kv, kv, lengths) + (() if layer is None else (P(),))
        return per_device(chosen, specs, (_ROWS_HEADS,) * 3)(*args)

    return attend


def get_quant_decode_partials(impl: str = "auto", *, reference: Callable, **kernel_options) -> Callable:
    """f(q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos, length, layer=None) -> (acc, m, l) for `impl`:
    the partials over a quantized segment (`quant_decode_partials`' arguments and result; `kernel_options` must hold
    `key_bits` and `value_bits`, and may hold launch parameters, `block_size` and `scale`). "xla" is `reference`,
    the pure-JAX partials with the same signature, called with `kernel_options` (the library passes
    `vase_jax.quant_attention.quantized_partials_of_arrays`: this package imports nothing from it). Under a mesh
    each device runs the kernel on its own rows ("data") and kv heads ("model")."""
    for name in ("key_bits", "value_bits"):
        if name not in kernel_options:
            raise ValueError(f"get_quant_decode_partials needs {name}= (8 or 4) among its options")

    def bind(fn: Callable, **fixed) -> Callable:
        def call(q, kc, ks, kl, vc, vs, vl, pos, length, *layer):
            return fn(q, kc, ks, kl, vc, vs, vl, pos, length, layer=layer[0] if layer else None, **fixed,
                      **kernel_options)

        return call

    chosen = select(
        impl,
        xla=bind(reference),
        triton=lambda interpret: bind(quant_decode_partials, interpret=interpret),
        tpu=lambda interpret: bind(quant_decode_partials_tpu, interpret=interpret),
    )

    def attend(q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos, length, layer=None):
        args = (q, k_codes, k_scale, k_low, v_codes, v_scale, v_low, pos, length) + (() if layer is None else (layer,))
        if impl == "xla":
            return chosen(*args)
        kv = P(*((None,) if layer is not None else ()), "data", "model")  # [(layers,) batch, kv_heads, slots, ...]
        lengths = P("data") if jnp.ndim(length) else P()
        specs = (_ROWS_HEADS,) + (kv,) * 7 + (lengths,) + (() if layer is None else (P(),))
        return per_device(chosen, specs, (_ROWS_HEADS,) * 3)(*args)

    return attend


_ROWS_HEADS = P("data", "model")  # [batch, kv_heads, ...]: q, acc, m and l


def get_layout_pin(impl: str = "auto") -> Callable:
    """f(x) -> x for `impl`: on TPU (and "pallas_tpu" in interpret mode) `tpu_common.pin_layout`, which holds x in
    the layout the Mosaic kernels read; elsewhere the identity (XLA:CPU and XLA:GPU keep one layout per array)."""

    def same(x):
        return x

    return select(impl, xla=same, triton=lambda _: same,
                  tpu=lambda interpret: functools.partial(pin_layout, interpret=interpret))


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
