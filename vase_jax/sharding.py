"""Sharding over a `("data", "model")` device mesh: one table from logical axis names to mesh axes.

Every parameter and cache array names its axes (`config.PARAM_AXES`, `cache.CACHE_AXES`, `cache.STATE_AXES`); a
`PartitionSpec` is the table `RULES` applied to those names:

    batch                          -> data    (data parallelism: rows of a batch)
    q_heads, kv_heads, mlp, vocab  -> model   (tensor parallelism: heads, MLP width, vocabulary)
    everything else (layers, embed, head_dim, slots, group, window) -> replicated

Heads split over `model` by whole kv heads: a device holds `kv_heads / model` kv heads and their query groups, so
attention and eviction (per row and kv head) need no communication. `model` must therefore divide the number of kv
heads (8 in every Qwen3 size, so model in {1, 2, 4, 8}); a larger `model`, or one that does not divide the kv heads,
the query heads, the MLP width or the vocabulary, is rejected with a ValueError (`check_mesh`): we do not replicate
kv heads. `data` must divide the batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from vase_jax.cache import STATE_AXES
from vase_jax.config import Qwen3Config, param_axes

MESH_AXES = ("data", "model")
RULES: dict[str, str] = {"batch": "data", "q_heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
MODEL_SHARDED = ("kv_heads", "q_heads", "mlp", "vocab")  # the config axes that `model` must divide


def parse_mesh(text: str) -> dict[str, int]:
    """"data=D,model=M" (either may be left out: size 1) -> {"data": D, "model": M}; ValueError on bad input."""
    sizes = {axis: 1 for axis in MESH_AXES}
    seen = set()
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in MESH_AXES:
            raise ValueError(f"mesh={text!r}: {part!r} is not AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)}")
        if name in seen:
            raise ValueError(f"mesh={text!r}: axis {name!r} given twice")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"mesh={text!r}: {name}={value.strip()!r} must be a positive integer")
        sizes[name] = size
        seen.add(name)
    return sizes


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A `("data", "model")` mesh of data x model devices (default: the first data * model of `jax.devices()`).
    Axes are `Auto`: the SPMD partitioner places whatever the shardings of the inputs leave open."""
    for name, size in (("data", data), ("model", model)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name}={size!r} must be a positive int")
    devices = list(jax.devices() if devices is None else devices)
    if data * model > len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices; {len(devices)} available")
    grid = np.array(devices[: data * model], dtype=object).reshape(data, model)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def spec_for(axes: Sequence[str], mesh: Mesh | None = None) -> PartitionSpec:
    """The `PartitionSpec` of an array whose axes are named `axes` (`RULES`; axes of size-1 mesh dims stay named:
    sharding over one device is replication)."""
    names = set(mesh.axis_names) if mesh is not None else set(MESH_AXES)
    return PartitionSpec(*(RULES[a] if RULES.get(a) in names else None for a in axes))


def check_mesh(cfg: Qwen3Config, mesh: Mesh, batch: int | None = None) -> None:
    """ValueError unless `model` divides every model-sharded axis of `cfg` and `data` divides `batch`."""
    shape = dict(mesh.shape)
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh axes {unknown} are not known; a mesh has axes {MESH_AXES}")
    model = shape.get("model", 1)
    sizes = cfg.axis_sizes()
    for axis in MODEL_SHARDED:
        if sizes[axis] % model:
            more = " (kv heads are never replicated: use model <= kv heads, a divisor)" if axis == "kv_heads" else ""
            raise ValueError(f"mesh model={model} does not divide {axis}={sizes[axis]}{more}")
    data = shape.get("data", 1)
    if batch is not None and batch % data:
        raise ValueError(f"mesh data={data} does not divide the batch of {batch} rows")


def param_specs(cfg: Qwen3Config, mesh: Mesh | None = None) -> dict[tuple, PartitionSpec]:
    """Parameter path (`config.param_axes`) -> PartitionSpec of every parameter of a `Qwen3(cfg)`."""
    return {path: spec_for(axes, mesh) for path, axes in param_axes(cfg).items()}


def param_shardings(cfg: Qwen3Config, mesh: Mesh) -> dict[tuple, NamedSharding]:
    """Parameter path -> NamedSharding of every parameter (after `check_mesh`), on `auto_axes(mesh)`."""
    check_mesh(cfg, mesh)
    mesh = auto_axes(mesh)
    return {path: NamedSharding(mesh, spec) for path, spec in param_specs(cfg, mesh).items()}


