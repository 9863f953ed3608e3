"""Decode-attention kernels of the mixed-precision cache: partials (acc, m, l) of the quantized tier
(`quant_decode_partials`, Triton; `quant_decode_partials_tpu`, Mosaic) against the XLA reference
(`vase_jax.quant_attention.quantized_partials`), partials of the 16-bit tier against
`decode_attention_partials_reference`, and the two tiers merged by log-sum-exp against decode attention over the
explicitly dequantized, concatenated cache. Kernels run in interpret mode on CPU (the Pallas interpreter for
Triton, TPU interpret mode for Mosaic); shapes are small. Deviceless compiles for the H200 and a TPU v5p are in
tests/test_aot_kernels.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import dispatch
from pallas_kernels.decode_attention import (
    decode_attention_partials,
    decode_attention_partials_reference,
    decode_attention_reference,
)
from pallas_kernels.decode_attention_tpu import decode_attention_partials_tpu
from pallas_kernels.quant_decode_attention import quant_decode_partials
from pallas_kernels.quant_decode_attention_tpu import quant_decode_partials_tpu
from vase_jax.kvquant import Quantized, dequantize, quantize, slots_first, slots_last
from vase_jax.quant_attention import merge, quantized_partials, quantized_partials_of_arrays

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

TOL = {"float32": 1e-5, "bfloat16": 1e-2}  # relative to the largest |value| (bf16: p rounded before the V product)
LAYERS, BATCH, KV_HEADS, GROUP, HEAD_DIM = 2, 3, 2, 4, 128
LENGTHS = (150, 0, 37)  # ragged rows: one ends mid-block, one is empty (l = 0)


def _bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.uint16)


def _quant_cache(seed, slots, key_bits, value_bits, key_group, value_group, dtype):
    """q [b, h, group, D] and a quantized segment stacked over LAYERS: (k, v) as `Quantized` [L, b, h, slots, .]
    as a cache stores it (`slots_last`: scale and low group-major [L, b, h, groups, slots]),
    pos [L, b, h, slots] with holes (-1); slots past a row's length hold valid-looking positions."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(BATCH, KV_HEADS, GROUP, HEAD_DIM)), dtype)
    shape = (LAYERS, BATCH, KV_HEADS, slots, HEAD_DIM)
    k = jnp.asarray(rng.normal(size=shape) * 1.5, jnp.float32)
    v = jnp.asarray(rng.normal(size=shape), jnp.float32)
    pos = np.where(rng.random(shape[:4]) < 0.2, -1, np.arange(slots)).astype(np.int32)
    kq = slots_last(quantize(k, key_bits, key_group, scale_dtype=dtype))
    vq = slots_last(quantize(v, value_bits, value_group, scale_dtype=dtype))
    return q, kq, vq, jnp.asarray(pos)


def _layer(x: Quantized, layer: int) -> Quantized:
    return Quantized(x.codes[layer], x.scale[layer], x.low[layer], x.bits)


def _arrays(kq: Quantized, vq: Quantized, as_bits: bool = False):
    arrays = [kq.codes, kq.scale, kq.low, vq.codes, vq.scale, vq.low]
    return [_bits(a) if as_bits and i % 3 else a for i, a in enumerate(arrays)]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _check_partials(got, want, tol, empty_rows=()):
    acc, m, l = (np.asarray(x) for x in got)
    acc_w, m_w, l_w = (np.asarray(x) for x in want)
    assert acc.shape == acc_w.shape and m.shape == l.shape == l_w.shape
    assert all(x.dtype == np.float32 for x in (acc, m, l))
    some = l_w > 0
    assert np.max(np.abs(m - m_w)[some]) <= tol * max(1.0, np.max(np.abs(m_w[some])))
    assert _rel(l, l_w) <= tol and _rel(acc, acc_w) <= tol
    for b in empty_rows:  # no valid slot: l = 0, acc = 0 (never NaN)
        assert np.all(l[b] == 0.0) and np.all(acc[b] == 0.0)


