"""The Triton decode kernel compiled deviceless for an NVIDIA H200 (XLA:GPU and Triton's own compiler on this host,
no GPU), so that every launch configuration a device run will use is known to compile first: shared memory,
layouts and the masked, overhanging reads and writes of the GQA group.

Compiled: every H200 row of `decode_tuning.TABLE` at batch 16 x 4096 slots and batch 128 x 2048 (the rule's split
counts: several splits and a merge, and one split without), and every launch the sweep tries
(`SWEEP_LAUNCHES`), with a stacked cache read by layer index; per-row and shared lengths, an explicit split count
that does not divide the blocks, and a block mask. The compiled program must hold the kernels and no copy or
slice of the stacked cache. Launch parameters come from the table through the abstract H200 that
`dispatch.lowering_target` installs (the device kind the kernel sees while tracing).

The mixed-precision cache's kernels as well: the quantized tier's partials (`quant_decode_partials`,
K8V8, K8V4 and K4V4 at head_dim 128, GQA group 4, with and without splits) and the 16-bit tier's
(`decode_attention_partials`) for the H200, and their Mosaic twins (`quant_decode_partials_tpu`,
`decode_attention_partials_tpu`) for a TPU v5p (libtpu: `pip install "jax[tpu]==<jax>"`), each over a stacked
cache read by a traced layer index, without a copy or slice of the stack.

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
from pallas_kernels.decode_attention import decode_attention, decode_attention_partials
from pallas_kernels.decode_attention_tpu import decode_attention_partials_tpu
from pallas_kernels.quant_decode_attention import quant_decode_partials
from pallas_kernels.quant_decode_attention_tpu import quant_decode_partials_tpu
from vase_jax import aot

pytestmark = [pytest.mark.aot, pytest.mark.usefixtures("no_persistent_cache"),
              pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")]

H200 = "NVIDIA H200"
LAYERS = 2
H200_ROWS = sorted((key for key in decode_tuning.TABLE if key[0] == H200), key=repr)


@functools.cache
def _sharding(target: str = "h200") -> NamedSharding:
    device = aot.TARGETS[target].devices()[0]
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


# ------------------------------------------------------------------------------------------------------------
# the mixed-precision cache's kernels: partials of the quantized tier and of the 16-bit tier
# ------------------------------------------------------------------------------------------------------------
QUANT_SETTINGS = {"K8V8": (8, 8, 128, 128), "K8V4": (8, 4, 128, 64), "K4V4": (4, 4, 64, 64),
                  "K4V4g32": (4, 4, 32, 32)}


def _compile_partials(target: str, kind: str, *, batch: int = 16, kv_heads: int = 8, group: int = 4,
                      head_dim: int = 128, capacity: int = 3072, dtype=jnp.bfloat16, **options) -> str:
    """The optimized HLO of one tier's partials over layer `l` of a stacked cache, compiled for `target` ("h200":
    the Triton kernels, "v5p": the Mosaic ones); `kind` a `QUANT_SETTINGS` key or "16-bit"."""
    reason = aot.missing(target)
    if reason:
        pytest.skip(reason)

    def arg(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=_sharding(target))

    slots = (LAYERS, batch, kv_heads, capacity)
    head = [arg((batch, kv_heads, group, head_dim), dtype)]
    tail = [arg(slots, jnp.int32), arg((batch,), jnp.int32), arg((), jnp.int32)]
    if kind == "16-bit":
        fn = decode_attention_partials if target == "h200" else decode_attention_partials_tpu
        cache = [arg(slots + (head_dim,), dtype)] * 2
        stacked = {slots + (head_dim,)}

        def attend(q, k, v, pos, length, layer):
            return fn(q, k, v, pos, length, layer=layer, **options)
    else:
        key_bits, value_bits, key_group, value_group = QUANT_SETTINGS[kind]
        fn = quant_decode_partials if target == "h200" else quant_decode_partials_tpu
        cache, stacked = [], set()
        for bits, size in ((key_bits, key_group), (value_bits, value_group)):
            groups = slots[:3] + (head_dim // size, capacity)  # the scales group-major, as the cache stores them
            parts = [slots + (head_dim * bits // 8,), groups, groups]
            cache += [arg(parts[0], jnp.uint8), arg(parts[1], dtype), arg(parts[2], dtype)]
            # XLA:TPU gives some arguments a compact layout of its own and copies them into the kernel's at the call
            # (TPU_RELAYOUTS): checked in place on the H200, and on the TPU for the others
            if target == "h200":
                stacked |= set(parts)
            else:
                stacked |= ({parts[0]} if bits == 8 else set()) | (set(parts[1:]) if head_dim // size > 1 else set())

        def attend(q, kc, ks, kl, vc, vs, vl, pos, length, layer):
            return fn(q, kc, ks, kl, vc, vs, vl, pos, length, key_bits=key_bits, value_bits=value_bits, layer=layer,
                      **options)

    with dispatch.lowering_target("cuda" if target == "h200" else "tpu"):
        text = jax.jit(attend).lower(*head, *cache, *tail).compile().as_text()
    stacked |= {slots}
    assert aot.copies_of(text, stacked) == [] and aot.copying_reads(text, stacked) == []
    return text


@pytest.mark.parametrize("kind", sorted(QUANT_SETTINGS))
@pytest.mark.parametrize("batch", [16, 128])
def test_quant_partials_compile_h200(kind, batch):
    text = _compile_partials("h200", kind, batch=batch)
    key_bits, value_bits = QUANT_SETTINGS[kind][:2]
    assert f"vase_quant_decode_k{key_bits}v{value_bits}" in text
    splits = decode_tuning.decode_params(batch=batch, kv_heads=8, group=4, head_dim=128, capacity=3072,
                                         dtype=jnp.bfloat16, device_kind=H200).num_splits
    assert ("vase_decode_attention_merge_partials" in text) == (splits > 1)


@pytest.mark.parametrize("variant", ["float32", "one-split", "splits-3"])
def test_quant_partials_variants_compile_h200(variant):
    options = {"float32": dict(dtype=jnp.float32), "one-split": dict(num_splits=1),
               "splits-3": dict(num_splits=3)}[variant]
    text = _compile_partials("h200", "K4V4g32", **options)
    assert "vase_quant_decode_k4v4" in text


@pytest.mark.parametrize("num_splits", [1, 8])
def test_16bit_partials_compile_h200(num_splits):
    text = _compile_partials("h200", "16-bit", num_splits=num_splits)
    assert "vase_decode_attention" in text
    assert ("vase_decode_attention_merge_partials" in text) == (num_splits > 1)


# On the TPU, a program whose arguments are the kernel's arrays (this file's) gets 4-bit codes [..., slots, 64] and
# one-group scales [..., 1, slots] in XLA:TPU's own compact layouts, copied into the Mosaic kernel's at the call.
# Inside `generate` the cache never crosses an argument boundary, and the ticks' loops pin its stacks to the
# kernels' layout (`tiers.pinned`; tests/test_aot.py checks that no step copies a stack). The 8-bit codes,
# group-major scales of several groups, pos and the 16-bit tier are read in place here too.
TPU_RELAYOUTS = "4-bit codes, one-group scales (at an argument boundary)"


@pytest.mark.parametrize("kind", ["K8V8", "K8V4", "K4V4", "K4V4g32", "16-bit"])
def test_partials_compile_tpu(kind):
    text = _compile_partials("v5p", kind)
    assert ("vase_decode_attention_tpu_partials" if kind == "16-bit" else "vase_quant_decode_tpu") in text