def auto_axes(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis `Auto`. `jax.make_mesh` makes `Explicit` axes (current JAX's
    default), under which every array's sharding is part of its type and `with_sharding_constraint` must agree with
    it; the model and `generate` place arrays through sharding constraints and leave the rest to the SPMD
    partitioner, so a mesh from `jax.make_mesh` runs exactly as one from `make_mesh`."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def put(x, sharding: NamedSharding) -> jax.Array:
    """`x` placed with `sharding`; with several processes, each fills only its own devices' shards from its copy
    of `x` (every process holds the same value)."""
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard_model(model, mesh: Mesh):
    """The model with every parameter placed by `param_shardings` (a copy; `generate` then runs on the mesh)."""
    shardings = param_shardings(model.cfg, mesh)
    graphdef, state = nnx.split(model)
    flat = [(path, var.replace(put(var[...], shardings[path]))) for path, var in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def cache_specs(cache, mesh: Mesh | None = None):
    """A pytree like `cache` (a `KVCache` or `TieredCache`, of arrays or `ShapeDtypeStruct`s) of PartitionSpecs.

    Derived from the axis names the cache gives (`cache.axes()`), not from a list of fields: a named array gets the
    rule of its names, every `state` array those of `STATE_AXES`, and any other array (scalar counters, or per-row
    fields a cache may add without naming their axes) is replicated.
    """
    axes = cache.axes()

    def spec(value, names):
        if getattr(value, "ndim", None) == len(names):
            return spec_for(names, mesh)
        return PartitionSpec()

    fields = {}
    for field in dataclasses.fields(cache):
        name, value = field.name, getattr(cache, field.name)
        if not field.metadata.get("pytree_node", True):  # static metadata (state_specs, dtype)
            continue
        if name == "state":
            fields[name] = {k: spec_for(STATE_AXES, mesh) for k in value}
        elif name in axes and isinstance(axes[name], tuple):
            fields[name] = spec(value, axes[name])
        elif name in axes:  # a nested field: its pytree of axis names
            fields[name] = jax.tree.map(spec, value, axes[name])
        elif hasattr(value, "shape"):
            fields[name] = PartitionSpec()
    return cache.replace(**fields)


def cache_shardings(cache, mesh: Mesh):
    """`cache_specs` as NamedShardings on `mesh`."""
    specs = cache_specs(cache, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def constrain_cache(cache, mesh: Mesh | None):
    """`with_sharding_constraint` of every cache array to its sharding (identity without a mesh)."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))


def constrain(x: jax.Array, axes: Sequence[str], mesh: Mesh | None) -> jax.Array:
    """`with_sharding_constraint` of an array whose axes are named `axes` (identity without a mesh)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(axes, mesh)))


def model_mesh(model) -> Mesh | None:
    """The mesh the model's parameters are sharded over, with `auto_axes` (None: single device / unsharded). All
    parameters must share one mesh."""
    meshes = {auto_axes(leaf.sharding.mesh) for leaf in jax.tree.leaves(nnx.state(model))
              if isinstance(getattr(leaf, "sharding", None), NamedSharding)}
    meshes = {m for m in meshes if math.prod(m.shape.values()) > 1}
    if len(meshes) > 1:
        raise ValueError(f"the model's parameters are on {len(meshes)} different meshes; use one (shard_model)")
    return meshes.pop() if meshes else None


def across_model(x: jax.Array, reduce) -> jax.Array:
    """`reduce(x, "model")` (e.g. `jax.lax.pmax`) inside a `shard_map` manual over "model" (the per-device
    eviction), where heads are split over devices; x itself elsewhere."""
    mesh = jax.sharding.get_abstract_mesh()
    return reduce(x, "model") if "model" in getattr(mesh, "manual_axes", ()) else x


def local_kv_heads(num_local: int) -> tuple[jax.Array, int]:
    """(global indices [num_local] int32 of the kv heads this code sees, the global number of kv heads).

    Outside `shard_map`: (arange(num_local), num_local). Inside a `shard_map` that is manual over "model" (the
    eviction runs per device, `framework.evict`), heads are split over "model" by `RULES`, so device i holds heads
    [i * num_local, (i + 1) * num_local). Random streams keyed by head index use this to draw the same numbers
    whatever the mesh.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if "model" not in getattr(mesh, "manual_axes", ()):
        return jnp.arange(num_local, dtype=jnp.int32), num_local
    size = dict(mesh.shape)["model"]
    offset = jax.lax.axis_index("model").astype(jnp.int32) * num_local
    return offset + jnp.arange(num_local, dtype=jnp.int32), num_local * size


def per_device_bytes(shape: Sequence[int], dtype, spec: PartitionSpec, mesh_shape: dict[str, int]) -> int:
    """Bytes one device holds of an array of `shape` sharded as `spec` over a mesh of `mesh_shape`."""
    n = np.dtype(dtype).itemsize
    for i, d in enumerate(shape):
        axis = spec[i] if i < len(spec) else None
        n *= -(-d // mesh_shape.get(axis, 1)) if axis else d
    return int(n)
