"""Pallas GPU kernels for decode attention and eviction scoring, each with a pure-JAX `*_reference` twin.

`get_decode_attention(impl)` / `get_window_scores(impl)` return the function for `impl` in "auto" | "xla" |
"pallas" (auto: Pallas on GPU, XLA elsewhere; Pallas off GPU runs in interpret mode).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.dispatch import resolve_impl, resolve_interpret
from pallas_kernels.eviction_scores import (
    value_magnitude,
    value_magnitude_reference,
    window_scores,
    window_scores_reference,
)

__all__ = [
    "decode_attention",
    "decode_attention_reference",
    "get_decode_attention",
    "get_window_scores",
    "resolve_impl",
    "resolve_interpret",
    "value_magnitude",
    "value_magnitude_reference",
    "window_scores",
    "window_scores_reference",
]


def get_decode_attention(impl: str = "auto") -> Callable:
    """`decode_attention` (interpret mode off GPU) for "pallas", `decode_attention_reference` for "xla"."""
    if resolve_impl(impl) == "xla":
        return decode_attention_reference
    return functools.partial(decode_attention, interpret=resolve_interpret(impl))


def get_window_scores(impl: str = "auto") -> Callable:
    """`window_scores` (interpret mode off GPU) for "pallas", `window_scores_reference` for "xla"."""
    if resolve_impl(impl) == "xla":
        return window_scores_reference
    return functools.partial(window_scores, interpret=resolve_interpret(impl))