# (key bits, value bits, key group, value group, dtype, scales stored as uint16 bits)
SETTINGS = {
    "K8V8-f32": (8, 8, 128, 128, "float32", False),
    "K8V4-bf16": (8, 4, 128, 64, "bfloat16", False),
    "K4V4g32-f32": (4, 4, 32, 32, "float32", False),
    "K4V4g64-bf16bits": (4, 4, 64, 64, "bfloat16", True),
}


def _quant_kernel(platform):
    if platform == "triton":
        return functools.partial(quant_decode_partials, interpret=True, block_size=32, num_splits=3), 160
    return functools.partial(quant_decode_partials_tpu, interpret=dispatch.tpu_interpret_params(), block_size=128), 300


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("platform", ["triton", "tpu"])
def test_quant_partials_match_reference(platform, setting):
    """A stacked segment read at a traced layer, ragged rows (one empty), holes; splits (Triton)."""
    key_bits, value_bits, key_group, value_group, dtype, as_bits = SETTINGS[setting]
    kernel, slots = _quant_kernel(platform)
    q, kq, vq, pos = _quant_cache(1, slots, key_bits, value_bits, key_group, value_group, dtype)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    run = jax.jit(lambda q, *a: kernel(q, *a[:-1], layer=a[-1], key_bits=key_bits, value_bits=value_bits))
    got = run(q, *_arrays(kq, vq, as_bits), pos, lengths, jnp.int32(1))
    want = quantized_partials(q, _layer(kq, 1), _layer(vq, 1), pos[1], lengths, block=32)
    _check_partials(got, want, TOL[dtype], empty_rows=(1,))


def test_quant_partials_one_split_and_shared_length():
    """One split (the kernel's own partials, no merge) equals several splits; a scalar length equals the same
    length per row."""
    q, kq, vq, pos = _quant_cache(2, 160, 8, 4, 128, 64, "float32")
    kq, vq, pos = _layer(kq, 0), _layer(vq, 0), pos[0]
    run = functools.partial(quant_decode_partials, q, *_arrays(kq, vq), pos, key_bits=8, value_bits=4,
                            interpret=True, block_size=32)
    one, four = run(jnp.int32(120), num_splits=1), run(jnp.full((BATCH,), 120, jnp.int32), num_splits=4)
    _check_partials(one, four, 1e-6)
    _check_partials(one, quantized_partials(q, kq, vq, pos, jnp.int32(120), block=32), TOL["float32"])


