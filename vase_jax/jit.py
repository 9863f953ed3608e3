"""`jax.jit` with the target's XLA options, for the programs that hold a decode loop; and the mapping-limit guard.

`target_jit` compiles a function with `Target.compiler_options` of the `Target` among its static arguments (on
CPU: while-loop invariant code motion off, `vase_jax.target`), and counts how often it is traced: a compile-once
check needs no private JAX counter.

Compiled programs also cost memory mappings: XLA:CPU loads each kernel of a program as its own small object, three
mappings apiece (code, read-only data, data), and keeps them while JAX caches the program: a `generate` program of
the 36-layer Qwen3-4B shape holds 450 to 1000. Linux refuses a process more than `vm.max_map_count` mappings
(65530 by default), and XLA then crashes inside a later compile (a segfault or an abort, no Python error): after
70 to 140 cached programs in one process, which an eval over many methods, budgets and prompt buckets reaches.
The library never clears JAX's caches on its own: after a compile past half the limit it warns, once per process;
`release_programs_near_mapping_limit` is the guard that scripts and the test suite call between their jobs.

Compiling once per machine: `enable_compilation_cache` turns on JAX's persistent compilation cache (compiled
programs written to a folder and loaded back by later processes). `scripts/eval.py` and `benchmarks/bench.py` enable it
by default, in `compilation_cache_dir()`; the library itself leaves JAX's settings as the user has them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from vase_jax.target import Target

# past this share of `vm.max_map_count`, the guard clears JAX's compiled-program caches (see above)
MAPPING_SHARE = 0.5
_warned = False
CACHE_ENV = "VASE_JAX_COMPILATION_CACHE"  # where the persistent compilation cache lives (`compilation_cache_dir`)
CACHE_MAX_BYTES = 4 << 30  # the cache's size cap; JAX evicts the least recently used programs beyond it
CACHE_MIN_COMPILE_SECONDS = 0.5  # programs that compile faster are not worth a file


class target_jit:  # noqa: N801 (used as a decorator, like jax.jit)
    """`jax.jit(fun, **jit_kwargs)` compiled with the XLA options of the `Target` passed as positional argument
    `target_argnum` (static), and of whether positional argument `mesh_argnum` (a mesh or None) shards it.
    `lower` and `trace` take the same arguments as a call. `traces` counts how often `fun` was traced (one per
    compiled program, whatever JAX's caches hold). Called while another function is traced (inside a user's
    `jax.jit`), it is a plain nested `jax.jit`: XLA options belong to the outer program."""

    def __init__(self, fun, *, target_argnum: int, mesh_argnum: int | None = None, **jit_kwargs):
        functools.update_wrapper(self, fun)
        self._target_argnum = target_argnum
        self._mesh_argnum = mesh_argnum
        self._jit_kwargs = jit_kwargs
        self._jits: dict[tuple, Any] = {}
        self.traces = 0

        @functools.wraps(fun)
        def counted(*args, **kwargs):
            self.traces += 1
            return fun(*args, **kwargs)

        self._fun = counted

    def _jitted(self, args: tuple):
        target: Target = args[self._target_argnum]
        i = self._mesh_argnum
        sharded = i is not None and len(args) > i and args[i] is not None
        nested = _tracing()
        key = (target, sharded, nested)
        if key not in self._jits:
            # jax refuses XLA options on a nested jit: the caller's program compiles with its own, e.g.
            # `jax.jit(f, compiler_options=target.compiler_options())`.
            options = None if nested else target.compiler_options(sharded)
            self._jits[key] = jax.jit(self._fun, compiler_options=options, **self._jit_kwargs)
        return self._jits[key]

    def __call__(self, *args, **kwargs):
        before = self.traces
        out = self._jitted(args)(*args, **kwargs)
        if self.traces > before:
            warn_near_mapping_limit()
        return out

    def lower(self, *args, **kwargs):
        return self._jitted(args).lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._jitted(args).trace(*args, **kwargs)


def _tracing() -> bool:
    """Whether JAX is tracing a function now (a call nested in a user's `jax.jit`): then even a new constant is
    a tracer."""
    return isinstance(jnp.zeros(()), jax.core.Tracer)


def near_mapping_limit(share: float | None = None) -> tuple[int, int] | None:
    """(mappings, limit) when this process holds more than `share` (default `MAPPING_SHARE`) of the memory
    mappings Linux allows it (`vm.max_map_count`), else None (also where /proc says nothing: not Linux)."""
    share = MAPPING_SHARE if share is None else share
    count, limit = mapping_count(), mapping_limit()
    if count is None or limit is None or count <= share * limit:
        return None
    return count, limit


def warn_near_mapping_limit() -> None:
    """Warn, once per process, when the process is past `MAPPING_SHARE` of the mapping limit (module docstring)."""
    global _warned
    near = None if _warned else near_mapping_limit()
    if near is None:
        return
    _warned = True
    warnings.warn(f"this process holds {near[0]} memory mappings, over {MAPPING_SHARE:.0%} of vm.max_map_count="
                  f"{near[1]}: XLA:CPU keeps about 3 per kernel of every compiled program and crashes at the limit. "
                  "Call vase_jax.jit.release_programs_near_mapping_limit() between jobs (it clears JAX's caches "
                  "there), or raise the limit (sysctl -w vm.max_map_count=262144).", RuntimeWarning, stacklevel=3)


def release_programs_near_mapping_limit(share: float | None = None) -> bool:
    """Clear JAX's caches of compiled programs (`jax.clear_caches()`, every function's, with a warning) when this
    process holds more than `share` of the memory mappings Linux allows it, before XLA:CPU crashes at the limit
    (module docstring). For scripts and test suites, between jobs; the library never calls it. A cleared program
    compiles again at its next call. Returns whether it cleared."""
    near = near_mapping_limit(share)
    if near is None:
        return False
    warnings.warn(f"this process holds {near[0]} memory mappings, over {MAPPING_SHARE if share is None else share:.0%}"
                  f" of vm.max_map_count={near[1]}; XLA:CPU keeps about 3 per kernel of every compiled program and "
                  "crashes at the limit, so JAX's compiled-program caches are cleared now (jax.clear_caches()): "
                  "programs compile again when next called. Raising the limit (sysctl -w "
                  "vm.max_map_count=262144) avoids the recompiles.", RuntimeWarning, stacklevel=2)
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


@functools.cache
def sources_digest() -> str:
    """A sha256 digest of the library's and the kernels' sources (vase_jax/ and pallas_kernels/, every .py file
    with its path): what a process keeps on disk from one version of the code (a probed `RowRule`, the test
    suite's compiled programs) is not reused by another."""
    digest = hashlib.sha256()
    for package in ("vase_jax", "pallas_kernels"):
        root = Path(__file__).resolve().parents[1] / package
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + path.read_bytes())
    return digest.hexdigest()


