"""`jax.jit` with per-backend XLA options, for the programs that hold a decode loop.

On CPU, XLA's while-loop invariant code motion hoists a loop-invariant conversion of a weight out of the loop and
materializes it: the float32 copy that XLA:CPU makes to gather from a bfloat16 table, or the uint16 view the
model reads 16-bit stacks through (`vase_jax.cache.as_bits`). Left in the loop, the conversion fuses into the
gather or slice that reads it and costs nothing; hoisted, it is a copy of the weight held for the whole call.
Temporaries of the 4-layer Qwen3-0.6B-shaped bf16 `generate` program (417 MiB of weights), pass on -> off: 590 ->
173 MiB with the layer loop switched, 470 -> 53 MiB scanned; float32 is unchanged (333 / 93 MiB). The weights
are sliced before the decode loop by the code itself; what else is loop-invariant is small (RoPE frequencies,
iotas, masks: on the `small` model an eviction event took 12-14 ms with the pass off, 9-12 ms with it on, within
the noise of the machine). GPU and TPU keep XLA's defaults.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def compiler_options(backend: str | None = None, sharded: bool = False) -> dict[str, Any] | None:
    """The XLA options of a decode program on `backend` (default: JAX's default backend). A program sharded over
    a mesh keeps XLA's defaults: there the pass also hoists the loop-invariant collectives that the SPMD
    partitioner inserts (an all-gather of the vocabulary-sharded embedding table), which would otherwise run at
    every step."""
    return dict(CPU_COMPILER_OPTIONS) if (backend or jax.default_backend()) == "cpu" and not sharded else None


class backend_jit:  # noqa: N801 (used as a decorator, like jax.jit)
    """`jax.jit(fun, **jit_kwargs)` compiled with the `compiler_options` of the backend it runs on, and of
    whether positional argument `mesh_argnum` (a mesh or None) shards it. Both are looked up per call, not at
    import (importing must not start a JAX backend before `jax.distributed.initialize`). `lower` and `trace`
    take the same arguments as a call; `_cache_size` counts the compiled programs of every variant. Called while
    another function is being traced (inside a user's `jax.jit`), it is a plain nested `jax.jit`."""

    def __init__(self, fun, *, mesh_argnum: int | None = None, **jit_kwargs):
        functools.update_wrapper(self, fun)
        self._fun = fun
        self._mesh_argnum = mesh_argnum
        self._jit_kwargs = jit_kwargs
        self._jits: dict[tuple[str, bool, bool], Any] = {}

    def _jitted(self, args: tuple):
        i = self._mesh_argnum
        nested = _tracing(args)
        key = (jax.default_backend(), i is not None and len(args) > i and args[i] is not None, nested)
        if key not in self._jits:
            # Inside another jit, XLA options belong to the outer one (jax refuses them on a nested jit): the
            # caller's program compiles with its own, e.g. `jax.jit(f, compiler_options=compiler_options())`.
            options = None if nested else compiler_options(*key[:2])
            self._jits[key] = jax.jit(self._fun, compiler_options=options, **self._jit_kwargs)
        return self._jits[key]

    def __call__(self, *args, **kwargs):
        return self._jitted(args)(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jitted(args).lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._jitted(args).trace(*args, **kwargs)

    def _cache_size(self) -> int:
        return sum(j._cache_size() for j in self._jits.values())


def _tracing(args: tuple) -> bool:
    """Whether this call happens while JAX traces a function (a nested call)."""
    try:
        from jax._src.core import trace_state_clean
    except ImportError:  # not in this jax: look for tracers among the arguments instead
        return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
    return not trace_state_clean()
