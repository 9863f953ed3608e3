"""`Target`: the platform a program is lowered for, and every choice that depends on it.

One small frozen object, built before tracing and passed down explicitly, decides what differs between backends;
nothing else asks JAX which backend is current while a program is traced. So `lower_generate(...,
platforms=("cuda",))` on a CPU host lowers exactly the program a GPU runs.

| choice | cpu | cuda, rocm | tpu |
|---|---|---|---|
| layer loop (`layer_loop="auto"`) | `switch` | `unroll` | `switch` |
| a 16-bit cache stored as | its bits (uint16) | itself | itself |
| a batch of fewer rows than `RowRule.min_rows` | runs beside copies of its first row | the same | the same |
| a lone row of a 16-bit model (batch invariance off) | runs beside a copy (speed) | alone | alone |
| the prompt's keys and values | written as they are | written as they are | laid out row-major first |
| XLA options of decode programs | invariant code motion off | defaults | defaults |
| a 16-bit matmul's result | float32, then cast | written in 16 bits by the dot | written in 16 bits by the dot |
| sampling | one row at a time | the batch at once | the batch at once |

Three places act on it, and model.py and generate.py name no platform: the cache's storage (`vase_jax.cache`), the
batch's rows (`generate`'s padding, from `RowRule` and `min_rows`), and the properties below that a matmul, the
layer loop and the sampler read (`dot_writes_result`, `layer_loop`, `rowwise_sampling`).

The layer loop is each compiler's better one: on XLA:TPU (deviceless compiles of Qwen3-8B's shape, 36 layers)
`switch` compiles in a third of the time of `unroll` and holds half the temporaries; on GPUs `unroll`, since
XLA:GPU reads a conditional's branch index back to the host before it runs a branch (the device check times both).

Why, on XLA:CPU (docs/DESIGN.md has the measurements):
- `switch` (a scan over the layer index whose matmuls pick their layer's weight with `lax.switch`) keeps compile
  time flat in depth; `unroll` (a Python loop) compiles each layer on its own. Both read each weight where it lives.
- XLA:CPU has no bfloat16 dynamic-update-slice or gather: it converts the whole operand to float32 and back around
  each one-token cache write, or to gather rows of a bf16 table (jax 0.10.2: a bf16 [151936, 1024] table became an
  f32 copy, 3.0 against 1.6 ms a step through the bits). Through a same-width uint16 view the write and the gather
  touch only their rows (`storage`).
- A one-row matmul is a matrix-vector product there, whose float32 sums differ in the last bit from those of the
  multi-row kernel, and a 16-bit one is 5-8x slower (jax 0.10.2: [1, 1024] x [1024, 3072] 1.54 ms against 0.31 ms
  for two rows; the LM head 161 against 20 ms): a row's numbers must not depend on its batch's size, so
  `generate` pads small batches by the rule `vase_jax.invariance` measures, and never runs a lone row
  (`min_rows`). Reductions over a row's last axis that the invariance relies on (RMSNorm, the decode softmax's
  sum) are `pallas_kernels.dispatch.pairwise_sum`: XLA:CPU vectorizes a reduce by the number of rows it holds.
- A dot with a 16-bit result has its operands converted to float32 first (a float32 copy of the weight); with a
  float32 result it reads them as they are. Elsewhere the dot writes the 16-bit result from its float32
  accumulators (`model.matmuls`: XLA:GPU's prefill then holds no float32 copy of each MLP projection).
- XLA:CPU's library dot fusions do not beat that float32-result dot: the YNNPACK fusion
  (`xla_cpu_experimental_ynn_fusion_type`) runs a bf16-result dot 6x faster than XLA's, but the float32-result one
  1.6x slower, and `generate` at 0.67x (docs/BENCHMARKS.md); the options keep XLA's own dots.
- While-loop invariant code motion hoists the table's uint16 view out of the decode loop and materializes it (a
  copy of the embedding table held for the whole call).

On XLA:TPU, the prefill's keys and values come out of the projections with the head axis minor; written as they
are, the compiler builds the whole cache in that layout and copies it once into the decode loop's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
LAYER_LOOPS = ("unroll", "switch")
DEFAULT_LAYER_LOOP = {"cpu": "switch", "cuda": "unroll", "rocm": "unroll", "tpu": "switch"}
CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


@dataclasses.dataclass(frozen=True)
class Target:
    """What a program is lowered for: `platform` (one of `PLATFORMS`) and the decode `layer_loop` (one of
    `LAYER_LOOPS`). Frozen and hashable: a static argument of the programs it shapes."""

    platform: str
    layer_loop: str

    @classmethod
    def make(cls, platform: str, layer_loop: str = "auto") -> Target:
        """The target of `platform` ("gpu" is read as "cuda"); `layer_loop` "auto" takes the platform's default."""
        platform = "cuda" if platform == "gpu" else platform
        if platform not in PLATFORMS:
            raise ValueError(f"platform={platform!r}; allowed: {', '.join(PLATFORMS)}")
        if layer_loop == "auto":
            layer_loop = DEFAULT_LAYER_LOOP[platform]
        if layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop={layer_loop!r}; allowed: auto, {', '.join(LAYER_LOOPS)}")
        return cls(platform, layer_loop)

    @classmethod
    def of(cls, arrays: Any = None, platform: str | None = None, layer_loop: str = "auto") -> Target:
        """The target of a call: `platform` when given, else that of the devices holding `arrays` (a pytree),
        else, for abstract or traced arrays (which carry no device), JAX's default backend. A `platform` that
        disagrees with the devices of concrete `arrays` is a ValueError."""
        found = devices_platform(arrays)
        if platform is not None and found is not None and Target.make(platform).platform != found:
            raise ValueError(f"platform={platform!r}, but the arrays are on {found} devices")
        return cls.make(platform or found or jax.default_backend(), layer_loop)

    @property
    def cpu(self) -> bool:
        return self.platform == "cpu"

    def storage(self, dtype) -> jnp.dtype:
        """The dtype that an array of float `dtype` written or gathered a row at a time is held or read as (the
        cache, the embedding table's rows): uint16 bits of a 16-bit float on CPU, else `dtype` (on TPU a uint16
        view of the bf16 embedding table is a relayout: a copy of the table, 1.2 GiB at Qwen3-8B's)."""
        dtype = jnp.dtype(dtype)
        return jnp.dtype(jnp.uint16) if self.cpu and dtype.itemsize == 2 else dtype

    @property
    def pins_cache_layout(self) -> bool:
        """Write the prompt into the cache in row-major layout, explicitly (TPU; `vase_jax.cache.write_prompt`)."""
        return self.platform == "tpu"

    @property
    def dot_writes_result(self) -> bool:
        """A matmul's dot writes its 16-bit result itself, from its float32 accumulators (GPU, TPU). Not on CPU:
        XLA:CPU converts both operands of a dot with a 16-bit result to float32 (a float32 copy of the weight), so
        there the dot writes float32 and a cast follows (`model.matmuls`)."""
        return not self.cpu

    def min_rows(self, dtype) -> int:
        """The fewest rows a batch of a `dtype` model runs as, batch invariance or not: 2 for a 16-bit model on CPU,
        where a one-row matmul is a matrix-vector product, 5-8x slower than two rows (`generate` pads a lone row
        with a copy); else 1."""
        return 2 if self.cpu and jnp.dtype(dtype).itemsize == 2 else 1

    @property
    def rowwise_sampling(self) -> bool:
        """Sample one row at a time (`sampling.sample(rowwise=True)`): XLA:CPU's row sums depend on the rows."""
        return self.cpu

    def compiler_options(self, sharded: bool = False) -> dict[str, Any] | None:
        """XLA options of a program that holds a decode loop. A program sharded over a mesh keeps XLA's
        defaults: there the pass also hoists the loop-invariant collectives that the SPMD partitioner inserts (an
        all-gather of the vocabulary-sharded embedding table), which would otherwise run at every step."""
        return dict(CPU_COMPILER_OPTIONS) if self.cpu and not sharded else None


def devices_platform(arrays: Any) -> str | None:
    """The platform ("cpu", "cuda", "rocm", "tpu") of the devices holding the concrete arrays of a pytree; None
    when it holds none (abstract shapes, tracers, no arrays)."""
    for x in jax.tree.leaves(arrays):
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            return platform_of(next(iter(x.devices())))
    return None


def platform_of(device) -> str:
    """A device's platform as lowering names it: a GPU is "cuda" or "rocm"."""
    if device.platform != "gpu":
        return device.platform
    return "rocm" if "rocm" in str(getattr(device.client, "platform_version", "")).lower() else "cuda"
