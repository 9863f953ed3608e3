"""Several processes (hosts) running one program over a global mesh: `jax.distributed` plus the few helpers the
evaluation runner needs.

Every process runs the same command. Each holds the same host data (prompts, row ids: they are computed the same
way everywhere) and puts its devices' part of it onto the global mesh (`put_rows`); outputs sharded over the
mesh come back to every process whole (`fetch`). Files are written by one process (`is_writer`); what is already
done is decided by that process and sent to all (`agree`), so every process runs the same calls in the same
order, which the collectives of a multi-process program require.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec


def check_args(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """ValueError for inconsistent multi-process flags; True when this is a multi-process run (flags, or the
    coordinator address in the environment)."""
    given = [n for n, v in (("--coordinator", coordinator), ("--num-processes", num_processes),
                            ("--process-id", process_id)) if v is not None]
    if given and len(given) != 3:
        missing = sorted({"--coordinator", "--num-processes", "--process-id"} - set(given))
        raise ValueError(f"{', '.join(given)} given without {', '.join(missing)}: a multi-process run needs all three "
                         "(or none, with the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID "
                         "variables or a cluster jax.distributed detects)")
    if not given:
        return bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))
    host, sep, port = str(coordinator).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--coordinator={coordinator!r} must be HOST:PORT")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"--num-processes={num_processes!r} must be a positive integer")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id={process_id!r} is out of range: allowed 0..{num_processes - 1} "
                         f"for --num-processes={num_processes}")
    return True


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """`jax.distributed.initialize` (before any other JAX call). On CPU hosts the collectives go over gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU backend reads it
    if coordinator is None:
        jax.distributed.initialize()  # the environment variables or the cluster's own discovery
    else:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def is_writer() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


def put_rows(mesh, *arrays: np.ndarray) -> tuple[jax.Array, ...]:
    """Host arrays [batch, ...] (the same on every process) -> global arrays with rows over `data`, each process
    filling only its own devices' rows."""
    out = []
    for x in arrays:
        x = np.asarray(x)
        spec = PartitionSpec("data" if "data" in mesh.axis_names else None)
        out.append(jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx, x=x: x[idx]))
    return tuple(out)


def fetch(tree):
    """Every array of `tree` whole, on the host of every process. An array sharded over processes (rows over
    `data`) is assembled with one all-reduce (`_replicate`), a collective every backend has."""
    if jax.process_count() == 1:
        return jax.device_get(tree)

    def whole(x):
        if not isinstance(x, jax.Array) or x.is_fully_replicated:
            return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)
        return np.asarray(_replicate(x).addressable_data(0))

    return jax.tree.map(whole, tree)


def _replicate(x: jax.Array) -> jax.Array:
    """A copy of `x` (rows sharded over "data", other axes replicated) on every device: each device writes its
    rows into zeros of the full shape and a sum over "data" adds them up."""
    mesh, spec = x.sharding.mesh, tuple(x.sharding.spec)
    if spec[:1] != ("data",) or any(a is not None for a in spec[1:]):
        raise ValueError(f"fetch: only arrays with rows over 'data' can be gathered, not {spec}")
    dtype = x.dtype

    def body(local):
        rows = local.shape[0]
        summed = jnp.int32 if dtype == jnp.bool_ else dtype
        full = jnp.zeros((rows * jax.lax.axis_size("data"),) + local.shape[1:], summed)
        full = jax.lax.dynamic_update_slice_in_dim(full, local.astype(full.dtype), jax.lax.axis_index("data") * rows,
                                                   axis=0)
        return jax.lax.psum(full, "data").astype(dtype)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec(),
                                 check_vma=False))(x)


def agree(flags: Sequence[bool]) -> list[bool]:
    """The writer's `flags` on every process (a no-op with one process)."""
    if jax.process_count() == 1:
        return list(flags)
    values = multihost_utils.broadcast_one_to_all(np.asarray(flags, np.bool_))
    return [bool(v) for v in np.asarray(values)]
