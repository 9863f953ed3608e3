"""vase_jax.kvquant: packing is the identity, quantization is HQQ's round-to-nearest within half a step, the
bytes per token meet issue 27's sizes, and bad settings are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vase_jax.analysis.quant import hqq_quantize, rtn_quantize
from vase_jax.kvquant import KVBits, dequantize, pack, quantize, token_bytes, unpack


@pytest.mark.parametrize("bits", [8, 4])
def test_pack_unpack_is_the_identity(bits):
    codes = np.random.default_rng(bits).integers(0, 2**bits, (3, 5, 128)).astype(np.uint8)
    packed = pack(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, 128 * bits // 8)
    np.testing.assert_array_equal(np.asarray(unpack(packed, bits)), codes)
    if bits == 4:  # the layout: even channel in the low nibble
        np.testing.assert_array_equal(np.asarray(packed[..., 0]), codes[..., 0] | (codes[..., 1] << 4))


@pytest.mark.parametrize("bits,group", [(8, 128), (8, 32), (4, 64), (4, 32)])
def test_round_trip_within_half_a_step_and_equal_to_rtn(bits, group):
    x = jax.random.normal(jax.random.key(0), (4, 6, 128), jnp.float32) * 3.0
    x = x.at[0, 0, 5].set(40.0)  # a large-Range token
    qx = quantize(x, bits, group, scale_dtype=jnp.float32)
    assert qx.scale.shape == (4, 6, 128 // group) and qx.codes.shape == (4, 6, 128 * bits // 8)
    x_hat = dequantize(qx)
    step = np.repeat(np.asarray(qx.scale), group, axis=-1)
    err = np.abs(np.asarray(x_hat) - np.asarray(x))
    assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-6), float((err - step / 2).max())
    # HQQ's round-to-nearest, and HQQ with its refinement off, are the same numbers
    np.testing.assert_allclose(np.asarray(x_hat), np.asarray(rtn_quantize(x, bits, group)), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(x_hat), np.asarray(hqq_quantize(x, bits, group, optimize=False)),
                               rtol=1e-6, atol=1e-6)


def test_refined_zero_matches_hqq():
    x = jax.random.normal(jax.random.key(1), (8, 128), jnp.float32)
    x_hat = dequantize(quantize(x, 4, 64, refine=True, scale_dtype=jnp.float32))
    np.testing.assert_allclose(np.asarray(x_hat), np.asarray(hqq_quantize(x, 4, 64, optimize=True)), rtol=1e-5,
                               atol=1e-5)


def test_bf16_scales_stay_close():
    x = jax.random.normal(jax.random.key(2), (16, 128), jnp.bfloat16)
    qx = quantize(x, 8, 128)
    assert qx.scale.dtype == jnp.bfloat16
    x32 = np.asarray(x, np.float32)
    rel = np.abs(np.asarray(dequantize(qx)) - x32).max() / np.abs(x32).max()
    assert rel < 1e-2


def test_bytes_per_token_meet_the_issue_sizes():
    bf16 = token_bytes(128, KVBits())
    assert bf16 == 512
    assert token_bytes(128, KVBits(8, 8)) / bf16 <= 0.52
    assert token_bytes(128, KVBits(4, 4)) / bf16 <= 0.32
    assert token_bytes(128, KVBits.parse("K4V4g32")) / bf16 <= 0.32
    assert token_bytes(128, KVBits(8, 4)) == 132 + 72


def test_parse_and_validate():
    assert KVBits.parse("K8V4") == KVBits(8, 4) and KVBits.parse("bf16") == KVBits()
    assert KVBits.parse("k4v4g32").group("value") == 32 and KVBits.parse("K4V4g32").name == "K4V4g32"
    assert KVBits(8, 4).name == "K8V4" and not KVBits().quantizes and KVBits(8, 8).quantizes
    with pytest.raises(ValueError, match="key_bits=4 < value_bits=8"):
        KVBits(4, 8).validate()
    with pytest.raises(ValueError, match="value_bits=2; allowed: 16, 8, 4"):
        KVBits(8, 2).validate()
    with pytest.raises(ValueError, match="key_group=48 must divide head_dim=128"):
        KVBits(8, 8, key_group=48).validate(128)
    with pytest.raises(ValueError, match="expected K<bits>V<bits>"):
        KVBits.parse("int8")


@pytest.mark.parametrize("bits,group", [(8, 128), (4, 32)])
def test_folded_scales_equal_attention_on_the_dequantized_cache(bits, group):
    from pallas_kernels.decode_attention import decode_attention_reference
    from vase_jax.quant_attention import merge, quantized_partials

    b, h, g, slots, d = 2, 2, 3, 80, 128
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(kq, (b, h, g, d), jnp.float32)
    k = quantize(jax.random.normal(kk, (b, h, slots, d), jnp.float32), bits, group, scale_dtype=jnp.float32)
    v = quantize(jax.random.normal(kv, (b, h, slots, d), jnp.float32) * 2, bits, group, scale_dtype=jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (b, h, slots)).at[:, 1, 7].set(-1)  # an empty slot
    length = 70  # past one block of 64, inside the second
    out = merge([quantized_partials(q, k, v, pos, jnp.int32(length), block=64)], jnp.float32)
    want = decode_attention_reference(q, dequantize(k), dequantize(v), pos, length, block_size=64)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    # per-row lengths: row 1 holds 0 slots (output 0), row 0 its 70
    out = merge([quantized_partials(q, k, v, pos, jnp.array([length, 0], jnp.int32), block=64)], jnp.float32)
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(want[0]), rtol=2e-5, atol=2e-5)
    assert np.all(np.asarray(out[1]) == 0)


def test_merge_of_two_segments_is_attention_over_their_union():
    from pallas_kernels.decode_attention import decode_attention_reference
    from vase_jax.quant_attention import merge, quantized_partials

    b, h, g, d = 1, 2, 2, 64
    keys = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(keys[0], (b, h, g, d), jnp.float32)
    kx = jax.random.normal(keys[1], (b, h, 48, d), jnp.float32)
    vx = jax.random.normal(keys[2], (b, h, 48, d), jnp.float32)
    k, v = quantize(kx, 8, 64, scale_dtype=jnp.float32), quantize(vx, 8, 64, scale_dtype=jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(48, dtype=jnp.int32), (b, h, 48))
    # slots [0, 20) in one segment and [20, 48) in another (their pos -1 in the other)
    first = quantized_partials(q, k, v, jnp.where(pos < 20, pos, -1), jnp.int32(48), block=16)
    second = quantized_partials(q, k, v, jnp.where(pos >= 20, pos, -1), jnp.int32(48), block=16)
    want = decode_attention_reference(q, dequantize(k), dequantize(v), pos, 48, block_size=16)
    np.testing.assert_allclose(np.asarray(merge([first, second], jnp.float32)), np.asarray(want), rtol=2e-5,
                               atol=2e-5)
