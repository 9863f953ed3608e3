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

Compiled programs also cost memory mappings: XLA:CPU loads each kernel of a program as its own small object, three
mappings apiece (code, read-only data, data), and keeps them while JAX caches the program: a `generate` program of
the 36-layer Qwen3-4B shape holds 454 (full) to 565 (vase_dkv) scanned, 892 to 991 switched. Linux refuses a
process more than `vm.max_map_count` mappings (65530 by default), and XLA then crashes inside a later compile (a
segfault or an abort, no Python error): after 70 to 140 cached programs in one process, which an eval over many
methods, budgets and prompt buckets reaches, and a test worker did.
`backend_jit` therefore checks the process's mappings after each compile and, past half the limit, clears JAX's
caches (`release_programs_near_mapping_limit`), with a warning.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax

# past this share of `vm.max_map_count`, `backend_jit` clears JAX's compiled-program caches (see above)
MAPPING_SHARE = 0.5

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
    take the same arguments as a call; `_cache_size` counts the programs calls compiled, of every variant.
    After a call that compiled, `release_programs_near_mapping_limit` runs. Called while
    another function is being traced (inside a user's `jax.jit`), it is a plain nested `jax.jit`."""

    def __init__(self, fun, *, mesh_argnum: int | None = None, **jit_kwargs):
        functools.update_wrapper(self, fun)
        self._fun = fun
        self._mesh_argnum = mesh_argnum
        self._jit_kwargs = jit_kwargs
        self._jits: dict[tuple[str, bool, bool], Any] = {}
        self._compiled = 0

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
        jitted = self._jitted(args)
        before = jitted._cache_size()
        out = jitted(*args, **kwargs)
        new = jitted._cache_size() - before
        if new > 0:  # a compile (never inside a user's jit: there the outer program compiles)
            self._compiled += new
            release_programs_near_mapping_limit()
        return out

    def lower(self, *args, **kwargs):
        return self._jitted(args).lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._jitted(args).trace(*args, **kwargs)

    def _cache_size(self) -> int:
        """Programs compiled by calls so far (like `jax.jit`'s, but not reset when caches are cleared)."""
        return self._compiled


def _tracing(args: tuple) -> bool:
    """Whether this call happens while JAX traces a function (a nested call)."""
    try:
        from jax._src.core import trace_state_clean
    except ImportError:  # not in this jax: look for tracers among the arguments instead
        return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
    return not trace_state_clean()


def release_programs_near_mapping_limit(share: float | None = None) -> bool:
    """Clear JAX's caches of compiled programs (`jax.clear_caches()`, every function's, with a warning) when this
    process holds more than `share` of the memory mappings Linux allows it (`vm.max_map_count`), before XLA:CPU
    crashes at the limit (module docstring). A cleared program compiles again at its next call. Returns whether it
    cleared; False where /proc says nothing (not Linux). `share` defaults to `MAPPING_SHARE`."""
    share = MAPPING_SHARE if share is None else share
    count, limit = mapping_count(), mapping_limit()
    if count is None or limit is None or count <= share * limit:
        return False
    warnings.warn(f"this process holds {count} memory mappings, over {share:.0%} of vm.max_map_count={limit}; "
                  "XLA:CPU keeps about 3 per kernel of every compiled program and crashes at the limit, so JAX's "
                  "compiled-program caches are cleared now (jax.clear_caches()): programs compile again when next "
                  "called. Raising the limit (sysctl -w vm.max_map_count=262144) avoids the recompiles.",
                  RuntimeWarning, stacklevel=3)
    jax.clear_caches()
    return True


def mapping_count() -> int | None:
    """The memory mappings this process holds (lines of /proc/self/maps); None where there is no such file."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def mapping_limit() -> int | None:
    """`vm.max_map_count`, the most memory mappings Linux allows a process; None where it cannot be read."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None
