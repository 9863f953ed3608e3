"""Compile `generate` for a GPU or TPU that is not attached: XLA:GPU for an NVIDIA H200 and XLA:TPU for a TPU v5p
really compile on a CPU host (Triton and Mosaic kernels included), so the program a device would run, its fusions
and its memory plan (`Compiled.memory_analysis()`) can be checked before any device is rented.

Each target needs its JAX plugin, in the installed jax's version: `pip install "jax[cuda13-local]==<jax>"` for
the H200 (0.4 GB: the plugin without the CUDA libraries, which compiling does not need; its cuPTI check needs a
driver, so the environment must hold CUDA_VISIBLE_DEVICES=-1 and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax
starts: `deviceless_environment`), `pip install "jax[tpu]==<jax>"` for the v5p (about 0.7 GB).
`missing(name)` says why a target cannot compile here, or None.

The arguments are abstract: weights, prompts and keys are `ShapeDtypeStruct`s placed on the target's topology
(one device), so nothing is allocated whatever the model's size.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import importlib.util
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vase_jax.cache import CacheLayout, cache_bytes
from vase_jax.config import Qwen3Config, param_shapes
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import GenerateConfig, cache_layout, generate_program, generate_target, query_window
from vase_jax.kvquant import KVBits
from vase_jax.model import Qwen3
from vase_jax.sampling import typed_key
from vase_jax.target import Target
from vase_jax.tiers import TierLayout


@dataclasses.dataclass(frozen=True)
class DevicelessTarget:
    """A device that XLA compiles for without it: its platform, the plugin module that compiles for it, and how
    to describe its topology."""

    name: str
    platform: str  # "cuda" or "tpu" (`vase_jax.target.PLATFORMS`)
    plugin: str  # the module of the JAX plugin that carries the compiler
    package: str  # what to pip install (with "==<jax version>")
    topologies: tuple[str, ...]  # topology descriptions, smallest first

    def devices(self, count: int = 1) -> list:
        """`count` of the target's devices, from a topology description (no device needed)."""
        for topology in self.topologies:
            devices = list(_topology(self.name, topology).devices)
            if len(devices) >= count:
                return devices[:count]
        raise ValueError(f"{self.name}: {count} devices; at most {len(devices)} are described here")


