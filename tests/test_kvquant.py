"""vase_jax.kvquant: packing is the identity, quantization is HQQ's round-to-nearest within half a step, the
bytes per token meet the sizes DESIGN.md gives, and bad settings are refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vase_jax.analysis.quant import hqq_quantize, rtn_quantize
from vase_jax.kvquant import KVBits, dequantize, pack, quantize, slots_last, token_bytes, unpack


@pytest.mark.parametrize("bits", [8, 4])
def test_pack_unpack_is_the_identity(bits):
    codes = np.random.default_rng(bits).integers(0, 2**bits, (3, 5, 128)).astype(np.uint8)
    packed = pack(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, 128 * bits // 8)
    np.testing.assert_array_equal(np.asarray(unpack(packed, bits)), codes)
    if bits == 4:  # the layout: even channel in the low nibble
        np.testing.assert_array_equal(np.asarray(packed[..., 0]), codes[..., 0] | (codes[..., 1] << 4))


@pytest.mark.parametrize("bits", [8, 4])
def test_pack_unpack_of_no_slots(bits):
    """A quantized tier of zero slots (a small budget whose 16-bit slots hold everything) packs to zero bytes."""
    codes = jnp.zeros((2, 0, 32), jnp.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (2, 0, 32 * bits // 8) and unpack(packed, bits).shape == (2, 0, 32)
    assert quantize(jnp.zeros((2, 0, 32)), bits, 32).codes.shape == (2, 0, 32 * bits // 8)


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
    stored_k, stored_v = slots_last(k), slots_last(v)  # as a cache segment holds them: scales group-major
    out = merge([quantized_partials(q, stored_k, stored_v, pos, jnp.int32(length), block=64)], jnp.float32)
    want = decode_attention_reference(q, dequantize(k), dequantize(v), pos, length, block_size=64)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    # per-row lengths: row 1 holds 0 slots (output 0), row 0 its 70
    out = merge([quantized_partials(q, stored_k, stored_v, pos, jnp.array([length, 0], jnp.int32), block=64)],
                jnp.float32)
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
    sk, sv = slots_last(k), slots_last(v)
    first = quantized_partials(q, sk, sv, jnp.where(pos < 20, pos, -1), jnp.int32(48), block=16)
    second = quantized_partials(q, sk, sv, jnp.where(pos >= 20, pos, -1), jnp.int32(48), block=16)
    want = decode_attention_reference(q, dequantize(k), dequantize(v), pos, 48, block_size=16)
    np.testing.assert_allclose(np.asarray(merge([first, second], jnp.float32)), np.asarray(want), rtol=2e-5,
                               atol=2e-5)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_one_loop_over_both_tiers_equals_their_merged_partials(bits, group):
    """`segments_partials` (the XLA path's one loop: the 16-bit tier's blocks, then the quantized tier's) gives the
    log-sum-exp merge of each tier's own partials, for a cache stacked over layers, rows of different lengths
    (one with an empty quantized tier, one with nothing), and segments of unequal sizes."""
    from pallas_kernels.decode_attention import decode_attention_partials_reference
    from vase_jax.quant_attention import Segment, merge, quantized_partials, segments_partials, sixteen_bit_segment

    layers, b, h, g, d = 2, 3, 2, 4, 128
    full_slots, quant_slots = 64, 160
    keys = jax.random.split(jax.random.key(7), 5)
    q = jax.random.normal(keys[0], (b, h, g, d), jnp.bfloat16)
    k16 = jax.random.normal(keys[1], (layers, b, h, full_slots, d), jnp.bfloat16)
    v16 = jax.random.normal(keys[2], (layers, b, h, full_slots, d), jnp.bfloat16)
    kq = slots_last(quantize(jax.random.normal(keys[3], (layers, b, h, quant_slots, d)), bits, group or d,
                             scale_dtype=jnp.bfloat16))
    vq = slots_last(quantize(jax.random.normal(keys[4], (layers, b, h, quant_slots, d)) * 3, bits, group or d,
                             scale_dtype=jnp.bfloat16))
    pos16 = jnp.broadcast_to(jnp.arange(full_slots, dtype=jnp.int32), (layers, b, h, full_slots))
    posq = jnp.broadcast_to(jnp.arange(quant_slots, dtype=jnp.int32), (layers, b, h, quant_slots))
    posq = posq.at[:, :, 1, 5].set(-1)  # an empty slot
    lengths, qlengths = jnp.array([40, 64, 0], jnp.int32), jnp.array([150, 0, 0], jnp.int32)
    for layer in (1, jnp.int32(0)):
        got = merge([segments_partials(q, [sixteen_bit_segment(k16, v16, pos16, lengths),
                                           Segment(kq, vq, posq, qlengths)], layer=layer)], jnp.float32)
        want = merge([decode_attention_partials_reference(q, k16, v16, pos16, lengths, block_size=64, layer=layer),
                      quantized_partials(q, kq, vq, posq, qlengths, layer=layer)], jnp.float32)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
        assert np.all(np.asarray(got[2]) == 0)  # a row with no slot


def _split_kept_numpy(kept, quantized, value_range, protected):
    """One (row, kv head): the 16-bit kept slots by Range, descending (ties: earlier in `kept`), the first P."""
    bf16 = [i for i, s in enumerate(kept) if not quantized[s]]
    top = sorted(bf16, key=lambda i: (-value_range[kept[i]], i))[:protected]
    full = [s for i, s in enumerate(kept) if i in top]
    quant = [s for i, s in enumerate(kept) if i not in top]
    return full, quant, [not quantized[s] for s in quant]


def test_split_kept_matches_numpy():
    from vase_jax.kvquant import split_kept

    rng = np.random.default_rng(7)
    c, k, p = 40, 24, 6
    kept = np.stack([rng.permutation(c)[:k] for _ in range(6)]).reshape(2, 3, k).astype(np.int32)
    quantized = rng.random((2, 3, c)) < 0.3
    value_range = rng.integers(0, 5, (2, 3, c)).astype(np.float32)  # many ties
    for b in range(2):  # at most K - P kept slots quantized (the quantized part's size)
        for h in range(3):
            extra = [s for s in kept[b, h] if quantized[b, h, s]][k - p:]
            quantized[b, h, extra] = False
    full, quant, fresh = split_kept(jnp.asarray(kept), jnp.asarray(quantized), jnp.asarray(value_range), p)
    assert full.shape == (2, 3, p) and quant.shape == fresh.shape == (2, 3, k - p)
    for b in range(2):
        for h in range(3):
            want = _split_kept_numpy(list(kept[b, h]), quantized[b, h], value_range[b, h], p)
            assert np.asarray(full[b, h]).tolist() == want[0]
            assert np.asarray(quant[b, h]).tolist() == want[1]
            assert np.asarray(fresh[b, h]).tolist() == want[2]


def test_a_token_is_quantized_at_most_once_across_evictions():
    """A cache of N + B slots evicting every B tokens with a random policy: the 16-bit part holds the top-P
    kept tokens by Range among those never quantized, and no token is quantized twice."""
    from vase_jax.kvquant import split_kept

    rng = np.random.default_rng(3)
    n, b, p = 24, 8, 6
    k = n - b
    tokens = list(range(n + b))  # token ids in the cache; the newest b are the recent window
    value_range = {t: float(rng.random()) for t in range(2000)}
    quantized: set[int] = set()
    times: dict[int, int] = {}
    nxt = n + b
    for _ in range(30):
        candidates = tokens[:-b]  # all but the newest b
        kept_tokens = list(rng.permutation(candidates)[:k])
        # the policy keeps any token, quantized or not: at most the quantized part's K - P are quantized
        slot = {t: i for i, t in enumerate(tokens)}
        kept = np.array([[slot[t] for t in kept_tokens]], np.int32)
        qmask = np.array([[t in quantized for t in tokens]])
        ranges = np.array([[value_range[t] for t in tokens]], np.float32)
        assert qmask[0, kept[0]].sum() <= k - p
        full, quant, fresh = (np.asarray(x)[0] for x in split_kept(jnp.asarray(kept), jnp.asarray(qmask),
                                                                   jnp.asarray(ranges), p))
        full_t, quant_t = [tokens[i] for i in full], [tokens[i] for i in quant]
        bf16_kept = [t for t in kept_tokens if t not in quantized]
        assert sorted(full_t) == sorted(sorted(bf16_kept, key=lambda t: -value_range[t])[:p])
        for t, f in zip(quant_t, fresh, strict=True):
            assert f == (t not in quantized)
            if f:
                times[t] = times.get(t, 0) + 1
                quantized.add(t)
        tokens = full_t + quant_t + tokens[-b:] + list(range(nxt, nxt + b))  # the recent b move behind; b new
        nxt += b
    assert times and max(times.values()) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_slot_protected_equals_the_16_bit_cache_bit_for_bit(dtype):
    from pallas_kernels.decode_attention import decode_attention_reference
    from vase_jax.quant_attention import tiered_attention

    b, h, g, slots, d = 2, 2, 4, 96, 128
    keys = jax.random.split(jax.random.key(5), 3)
    q = jax.random.normal(keys[0], (b, h, g, d), dtype)
    k = jax.random.normal(keys[1], (b, h, slots, d), dtype)
    v = jax.random.normal(keys[2], (b, h, slots, d), dtype)
    pos = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (b, h, slots))
    length = jnp.array([90, 33], jnp.int32)
    empty = slots_last(quantize(jnp.zeros((b, h, 16, d), jnp.float32), 8, 128))  # a quantized tier holding nothing
    none_pos = jnp.full((b, h, 16), -1, jnp.int32)
    want = decode_attention_reference(q, k, v, pos, length)
    for quant in (None, (empty, empty, none_pos, jnp.zeros((b,), jnp.int32))):
        got = tiered_attention(q, (k, v, pos, length), quant)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_8_bit_quantized_tier_error_within_1e_2():
    """A cache split in two tiers, the largest-Range quarter of the slots in 16 bits and the rest at K8V8: the
    attention output's relative error against the all-16-bit cache is <= 1e-2 (and larger at K4V4)."""
    from pallas_kernels.decode_attention import decode_attention_reference
    from vase_jax.quant_attention import tiered_attention

    b, h, g, slots, d = 2, 2, 4, 256, 128
    keys = jax.random.split(jax.random.key(6), 3)
    q = jax.random.normal(keys[0], (b, h, g, d), jnp.float32)
    k = jax.random.normal(keys[1], (b, h, slots, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, h, slots, d), jnp.float32)
    v = v.at[:, :, ::17].multiply(8.0)  # some large-Range values
    pos = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (b, h, slots))
    want = decode_attention_reference(q, k, v, pos, slots)
    rng = np.asarray(v.max(-1) - v.min(-1))  # [b, h, slots]
    protected = slots // 4
    order = np.argsort(-rng, axis=-1, kind="stable")
    hi, lo = order[..., :protected], order[..., protected:]

    def take(x, idx):
        return jnp.take_along_axis(x, jnp.asarray(idx)[..., None] if x.ndim == 4 else jnp.asarray(idx), axis=2)

    errors = {}
    for bits in (8, 4):
        full = (take(k, hi), take(v, hi), take(pos, hi), protected)
        group = 128 if bits == 8 else 64
        quant = (slots_last(quantize(take(k, lo), bits, group)), slots_last(quantize(take(v, lo), bits, group)),
                 take(pos, lo), jnp.full((b,), slots - protected, jnp.int32))
        got = tiered_attention(q, full, quant)
        errors[bits] = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert errors[8] <= 1e-2 and errors[4] > errors[8], errors


def test_a_quarter_protected_at_k4v4_is_at_most_half_the_bf16_cache():
    from vase_jax.kvquant import tier_slots, tiered_bytes

    n, b = 4096, 64
    assert tier_slots(n, b, n // 4) == (1024 + 128, 4096 - 64 - 1024) and sum(tier_slots(n, b, n // 4)) == n + b
    bf16 = (n + b) * token_bytes(128, KVBits())
    assert tiered_bytes(n, b, n // 4, 128, KVBits(4, 4)) / bf16 <= 0.5  # 0.480
    assert tiered_bytes(n, b, 0, 128, KVBits()) == bf16
    with pytest.raises(ValueError, match="protected=5000 must be in"):
        tier_slots(n, b, 5000)
