"""Choosing an implementation of an operation: per platform at lowering time, or explicitly.

Every operation with kernels (decode attention, the window-attention mass) has three implementations: the
Triton Pallas kernel (GPU), the Mosaic TPU Pallas kernel (TPU) and a pure-JAX twin (XLA, any platform). `impl`:

| impl | cuda | tpu | any other platform (cpu, rocm) |
|---|---|---|---|
| "auto" | Triton kernel | TPU kernel | XLA |
| "xla" | XLA | XLA | XLA |
| "pallas" | Triton kernel | TPU kernel | Triton kernel in interpret mode |
| "pallas_gpu" | Triton kernel | Triton kernel in interpret mode | Triton kernel in interpret mode |
| "pallas_tpu" | TPU kernel in TPU interpret mode | TPU kernel | TPU kernel in TPU interpret mode |

The platform is the one the program is *lowered* for, not the host: `select` stages every candidate branch with
`jax.lax.platform_dependent`, and lowering keeps the branch of the target platform. So a CPU host that lowers for
`("cuda",)` or `("tpu",)` (`jax.jit(f).trace(...).lower(lowering_platforms=...)`) gets that platform's kernels,
and outside `jit` the branch of the default backend runs. A Pallas call lowers for one platform only (Triton
compiler parameters are rejected by the TPU lowering), so a program that holds kernels is lowered for one
platform at a time.

The Triton compiler parameters are built here so that every kernel states its GPU lowering explicitly: the
default lowering of `pl.pallas_call` on GPU differs between jax releases (Mosaic GPU in 0.10.x, Triton later),
and passing Triton `CompilerParams` selects the Triton lowering on every release that has it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

IMPLS = ("auto", "xla", "pallas", "pallas_gpu", "pallas_tpu")


def check_impl(impl: str) -> str:
    """`impl` if it is one of IMPLS, else ValueError naming the allowed values."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not a known implementation; allowed: {', '.join(IMPLS)}")
    return impl


def tpu_interpret_params() -> pltpu.InterpretParams:
    """TPU interpret mode (CPU, TPU semantics): uninitialized VMEM reads NaN and out-of-bounds reads raise."""
    return pltpu.InterpretParams()


def select(
    impl: str,
    *,
    xla: Callable,
    triton: Callable[[bool], Callable],
    tpu: Callable[[Any], Callable],
) -> Callable:
    """The implementation of one operation for `impl` (module docstring's table).

    Args:
      xla: the pure-JAX implementation, `xla(*args)`.
      triton: `triton(interpret)` -> the Triton kernel function with `interpret` (bool) bound.
      tpu: `tpu(interpret)` -> the TPU kernel function with `interpret` (False or `pltpu.InterpretParams`) bound.
    Returns:
      f(*args) (positional array arguments only), which stages the branches with `lax.platform_dependent`.
    """
    check_impl(impl)
    if impl == "xla":
        return xla
    if impl == "auto":
        branches = dict(cuda=triton(False), tpu=tpu(False), default=xla)
    elif impl == "pallas":
        branches = dict(cuda=triton(False), tpu=tpu(False), default=triton(True))
    elif impl == "pallas_gpu":
        branches = dict(cuda=triton(False), default=triton(True))
    else:  # "pallas_tpu"
        branches = dict(tpu=tpu(False), default=tpu(tpu_interpret_params()))

    def run(*args):
        return lax.platform_dependent(*args, **branches)

    return run


def per_device(fn: Callable, in_specs: tuple, out_specs: Any) -> Callable:
    """`fn` run on each device's shard inside `shard_map` when a mesh is set for tracing
    (`jax.sharding.use_abstract_mesh`), else `fn` itself. A Pallas kernel is one custom call that the SPMD
    partitioner cannot split; inside `shard_map` every device runs it on its own rows and heads.

    Specs name mesh axes ("data", "model"); axes the current mesh does not have are dropped. The caller states that
    `fn` is local along those axes (no value depends on another shard).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:  # no mesh, or already per device (inside a `shard_map`)
        return fn
    names = set(mesh.axis_names)

    def keep(spec):
        return jax.sharding.PartitionSpec(*(a if a in names else None for a in spec))

    def keep_all(specs):  # a spec, or a pytree of them (a function of several outputs)
        return jax.tree.map(keep, specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))

    return jax.shard_map(fn, mesh=mesh, in_specs=keep_all(tuple(in_specs)), out_specs=keep_all(out_specs),
                         check_vma=False)


@contextlib.contextmanager
def lowering_target(platform: str, device_kind: str = "NVIDIA H200") -> Iterator[None]:
    """Trace *and* lower inside this context to lower for `platform` on a host without that device.

    From jax 0.11 the Triton lowering asks the GPU for its kind (to pick the compute capability); on a host
    without a GPU it reads an abstract device of the current abstract mesh instead. For `platform="cuda"` on such a
    host this installs an empty abstract mesh whose device is `device_kind`; otherwise (TPU, or a GPU present)
    it does nothing. jax 0.10 needs none of it and ignores it.
    """
    gpu_present = any(d.platform == "gpu" for d in jax.devices())
    if platform != "cuda" or gpu_present or not hasattr(jax.sharding, "AbstractDevice"):
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        yield


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


def pairwise_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in a fixed order (keepdims): zero-padded to a power of two d, then halves added
    elementwise, s = ((x[:d/2] + x[d/2:])[:d/4] + ...). The order is the same for every row whatever the array's
    shape. XLA:CPU vectorizes a reduce by the number of rows it holds (float32, jax 0.10.2, AMD EPYC: RMSNorm over
    head_dim in a prefill's [batch, heads, seq, head_dim] gave a row other bits in a batch of 8 than in 2, 4 or 6;
    the decode attention's softmax sums other bits at 2 rows than at 8); elementwise adds it computes one way, so
    the pure-JAX paths that promise batch invariance (`vase_jax.invariance`) sum with this."""
    d = x.shape[-1]
    width = next_power_of_2(d)
    if width != d:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - d)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x
