"""The Triton decode kernel compiled deviceless for an NVIDIA H200 (XLA:GPU and Triton's own compiler on this host,
no GPU), so that every launch configuration a device run will use is known to compile first: shared memory,
layouts and the masked, overhanging reads and writes of the GQA group.

Compiled: every H200 row of `decode_tuning.TABLE` at batch 16 x 4096 slots and batch 128 x 2048 (the rule's split
counts: several splits and a merge, and one split without), and every launch the sweep tries
(`SWEEP_LAUNCHES`), with a stacked cache read by layer index; per-row and shared lengths, an explicit split count
that does not divide the blocks, and a block mask. The compiled program must hold the kernels and no copy or
slice of the stacked cache. Launch parameters come from the table through the abstract H200 that
`dispatch.lowering_target` installs (the device kind the kernel sees while tracing).

Marked `aot`; needs the H200's JAX plugin (`pip install "jax[cuda13-local]==<jax>"`, `vase_jax.aot`) and skips
without it. The suite's persistent compilation cache is off here: a deviceless program cannot be loaded from it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels import decode_tuning, dispatch
from pallas_kernels.decode_attention import decode_attention
from vase_jax import aot

pytestmark = [pytest.mark.aot, pytest.mark.usefixtures("no_persistent_cache"),
              pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")]

H200 = "NVIDIA H200"
LAYERS = 2
H200_ROWS = sorted((key for key in decode_tuning.TABLE if key[0] == H200), key=repr)



@functools.cache
def _sharding() -> NamedSharding:
    device = aot.TARGETS["h200"].devices()[0]
    return NamedSharding(Mesh(np.array([device]), ("data",)), PartitionSpec())


def _compile(batch: int, kv_heads: int, group: int, head_dim: int, capacity: int, dtype, *, per_row: bool = True,
             block_mask: bool = False, **options) -> str:
    """The optimized HLO of decode attention over layer `l` of a stacked cache, compiled for the H200."""
    reason = aot.missing("h200")
    if reason:
        pytest.skip(reason)

    def arg(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=_sharding())

    cache = (LAYERS, batch, kv_heads, capacity, head_dim)
    args = [arg((batch, kv_heads, group, head_dim), dtype), arg(cache, dtype), arg(cache, dtype),
            arg(cache[:-1], jnp.int32), arg((batch,) if per_row else (), jnp.int32), arg((), jnp.int32)]
    if block_mask:
        args.append(arg((batch, kv_heads, -(-capacity // options["block_size"])), jnp.bool_))

    def attend(q, k, v, pos, length, layer, mask=None):
        return decode_attention(q, k, v, pos, length, layer=layer, block_mask=mask, **options)

    with dispatch.lowering_target("cuda"):
        assert decode_tuning.current_device_kind() == H200
        text = jax.jit(attend).lower(*args).compile().as_text()
    assert "vase_decode_attention" in text
    dims = {cache, cache[:-1]}
    assert aot.copies_of(text, dims) == [] and aot.copying_reads(text, dims) == []
    return text


def _merged(text: str) -> bool:
    return "vase_decode_attention_merge" in text


@pytest.mark.parametrize("batch,capacity", [(16, 4096), (128, 2048)])
@pytest.mark.parametrize("key", H200_ROWS, ids=lambda k: f"g{k[2]}-{k[3]}")
def test_table_rows_compile(key, batch, capacity):
    _, head_dim, group, dtype = key
    group = group or 8  # a row for any group: Qwen3-32B's
    params = decode_tuning.decode_params(batch=batch, kv_heads=8, group=group, head_dim=head_dim,
                                         capacity=capacity, dtype=dtype, device_kind=H200)
    text = _compile(batch, 8, group, head_dim, capacity, jnp.dtype(dtype))
    assert _merged(text) == (params.num_splits > 1)


@pytest.mark.parametrize("launch", decode_tuning.SWEEP_LAUNCHES, ids=lambda x: "b{}-w{}-s{}".format(*x))
def test_sweep_launches_compile(launch):
    block_size, num_warps, num_stages = launch
    text = _compile(16, 8, 5, 128, 4096, jnp.bfloat16, block_size=block_size, num_warps=num_warps,
                    num_stages=num_stages, num_splits=8)
    assert _merged(text)


@pytest.mark.parametrize("variant", ["shared-length", "splits-3", "one-split", "block-mask", "group-1"])
def test_variants_compile(variant):
    options = {"shared-length": dict(per_row=False), "splits-3": dict(num_splits=3),
               "one-split": dict(num_splits=1), "block-mask": dict(block_mask=True, block_size=64),
               "group-1": dict(num_splits=4)}[variant]
    group = 1 if variant == "group-1" else 5
    text = _compile(16, 8, group, 128, 2080, jnp.bfloat16, **options)
    assert _merged(text) == (variant != "one-split")