def host_cpu() -> dict[str, str | int]:
    """The host CPU as XLA:CPU compiles for it: /proc/cpuinfo's "model name" and instruction-set "flags" (Linux;
    elsewhere what `platform` knows, and no flags) and "cpus", the CPUs this process may use."""
    cpu = {"model name": platform.processor() or platform.machine(), "flags": ""}
    try:
        with open("/proc/cpuinfo") as fh:
            found = dict(line.split(":", 1) for line in fh if line.startswith(("model name", "flags")))
        cpu |= {key.strip(): value.strip() for key, value in found.items()}
    except OSError:
        pass
    return cpu | {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}


def compilation_cache_dir() -> Path:
    """Where the persistent compilation cache lives: $VASE_JAX_COMPILATION_CACHE, else
    $XDG_CACHE_HOME/vase-jax/xla, else ~/.cache/vase-jax/xla."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "vase-jax" / "xla"


def enable_compilation_cache(path: str | os.PathLike | None = None, max_bytes: int = CACHE_MAX_BYTES,
                             min_compile_seconds: float = CACHE_MIN_COMPILE_SECONDS) -> Path:
    """Turn on JAX's persistent compilation cache in `path` (default `compilation_cache_dir()`): every program
    that takes at least `min_compile_seconds` to compile is written there, keyed by its HLO, compiler options,
    backend and JAX version, and a later process with the same shapes loads it instead of compiling. At most
    `max_bytes` (least recently used programs go first). Call it before the first compile. Returns the folder."""
    folder = Path(path).expanduser() if path is not None else compilation_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", int(max_bytes))
    return folder

