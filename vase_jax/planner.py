"""Per-device memory of a `generate` run on a mesh, before renting the devices (`scripts/plan.py`).

    weights     = sum over parameters of the bytes of one device's shard (`sharding.param_specs`)
    cache       = sum over cache arrays of one device's shard (`sharding.cache_specs` of `jax.eval_shape`)
    temporaries = `Compiled.memory_analysis().temp_size_in_bytes` of the whole `generate` program compiled for
                  the mesh by its devices' own compiler: an H200's or a TPU v5p's without the device
                  (`vase_jax.aot` topologies), or XLA:CPU's on simulated host devices

Nothing is allocated: the model is abstract (`ShapeDtypeStruct`s with their shardings). The program is the one
the mesh's platform runs (`vase_jax.target`: its layer loop, cache storage and kernels); weights and cache are
exact, the temporaries are that compiler's buffer assignment.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from vase_jax.cache import init_cache
from vase_jax.config import Qwen3Config
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import GenerateConfig, _generate, query_window
from vase_jax.model import Qwen3
from vase_jax.sharding import cache_specs, check_mesh, param_specs, per_device_bytes, spec_for
from vase_jax.target import Target, platform_of


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    weights: int  # bytes per device
    cache: int
    temporaries: int  # None when not compiled
    arguments: int  # the compiled program's inputs per device (weights, prompt ids, ...)
    outputs: int
    capacity: int  # cache slots

    @property
    def total(self) -> int:
        """Peak estimate per device: arguments (weights included) + outputs + temporaries (the cache lives in the
        temporaries: `generate` creates it inside the program)."""
        return self.arguments + self.outputs + (self.temporaries or 0)


def plan_memory(cfg: Qwen3Config, mesh: jax.sharding.Mesh, batch: int, eviction: EvictionConfig, *,
                prompt_len: int = 1024, max_new_tokens: int = 32768, dtype=jnp.bfloat16,
                compile_program: bool = True) -> MemoryPlan:
    """Bytes per device of weights, cache and (compiled) temporaries for `generate` on `mesh`."""
    check_mesh(cfg, mesh, batch)
    eviction.validate()
    shape = dict(mesh.shape)
    target = Target.make(platform_of(mesh.devices.flat[0]))
    config = GenerateConfig(max_new_tokens=max_new_tokens, platform=target.platform)
    t = config.bucket(prompt_len)
    capacity = framework.capacity_for(eviction, t, max_new_tokens)
    specs = param_specs(cfg, mesh)
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    params = nnx.to_flat_state(nnx.state(abstract))
    weights = sum(per_device_bytes(v.shape, v.dtype, specs[p], shape) for p, v in params)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, capacity, query_window(eviction), dtype,
                                              framework.slot_state(eviction), target))
    cspecs = cache_specs(cache, mesh)
    cache_bytes = sum(per_device_bytes(x.shape, x.dtype, s, shape) for x, s in
                      zip(jax.tree.leaves(cache), jax.tree.leaves(cspecs, is_leaf=lambda s: isinstance(
                          s, jax.sharding.PartitionSpec)), strict=True))
    if not compile_program:
        return MemoryPlan(weights, cache_bytes, None, 0, 0, capacity)

    def sharded(x, spec):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    graphdef, state = nnx.split(abstract)
    flat = [(p, v.replace(sharded(v, specs[p]))) for p, v in nnx.to_flat_state(state)]
    state = nnx.from_flat_state(flat)
    ids = sharded(jax.ShapeDtypeStruct((batch, t), jnp.int32), spec_for(("batch", "seq"), mesh))
    rows = sharded(jax.ShapeDtypeStruct((batch,), jnp.int32), spec_for(("batch",), mesh))
    caps = sharded(jax.ShapeDtypeStruct((batch,), jnp.int32), spec_for(("batch",), mesh))  # per-row token caps
    compiled = _generate.lower(graphdef, state, ids, ids, jax.random.key(0), rows, caps, config, eviction, capacity,
                               target, mesh).compile()
    m = compiled.memory_analysis()
    return MemoryPlan(weights, cache_bytes, int(m.temp_size_in_bytes), int(m.argument_size_in_bytes),
                      int(m.output_size_in_bytes), capacity)
