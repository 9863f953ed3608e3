"""Choosing between the Pallas kernels and their pure-JAX (XLA) twins.

`impl="auto"` means Pallas on a GPU and XLA elsewhere. A Pallas kernel asked for on a machine without a GPU
runs in interpret mode (slow, exact: that is how the CPU tests exercise the kernels). The Triton compiler
parameters are built here so that every kernel states its GPU lowering explicitly: the default lowering of
`pl.pallas_call` on GPU differs between jax releases (Mosaic GPU in 0.10.x, Triton later), and passing Triton
`CompilerParams` selects the Triton lowering on every release that has it.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as plgpu

IMPLS = ("auto", "xla", "pallas")


def resolve_impl(impl: str) -> str:
    """ "auto" -> "pallas" on a GPU backend, else "xla"; "xla" and "pallas" pass through."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not a known implementation; allowed: {', '.join(IMPLS)}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def resolve_interpret(impl: str, interpret: bool | None = None) -> bool:
    """Whether a Pallas kernel runs in interpret mode: True for "pallas" off GPU, unless given explicitly."""
    resolved = resolve_impl(impl)
    if interpret is not None:
        return bool(interpret)
    return resolved == "pallas" and jax.default_backend() != "gpu"


def triton_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Triton compiler parameters; passing them makes `pallas_call` lower through Triton on every release."""
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"num_warps={num_warps} must be a power of two >= 1")
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1). Triton needs power-of-two sizes for the arrays in a kernel."""
    return 1 << max(0, int(n) - 1).bit_length()


def is_power_of_2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)