TARGETS = {
    "h200": DevicelessTarget("h200", "cuda", "jax_cuda13_plugin", "jax[cuda13-local]", ("1x1x1", "1x1x8")),
    "v5p": DevicelessTarget("v5p", "tpu", "libtpu", "jax[tpu]", ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x4x4")),
}
ENVIRONMENT = {"CUDA_VISIBLE_DEVICES": "-1", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


def deviceless_environment() -> dict[str, str]:
    """The environment variables a process needs, set before jax starts, to compile for the H200 without a GPU."""
    return dict(ENVIRONMENT)


def missing(name: str) -> str | None:
    """Why target `name` cannot compile here (its plugin is not installed), or None when it can."""
    target = TARGETS[name]
    if importlib.util.find_spec(target.plugin) is None:
        return (f"{name}: the {target.plugin} plugin is not installed (pip install "
                f"\"{target.package}=={jax.__version__}\")")
    return None


@functools.cache
def _topology(name: str, topology: str):
    if TARGETS[name].platform == "cuda":
        config = importlib.resources.files("vase_jax").joinpath("data", "aot", "h200_target_config.txtpb").read_text()
        return topologies.get_topology_desc(platform="cuda", target_config=config, topology=topology)
    return topologies.get_topology_desc(platform="tpu", topology_name=topology)


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """What a compiler made of one `generate` program: bytes of its memory plan, the instructions that slice or
    copy a layer weight (inside the decode loop: a copy at every step), and second buffers of the embedding table
    or of the cache."""

    target: str
    device_kind: str
    temporaries: int
    arguments: int
    outputs: int
    weights: int  # the model's parameters
    cache: int  # the KV cache the program creates (part of the temporaries)
    one_layer: int  # one decoder layer's weights
    weight_slices: tuple[str, ...]
    embedding_copies: tuple[str, ...]
    cache_copies: tuple[str, ...]
    compile_s: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def compile_generate(name: str, cfg: Qwen3Config, *, batch: int, eviction: EvictionConfig, prompt_len: int = 256,
                     max_new_tokens: int = 4096, dtype=jnp.bfloat16, layer_loop: str = "auto",
                     attention_impl: str = "auto", kv_bits: str = "bf16", kv_protected: int | None = None,
                     prefill_chunk: int | None = GenerateConfig.prefill_chunk,
                     ) -> tuple[jax.stages.Compiled, ProgramReport]:
    """`generate` for `cfg` compiled by target `name`'s own compiler on one of its devices (`TARGETS`), with
    abstract arguments; `kv_bits` (a `KVBits` name) and `kv_protected`: a mixed-precision cache;
    `prefill_chunk`: `GenerateConfig.prefill_chunk`. Returns the compiled program and its `ProgramReport`."""
    reason = missing(name)
    if reason:
        raise RuntimeError(reason)
    device = TARGETS[name].devices()[0]
    mesh = Mesh(np.array([device]), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    kv = KVBits.parse(kv_bits)
    config = GenerateConfig(max_new_tokens=max_new_tokens, layer_loop=layer_loop, attention_impl=attention_impl,
                            platform=TARGETS[name].platform, key_bits=kv.key_bits, value_bits=kv.value_bits,
                            kv_group=kv.key_group, kv_protected=kv_protected, prefill_chunk=prefill_chunk)
    model = abstract_model(cfg, dtype, replicated)
    target = generate_target(model, config)
    t = config.bucket(prompt_len)
    capacity = cache_layout(cfg, config, eviction, t)

    def arg(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=replicated)

    key = jax.eval_shape(lambda: typed_key(jax.random.key(0)))
    graphdef, state = nnx.split(model)
    args = (graphdef, state, arg((batch, t), jnp.int32), arg((batch, t), jnp.int32),
            jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated), arg((batch,), jnp.int32),
            arg((batch,), jnp.int32), config, eviction, capacity, target, None)
    start = time.perf_counter()
    compiled = generate_program.lower(*args).compile()
    seconds = time.perf_counter() - start
    return compiled, report(name, compiled, cfg, batch, eviction, capacity, dtype, target, seconds)


def abstract_model(cfg: Qwen3Config, dtype, sharding) -> Qwen3:
    """A `Qwen3` whose weights are `ShapeDtypeStruct`s placed with `sharding` (nothing allocated)."""
    model = nnx.eval_shape(lambda: Qwen3(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    flat = [(p, v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)))
            for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def report(name: str, compiled, cfg: Qwen3Config, batch: int, eviction: EvictionConfig,
           capacity: CacheLayout | TierLayout, dtype,
           target: Target, seconds: float) -> ProgramReport:
    """The `ProgramReport` of a compiled `generate` program."""
    memory = compiled.memory_analysis()
    itemsize = jnp.dtype(dtype).itemsize
    shapes = param_shapes(cfg)
    cache = jax.eval_shape(lambda: capacity.init(cfg, batch, query_window(eviction), dtype,
                                                 framework.slot_state(eviction), target))
    held = cache.kv_stacks
    text = compiled.as_text()
    layer_dims = {s for p, s in shapes.items() if p[0] == "layers" and len(s) > 1}
    return ProgramReport(
        target=name, device_kind=TARGETS[name].devices()[0].device_kind,
        temporaries=int(memory.temp_size_in_bytes), arguments=int(memory.argument_size_in_bytes),
        outputs=int(memory.output_size_in_bytes),
        weights=sum(math.prod(s) for s in shapes.values()) * itemsize, cache=cache_bytes(cache),
        one_layer=sum(math.prod(s) for p, s in shapes.items() if p[:2] == ("layers", 0)) * itemsize,
        weight_slices=tuple(copying_reads(text, layer_dims | {(cfg.num_layers,) + d for d in layer_dims})),
        embedding_copies=tuple(copies_of(text, {(cfg.vocab_size, cfg.hidden_size)})),
        cache_copies=tuple(copies_of(text, {tuple(x.shape) for x in held})), compile_s=seconds)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\](?:\{[^}]*\})? ([\w\-]+)\((.*)$")


def _instructions(hlo: str):
    """(computation, name, dims, opcode, operands text, line) of every instruction of an optimized HLO text."""
    computation = None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if header:
            computation = header.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if m:
            yield computation, m.group(1), tuple(int(d) for d in m.group(3).split(",") if d), m.group(4), \
                m.group(5), line.strip()


def copying_reads(hlo: str, operand_dims: set[tuple[int, ...]],
                  opcodes: tuple[str, ...] = ("slice", "dynamic-slice", "copy")) -> list[str]:
    """Instructions of an optimized HLO program, in any computation (loop bodies, branches and fusions included),
    that slice, dynamic-slice or copy an operand with one of `operand_dims`: a weight (say) copied, per iteration
    inside a loop or per call outside. Operands are looked up by name in their own computation; a fusion's
    parameter has the dims of what the fusion reads, so the slices XLA:GPU fuses (`loop_dynamic_slice_fusion`)
    are found inside their fused computations."""
    rows = list(_instructions(hlo))
    dims = {(computation, name): d for computation, name, d, _, _, _ in rows}
    found = []
    for computation, _, _, opcode, operands, line in rows:
        first = re.match(r"\s*%?([\w.\-]+)", operands)
        if opcode in opcodes and first and dims.get((computation, first.group(1))) in operand_dims:
            found.append(f"{computation}: {line[:200]}")
    return found


def copies_of(hlo: str, array_dims: set[tuple[int, ...]]) -> list[str]:
    """Instructions whose result has one of `array_dims` and that copy or convert it (copy, convert, or a fusion
    named for a copy or convert): a second buffer of that array. A copy of a broadcast is not one: it fills the
    array's own buffer with a constant (the empty cache a chunked prefill then writes into)."""
    return [f"{c}: {line[:200]}" for c, name, d, opcode, operands, line in _instructions(hlo)
            if d in array_dims and not operands.lstrip("%").startswith("broadcast") and (
                opcode in ("copy", "convert") or (opcode == "fusion" and ("copy" in name or "convert" in name)))]