@pytest.mark.parametrize("platform", ["triton", "tpu"])
def test_16bit_partials_match_reference(platform):
    """The 16-bit tier's kernels with the normalization skipped: a stacked bf16 cache kept as uint16 bits, read at a
    traced layer, ragged rows, splits (Triton)."""
    rng = np.random.default_rng(3)
    slots = 160 if platform == "triton" else 300
    q = jnp.asarray(rng.normal(size=(BATCH, KV_HEADS, GROUP, HEAD_DIM)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(LAYERS, BATCH, KV_HEADS, slots, HEAD_DIM)), jnp.bfloat16) for _ in "kv")
    pos = jnp.asarray(np.where(rng.random(k.shape[:4]) < 0.2, -1, np.arange(slots)).astype(np.int32))
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    if platform == "triton":
        kernel = functools.partial(decode_attention_partials, interpret=True, block_size=32, num_splits=3)
    else:
        kernel = functools.partial(decode_attention_partials_tpu, interpret=dispatch.tpu_interpret_params(),
                                   block_size=128)
    got = jax.jit(lambda *a: kernel(*a[:-1], layer=a[-1]))(q, _bits(k), _bits(v), pos, lengths, jnp.int32(1))
    want = decode_attention_partials_reference(q, k, v, pos, lengths, layer=1)
    _check_partials(got, want, TOL["bfloat16"], empty_rows=(1,))


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu", "xla"])
def test_tiers_merged_equal_attention_over_the_dequantized_cache(impl):
    """merge(16-bit tier's partials, quantized tier's partials) through the dispatchers (stacked tiers, traced
    layer) equals decode attention over the two tiers concatenated, the quantized one explicitly dequantized."""
    rng = np.random.default_rng(4)
    full_slots, quant_slots = 128, 256
    q, kq, vq, quant_pos = _quant_cache(5, quant_slots, 4, 4, 32, 32, "float32")
    k16, v16 = (jnp.asarray(rng.normal(size=(LAYERS, BATCH, KV_HEADS, full_slots, HEAD_DIM)), jnp.float32)
                for _ in "kv")
    full_pos = jnp.asarray(np.where(rng.random(k16.shape[:4]) < 0.1, -1, np.arange(full_slots)).astype(np.int32))
    full_len, quant_len = jnp.asarray([128, 0, 50], jnp.int32), jnp.asarray([200, 0, 256], jnp.int32)
    block = 32 if impl != "pallas_tpu" else 128
    options = dict(block_size=block) | (dict(num_splits=2) if impl == "pallas_gpu" else {})
    full_parts = pallas_kernels.get_decode_partials(impl, **options)
    quant_parts = pallas_kernels.get_quant_decode_partials(impl, reference=quantized_partials_of_arrays, key_bits=4,
                                                          value_bits=4, **options)

    @jax.jit
    def tiered(q, layer):
        parts = [full_parts(q, k16, v16, full_pos, full_len, layer),
                 quant_parts(q, *_arrays(kq, vq), quant_pos, quant_len, layer)]
        return merge(parts, q.dtype)

    layer = 1
    k_cat = jnp.concatenate([k16[layer], dequantize(slots_first(_layer(kq, layer)))], axis=2)  # [b, h, full + q, D]
    v_cat = jnp.concatenate([v16[layer], dequantize(slots_first(_layer(vq, layer)))], axis=2)
    in_use = [np.arange(n)[None, None, :] < np.asarray(lens)[:, None, None]  # [b, 1, slots] each
              for n, lens in ((full_slots, full_len), (quant_slots, quant_len))]
    pos_cat = jnp.concatenate([jnp.where(in_use[0], full_pos[layer], -1), jnp.where(in_use[1], quant_pos[layer], -1)],
                              axis=2)
    want = decode_attention_reference(q, k_cat, v_cat, pos_cat, full_slots + quant_slots)
    got = tiered(q, jnp.int32(layer))
    assert _rel(got, want) <= 1e-5
    assert np.all(np.asarray(got[1]) == 0.0)  # a row empty in both tiers: 0, not NaN


def test_rejects_bad_arguments():
    q, kq, vq, pos = _quant_cache(6, 64, 4, 4, 32, 32, "float32")
    kq, vq, pos = _layer(kq, 0), _layer(vq, 0), pos[0]
    arrays = _arrays(kq, vq)
    with pytest.raises(ValueError, match="key_bits=3"):
        quant_decode_partials(q, *arrays, pos, 10, key_bits=3, value_bits=4, interpret=True)
    with pytest.raises(ValueError, match="key codes have shape"):
        quant_decode_partials(q, *arrays, pos, 10, key_bits=8, value_bits=4, interpret=True)
    with pytest.raises(ValueError, match="key scale / low have shapes .* expected group-major"):
        token_major = slots_first(kq)  # scales [b, h, slots, groups]: not how a cache stores them
        quant_decode_partials(q, token_major.codes, token_major.scale, token_major.low, *arrays[3:], pos, 10,
                              key_bits=4, value_bits=4, interpret=True)
    small = slots_last(quantize(dequantize(slots_first(kq)), 4, 16))  # 8 channels per nibble half: under 16
    with pytest.raises(ValueError, match="group of 16 channels at 4 bits"):
        quant_decode_partials(q, small.codes, small.scale, small.low, *arrays[3:], pos, 10, key_bits=4,
                              value_bits=4, interpret=True)
    with pytest.raises(ValueError, match="block_size=64 must be a multiple of 128"):
        quant_decode_partials_tpu(q, *arrays, pos, 10, key_bits=4, value_bits=4, block_size=64)
    with pytest.raises(ValueError, match="get_quant_decode_partials needs key_bits"):
        pallas_kernels.get_quant_decode_partials("xla", reference=quantized_partials_of_arrays)
