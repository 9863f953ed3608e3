"""Pallas kernels (Triton and Mosaic TPU) against their pure-JAX references, and the references against NumPy.

Each kernel has a test class that runs the compiled kernel (needs its device: a GPU for Triton, a TPU for the
Mosaic kernels) and a subclass with `INTERPRET` set that runs the same tests on CPU: the Pallas interpreter for
Triton, TPU interpret mode (`pltpu.InterpretParams`, TPU semantics) for the TPU kernels. Shapes are small:
interpret mode is slow. The full shapes are checked by lowering (`tests/test_lowering.py`).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import decode_tuning, dispatch
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.decode_attention_tpu import decode_attention_tpu
from pallas_kernels.eviction_scores import window_mass
from pallas_kernels.eviction_scores_tpu import window_mass_tpu
from vase_jax.eviction.window_score import pool_and_mask, query_rows, window_score, window_score_reference

HAS_GPU = jax.default_backend() == "gpu"
HAS_TPU = jax.default_backend() == "tpu"
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _max_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _rel_err(a, b) -> float:
    """max |a - b| / max |b|: the error relative to the output's scale (elementwise ratios blow up near 0)."""
    return _max_err(a, b) / max(float(np.max(np.abs(np.asarray(b, np.float64)))), 1e-30)


# ------------------------------------------------------------------------------------------------------------
# NumPy float64 formulas
# ------------------------------------------------------------------------------------------------------------
def _np_decode(q, k, v, pos, length, block_mask=None, block_size=None):
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    pos = np.asarray(pos)
    capacity = k.shape[2]
    valid = (pos >= 0) & (np.arange(capacity) < np.reshape(length, (-1, 1, 1)))  # [b, h, c]; length: scalar or [b]
    if block_mask is not None:
        valid &= np.repeat(np.asarray(block_mask), block_size, axis=2)[:, :, :capacity]
    k = np.where(valid[..., None], k, 0.0)  # slots past length may hold garbage
    v = np.where(valid[..., None], v, 0.0)
    s = np.einsum("bhgd,bhsd->bhgs", q, k) / np.sqrt(q.shape[-1])
    s = np.where(valid[:, :, None, :], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.where(valid[:, :, None, :], np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    den = e.sum(-1, keepdims=True)
    a = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
    return np.einsum("bhgs,bhsd->bhgd", a, v)


def _np_scores(queries, keys, valid, query_valid, smooth, temperature):
    q = np.asarray(jnp.asarray(queries, jnp.float32), np.float64)  # [b, h, g, w, d]
    k = np.asarray(jnp.asarray(keys, jnp.float32), np.float64)  # [b, h, l, d]
    valid, query_valid = np.asarray(valid), np.asarray(query_valid)
    batch, kv_heads, group, window, head_dim = q.shape
    out = np.zeros(k.shape[:3])
    for b in range(batch):
        for h in range(kv_heads):
            cand = np.flatnonzero(valid[b, h])
            queries_t = np.flatnonzero(query_valid[b])
            p = np.zeros(k.shape[2])
            if len(cand) and len(queries_t):
                for g in range(group):
                    for t in queries_t:
                        z = k[b, h, cand] @ q[b, h, g, t] / (np.sqrt(head_dim) * temperature)
                        z = np.exp(z - z.max())
                        p[cand] += z / z.sum()
                p /= group * len(queries_t)
            if smooth:
                padded = np.concatenate([np.zeros(2), p, np.zeros(2)])
                p = np.array([padded[j : j + 5].sum() / 5 for j in range(len(p))])
                p[~valid[b, h]] = 0.0
            out[b, h] = p
    return out


# ------------------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------------------
def _decode_inputs(
    seed, batch, kv_heads, group, head_dim, capacity, length, dtype, empty_rows=(), garbage=False
):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, kv_heads, group, head_dim))
    k = rng.normal(size=(batch, kv_heads, capacity, head_dim))
    v = rng.normal(size=(batch, kv_heads, capacity, head_dim))
    pos = np.where(rng.random((batch, kv_heads, capacity)) < 0.2, -1, np.arange(capacity)).astype(np.int32)
    for b, h in empty_rows:
        pos[b, h] = -1
    if garbage:  # slots at or past `length`: NaN keys and values, positions that look valid
        k[:, :, length:] = np.nan
        v[:, :, length:] = np.nan
        pos[:, :, length:] = rng.integers(0, 1000, size=pos[:, :, length:].shape)
    return (
        jnp.asarray(q, dtype),
        jnp.asarray(k, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(pos),
        jnp.int32(length),
    )


def _score_inputs(seed, batch, kv_heads, group, window, head_dim, num_keys, dtype):
    rng = np.random.default_rng(seed)
    queries = jnp.asarray(rng.normal(size=(batch, kv_heads, group, window, head_dim)) * 2.0, dtype)
    keys = jnp.asarray(rng.normal(size=(batch, kv_heads, num_keys, head_dim)), dtype)
    valid = rng.random((batch, kv_heads, num_keys)) < 0.8
    valid[0, 0, :] = False  # a (row, kv head) without any candidate
    query_valid = rng.random((batch, window)) < 0.7
    query_valid[:, 0] = True
    if batch > 1:
        query_valid[1, :] = False  # a row whose window holds no query yet
    return queries, keys, jnp.asarray(valid), jnp.asarray(query_valid)


# ------------------------------------------------------------------------------------------------------------
# decode attention: kernel vs reference
# ------------------------------------------------------------------------------------------------------------
# (group, head_dim, dtype, capacity, length, block_size, num_splits, empty (b, h) rows)
DECODE_CASES = [
    (1, 64, "float32", 96, 77, 16, 3, ()),
    (2, 128, "bfloat16", 200, 200, 32, 4, ((1, 0),)),
    (4, 64, "bfloat16", 256, 130, 64, 2, ((0, 1),)),
    (8, 128, "float32", 512, 40, 16, 8, ()),
    (5, 128, "float32", 160, 160, 32, 1, ((0, 0), (1, 1))),
    (2, 64, "float32", 64, 1, 64, 4, ()),
    (8, 64, "bfloat16", 300, 257, 128, 2, ()),
]


class TestDecodeAttentionKernel:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and not HAS_GPU:
            pytest.skip(
                "compiled Triton kernel needs a GPU; TestDecodeAttentionKernelInterpret runs it on CPU"
            )

    @pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"g{c[0]}-d{c[1]}-{c[2]}-c{c[3]}-n{c[4]}")
    def test_matches_reference(self, case):
        group, head_dim, dtype, capacity, length, block_size, num_splits, empty = case
        q, k, v, pos, n = _decode_inputs(0, 2, 2, group, head_dim, capacity, length, dtype, empty_rows=empty)
        out = decode_attention(
            q, k, v, pos, n, block_size=block_size, num_splits=num_splits, interpret=self.INTERPRET
        )
        ref = decode_attention_reference(q, k, v, pos, n, block_size=block_size)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert _max_err(out, ref) <= TOL[dtype]
        for b, h in empty:
            assert np.all(np.asarray(out[b, h], np.float32) == 0.0)

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_slots_past_length_are_not_read(self, dtype):
        args = dict(batch=2, kv_heads=2, group=4, head_dim=64, capacity=256, length=70, dtype=dtype)
        clean = _decode_inputs(1, **args)
        dirty = _decode_inputs(1, **args, garbage=True)
        for fn in (decode_attention, decode_attention_reference):
            kw = dict(block_size=32, num_splits=2, interpret=self.INTERPRET)
            out_dirty = fn(*dirty, **kw)
            assert np.all(np.isfinite(np.asarray(out_dirty, np.float32)))
            np.testing.assert_array_equal(
                np.asarray(out_dirty, np.float32), np.asarray(fn(*clean, **kw), np.float32)
            )

    def test_block_mask(self):
        q, k, v, pos, n = _decode_inputs(2, 2, 2, 4, 64, 200, 180, "float32")
        rng = np.random.default_rng(3)
        block_mask = rng.random((2, 2, 7)) < 0.6  # ceil(200 / 32) = 7 blocks
        block_mask[1, 1] = False  # a row with every block switched off -> 0
        block_mask = jnp.asarray(block_mask)
        out = decode_attention(
            q, k, v, pos, n, block_size=32, num_splits=3, block_mask=block_mask, interpret=self.INTERPRET
        )
        ref = decode_attention_reference(q, k, v, pos, n, block_size=32, block_mask=block_mask)
        assert _max_err(out, ref) <= 1e-5
        assert _max_err(ref, _np_decode(q, k, v, pos, 180, block_mask, 32)) <= 1e-5
        assert np.all(np.asarray(out[1, 1]) == 0.0)
        # all blocks on == no mask
        ones = jnp.ones((2, 2, 7), bool)
        no_mask = decode_attention(q, k, v, pos, n, block_size=32, num_splits=3, interpret=self.INTERPRET)
        with_ones = decode_attention(
            q, k, v, pos, n, block_size=32, num_splits=3, block_mask=ones, interpret=self.INTERPRET
        )
        np.testing.assert_array_equal(np.asarray(no_mask), np.asarray(with_ones))

    def test_empty_cache_gives_zeros(self):
        q, k, v, pos, _ = _decode_inputs(4, 1, 2, 2, 64, 64, 64, "float32")
        out = decode_attention(q, k, v, pos, 0, block_size=16, num_splits=2, interpret=self.INTERPRET)
        assert np.all(np.asarray(out) == 0.0)
        out = decode_attention(q, k, v, jnp.full_like(pos, -1), 64, block_size=16, interpret=self.INTERPRET)
        assert np.all(np.asarray(out) == 0.0)

    def test_rejects_bad_arguments(self):
        q, k, v, pos, n = _decode_inputs(5, 1, 1, 2, 64, 64, 64, "float32")
        with pytest.raises(ValueError, match="block_size=24"):
            decode_attention(q, k, v, pos, n, block_size=24, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="num_splits=0"):
            decode_attention(q, k, v, pos, n, num_splits=0, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="block_mask has shape"):
            decode_attention(
                q, k, v, pos, n, block_size=16, block_mask=jnp.ones((1, 1, 3), bool), interpret=self.INTERPRET
            )
        with pytest.raises(ValueError, match="num_warps=3"):
            decode_attention(q, k, v, pos, n, num_warps=3, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="num_stages=0"):
            decode_attention(q, k, v, pos, n, num_stages=0, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match=r"length has shape \(2,\)"):
            decode_attention(q, k, v, pos, jnp.ones(2, jnp.int32), interpret=self.INTERPRET)

    # (length, num_splits) over 16-slot blocks of a 256-slot cache: 5 used blocks dealt to 8 splits (3 hold only
    # padding), to 3 splits (5 is not a multiple of 3), and a length that ends inside the first block (one split
    # in use, the other 3 empty)
    @pytest.mark.parametrize("length,num_splits", [(70, 8), (70, 3), (9, 4)])
    def test_splits_past_the_used_blocks(self, length, num_splits):
        q, k, v, pos, n = _decode_inputs(20, 2, 2, 4, 64, 256, length, "float32", empty_rows=((1, 1),))
        out = decode_attention(q, k, v, pos, n, block_size=16, num_splits=num_splits, interpret=self.INTERPRET)
        assert np.all(np.isfinite(np.asarray(out)))
        assert _rel_err(out, _np_decode(q, k, v, pos, length)) <= 1e-5
        assert _rel_err(out, decode_attention_reference(q, k, v, pos, n, block_size=16)) <= 1e-5
        assert np.all(np.asarray(out[1, 1]) == 0.0)  # all slots empty (pos -1) beside normal rows: 0, not NaN

    def test_per_row_lengths(self):
        # one length per row: a row at 0, one ending mid-block, one at the capacity; NaN keys and values (and
        # valid-looking positions) past each row's own length must not leak into its output
        lengths = np.array([0, 37, 160], np.int32)
        q, k, v, pos, _ = _decode_inputs(21, 3, 2, 5, 64, 160, 160, "float32", empty_rows=((2, 0),))
        dirty = np.arange(160)[None, None, :, None] >= lengths[:, None, None, None]  # [b, 1, c, 1]
        k_nan, v_nan = (jnp.where(dirty, jnp.nan, x) for x in (k, v))
        kw = dict(block_size=16, num_splits=3, interpret=self.INTERPRET)
        out = decode_attention(q, k_nan, v_nan, pos, jnp.asarray(lengths), **kw)
        assert np.all(np.isfinite(np.asarray(out)))
        assert _rel_err(out, _np_decode(q, k, v, pos, lengths)) <= 1e-5
        assert _rel_err(out, decode_attention_reference(q, k, v, pos, jnp.asarray(lengths), block_size=16)) <= 1e-5
        assert np.all(np.asarray(out[0]) == 0.0) and np.all(np.asarray(out[2, 0]) == 0.0)
        # equal lengths as a vector and as a scalar: the same program, the same bits
        np.testing.assert_array_equal(
            np.asarray(decode_attention(q, k, v, pos, jnp.full((3,), 100, jnp.int32), **kw)),
            np.asarray(decode_attention(q, k, v, pos, jnp.int32(100), **kw)))

    def test_tuned_defaults_and_capacity(self):
        # launch parameters from the table (H200 rules; 16-slot blocks so that the tiny cache has several), in two
        # caches of different capacities holding the same slots: the split count may differ (it is bounded by the
        # capacity), which splits hold which blocks does not, so the results are bit-identical
        q, k, v, pos, n = _decode_inputs(22, 2, 2, 4, 64, 256, 200, "float32")
        k2, v2 = (jnp.concatenate([x, jnp.full_like(x, jnp.nan)], axis=2) for x in (k, v))
        pos2 = jnp.concatenate([pos, jnp.zeros_like(pos)], axis=2)
        out = decode_attention(q, k, v, pos, n, block_size=16, interpret=self.INTERPRET)
        out2 = decode_attention(q, k2, v2, pos2, n, block_size=16, interpret=self.INTERPRET)
        assert _rel_err(out, _np_decode(q, k, v, pos, 200)) <= 1e-5
        np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))


@pytest.mark.slow
class TestDecodeAttentionKernelInterpret(TestDecodeAttentionKernel):
    INTERPRET = True


# ------------------------------------------------------------------------------------------------------------
# decode attention: the launch parameters (pallas_kernels.decode_tuning)
# ------------------------------------------------------------------------------------------------------------
class TestDecodeTuning:
    SHAPE = dict(kv_heads=8, head_dim=128, capacity=4096, dtype=jnp.bfloat16)

    def params(self, batch=16, group=5, kind="NVIDIA H200", **kw):
        return decode_tuning.decode_params(batch=batch, group=group, device_kind=kind, **(self.SHAPE | kw))

    def test_known_kind(self):
        entry = decode_tuning.TABLE[("NVIDIA H200", 128, 5, "bfloat16")]
        p = self.params()
        assert (p.block_size, p.num_warps, p.num_stages) == (entry.block_size, entry.num_warps, entry.num_stages)
        assert p.num_splits == entry.splits_for(16, 8, 4096, 132) > 1
        assert p.min_blocks_per_split == entry.min_blocks_per_split
        # more splits for fewer (row, kv head) pairs; none once batch 128 x 8 kv heads fills the device
        assert self.params(batch=1).num_splits >= p.num_splits >= self.params(batch=128).num_splits == 1
        # no split gets fewer than min_blocks_per_split of the capacity's blocks
        assert self.params(batch=1, capacity=256).num_splits == 1
        assert self.params(kind="NVIDIA H100 80GB HBM3") == p  # Hopper kinds share the H200 rows
        assert self.params(group=7) == self.params(group=7, kind="NVIDIA GH200 480GB")  # any-group row

    def test_unknown_kind(self):
        generic = decode_tuning.GENERIC
        p = self.params(kind="NVIDIA A100-SXM4-80GB")
        assert (p.block_size, p.num_warps, p.num_stages) == (generic.block_size, generic.num_warps,
                                                             generic.num_stages)
        assert p.num_splits == generic.splits_for(16, 8, 4096, 108)  # its own SM count
        assert decode_tuning.sm_count("Some Future GPU") is None
        future = self.params(kind="Some Future GPU")
        assert future.num_splits == generic.splits_for(16, 8, 4096, decode_tuning.FALLBACK_SM_COUNT)
        assert self.params(head_dim=64, kind="NVIDIA H200").block_size == generic.block_size  # no such row

    def test_explicit_values_win(self):
        p = self.params(block_size=128, num_splits=3, num_warps=8, num_stages=4)
        assert p == decode_tuning.DecodeParams(block_size=128, num_splits=3, num_warps=8, num_stages=4)
        assert p.min_blocks_per_split == 1  # an explicit split count is dealt as given
        assert self.params(capacity=100, block_size=32, num_splits=16).num_splits == 4  # the capacity's blocks
        entry = decode_tuning.TABLE[("NVIDIA H200", 128, 5, "bfloat16")]
        assert self.params(block_size=256).num_splits == min(  # the rule, with the given block size
            entry.max_splits, max(1, round(entry.programs_per_sm * 132 / 128)),
            4096 // 256 // entry.min_blocks_per_split)

    @pytest.mark.parametrize("name,value", [("block_size", 24), ("block_size", 8), ("num_splits", 0),
                                            ("num_warps", 3), ("num_warps", 64), ("num_stages", 0)])
    def test_rejects_bad_values(self, name, value):
        with pytest.raises(ValueError, match=f"{name}={value} must be"):
            self.params(**{name: value})
        fields = dict(block_size=64, num_splits=2, num_warps=4, num_stages=2) | {name: value}
        with pytest.raises(ValueError, match=f"{name}={value} must be"):
            decode_tuning.DecodeParams(**fields)
        with pytest.raises(ValueError, match="programs_per_sm=0"):
            decode_tuning.DecodeTuning(programs_per_sm=0)

    def test_device_kind_while_tracing(self):
        if HAS_GPU:
            assert decode_tuning.current_device_kind() == jax.devices()[0].device_kind
            pytest.skip("with a GPU attached, lowering_target installs no abstract device")
        assert decode_tuning.current_device_kind() == decode_tuning.DEFAULT_DEVICE_KIND  # no GPU here: an H200
        # lowered for another kind: its table row and SM count (A100: 108 SMs -> 7 splits at batch 16 x 8 kv
        # heads; the H200: 132 -> 8), seen in the shape of the partials
        args = (jax.ShapeDtypeStruct((16, 8, 5, 128), jnp.bfloat16),
                *[jax.ShapeDtypeStruct((16, 8, 4096, 128), jnp.bfloat16)] * 2,
                jax.ShapeDtypeStruct((16, 8, 4096), jnp.int32), jax.ShapeDtypeStruct((16,), jnp.int32))
        texts = {}
        for kind in ("NVIDIA H200", "NVIDIA A100-SXM4-80GB"):
            with dispatch.lowering_target("cuda", device_kind=kind):
                assert decode_tuning.current_device_kind() == kind
                splits = self.params(kind=kind).num_splits
                texts[splits] = jax.jit(decode_attention).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        for splits, text in texts.items():
            assert f"tensor<16x8x{splits}x5x128xf32>" in text
        assert len(texts) == 2


# ------------------------------------------------------------------------------------------------------------
# decode attention: reference vs NumPy, and its cost
# ------------------------------------------------------------------------------------------------------------
def _materialized_shapes(hlo: str) -> list[str]:
    """Result shapes of buffer-owning instructions outside fused computations (fusion insides are virtual)."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
    shapes, in_fused = [], False
    free = ("parameter(", "get-tuple-element(", "tuple(", "while(", "conditional(", "bitcast(", "call(")
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?(%[\w.\-]+) ", line)
        if header:
            in_fused = header.group(2) in fused
            continue
        m = re.match(r"^\s*(ROOT )?%[\w.\-]+ = (\w+\[[\d,]*\])", line)
        if m and not in_fused and not any(op in line for op in free):
            shapes.append(m.group(2))
    return shapes


class TestDecodeAttentionReference:
    @pytest.mark.parametrize(
        "group,head_dim,dtype,capacity,length,block_size",
        [
            (1, 64, "float32", 50, 50, 16),
            (2, 128, "float32", 200, 131, 64),
            (4, 64, "float32", 40, 33, 64),
            (8, 64, "float32", 130, 7, 1),
            (4, 128, "bfloat16", 96, 96, 32),
        ],
    )
    def test_matches_numpy(self, group, head_dim, dtype, capacity, length, block_size):
        q, k, v, pos, n = _decode_inputs(
            6, 2, 3, group, head_dim, capacity, length, dtype, empty_rows=((1, 2),)
        )
        out = decode_attention_reference(q, k, v, pos, n, block_size=block_size)
        expected = _np_decode(q, k, v, pos, length)
        # bf16: inputs are exact in float32; the error is the final rounding to bf16
        assert _max_err(out, expected) <= (1e-5 if dtype == "float32" else 1e-2)
        assert np.all(np.asarray(out[1, 2], np.float32) == 0.0)

    def test_scale_argument(self):
        q, k, v, pos, n = _decode_inputs(7, 1, 2, 2, 64, 64, 50, "float32")
        out = decode_attention_reference(q, k, v, pos, n, scale=0.5)
        expected = _np_decode(q * (0.5 * 8.0), k, v, pos, 50)  # _np_decode scales by 1 / sqrt(64)
        assert _max_err(out, expected) <= 1e-5

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_no_cache_sized_buffers(self, dtype):
        # The loop reads one block at a time: no buffer of the cache's shape (copy or conversion) may appear.
        q, k, v, pos, n = _decode_inputs(8, 2, 2, 2, 64, 1024, 100, dtype)
        fn = jax.jit(lambda *a: decode_attention_reference(*a, block_size=64))
        hlo = fn.lower(q, k, v, pos, n).compile().as_text()
        assert "while" in hlo
        cache_shapes = {f"{t}[2,2,1024,64]" for t in ("f32", "bf16", "u16", "s32")} | {
            "s32[2,2,1024]",
            "pred[2,2,1024]",
        }
        assert not cache_shapes & set(_materialized_shapes(hlo))

    def test_per_row_lengths(self):
        q, k, v, pos, _ = _decode_inputs(23, 3, 2, 4, 64, 100, 100, "float32")
        lengths = jnp.array([100, 0, 41], jnp.int32)
        out = decode_attention_reference(q, k, v, pos, lengths, block_size=32)
        assert _max_err(out, _np_decode(q, k, v, pos, np.asarray(lengths))) <= 1e-5
        assert np.all(np.asarray(out[1]) == 0.0)
        np.testing.assert_array_equal(
            np.asarray(decode_attention_reference(q, k, v, pos, jnp.full((3,), 41, jnp.int32))),
            np.asarray(decode_attention_reference(q, k, v, pos, jnp.int32(41))))

    def test_rejects_bad_arguments(self):
        q, k, v, pos, n = _decode_inputs(9, 1, 2, 2, 64, 64, 64, "float32")
        with pytest.raises(ValueError, match="pos has shape"):
            decode_attention_reference(q, k, v, pos[:, :1], n)
        with pytest.raises(ValueError, match="v has shape"):
            decode_attention_reference(q, k, v[:, :, :10], pos, n)
        with pytest.raises(ValueError, match="dtypes differ"):
            decode_attention_reference(q, k.astype(jnp.bfloat16), v, pos, n)
        with pytest.raises(ValueError, match="length has shape"):
            decode_attention_reference(q, k, v, pos, jnp.ones(2, jnp.int32))
        with pytest.raises(ValueError, match="length has dtype"):
            decode_attention_reference(q, k, v, pos, jnp.float32(3.0))


# ------------------------------------------------------------------------------------------------------------
# decode attention: the TPU kernel vs the reference
# ------------------------------------------------------------------------------------------------------------
# (group, head_dim, dtype, capacity, length, block_size, empty (b, h) rows): GQA groups 1-8, lengths that end
# mid-block, on a block edge, in the first block; capacities that are not a multiple of the block; fully masked rows
DECODE_TPU_CASES = [
    (1, 128, "float32", 384, 300, 128, ()),
    (2, 128, "bfloat16", 300, 300, 128, ((1, 0),)),
    (3, 128, "float32", 256, 129, 128, ((0, 1),)),
    (4, 128, "bfloat16", 512, 77, 256, ()),
    (5, 128, "float32", 200, 200, 512, ((0, 0), (1, 1))),
    (6, 64, "float32", 256, 1, 128, ()),
    (7, 128, "bfloat16", 640, 513, 128, ()),
    (8, 128, "float32", 1024, 1000, 256, ((1, 1),)),
]


class TestDecodeAttentionTPUKernel:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and not HAS_TPU:
            pytest.skip("compiled TPU kernel needs a TPU; TestDecodeAttentionTPUKernelInterpret runs it on CPU")

    def _interpret(self):
        return dispatch.tpu_interpret_params() if self.INTERPRET else False

    @pytest.mark.parametrize("case", DECODE_TPU_CASES, ids=lambda c: f"g{c[0]}-d{c[1]}-{c[2]}-c{c[3]}-n{c[4]}")
    def test_matches_reference(self, case):
        group, head_dim, dtype, capacity, length, block_size, empty = case
        q, k, v, pos, n = _decode_inputs(10, 2, 2, group, head_dim, capacity, length, dtype, empty_rows=empty)
        out = decode_attention_tpu(q, k, v, pos, n, block_size=block_size, interpret=self._interpret())
        ref = decode_attention_reference(q, k, v, pos, n)
        assert out.shape == q.shape and out.dtype == q.dtype
        if dtype == "float32":
            assert _rel_err(out, ref) <= 1e-5
        else:
            assert _max_err(out, ref) <= TOL[dtype]
        for b, h in empty:
            assert np.all(np.asarray(out[b, h], np.float32) == 0.0)

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_garbage_past_length_does_not_leak(self, dtype):
        # NaN keys and values and valid-looking positions past `length`, which ends mid-block
        args = dict(batch=2, kv_heads=2, group=4, head_dim=128, capacity=384, length=200, dtype=dtype)
        clean = _decode_inputs(11, **args)
        dirty = _decode_inputs(11, **args, garbage=True)
        out_dirty = decode_attention_tpu(*dirty, block_size=128, interpret=self._interpret())
        out_clean = decode_attention_tpu(*clean, block_size=128, interpret=self._interpret())
        assert np.all(np.isfinite(np.asarray(out_dirty, np.float32)))
        np.testing.assert_array_equal(np.asarray(out_dirty, np.float32), np.asarray(out_clean, np.float32))

    def test_empty_cache_gives_zeros(self):
        q, k, v, pos, _ = _decode_inputs(12, 1, 2, 2, 128, 256, 256, "float32")
        out = decode_attention_tpu(q, k, v, pos, 0, block_size=128, interpret=self._interpret())
        assert np.all(np.asarray(out) == 0.0)
        out = decode_attention_tpu(q, k, v, jnp.full_like(pos, -1), 256, block_size=128, interpret=self._interpret())
        assert np.all(np.asarray(out) == 0.0)

    def test_per_row_lengths(self):
        # a row at 0, one ending mid-block, one at the capacity: each row's grid steps stop at its own length
        q, k, v, pos, _ = _decode_inputs(24, 3, 2, 5, 128, 384, 384, "float32")
        lengths = jnp.array([0, 200, 384], jnp.int32)
        out = decode_attention_tpu(q, k, v, pos, lengths, block_size=128, interpret=self._interpret())
        assert _rel_err(out, _np_decode(q, k, v, pos, np.asarray(lengths))) <= 1e-5
        assert np.all(np.asarray(out[0]) == 0.0)
        kw = dict(block_size=128, interpret=self._interpret())
        np.testing.assert_array_equal(  # equal lengths as a vector and as a scalar: the same bits
            np.asarray(decode_attention_tpu(q, k, v, pos, jnp.full((3,), 200, jnp.int32), **kw)),
            np.asarray(decode_attention_tpu(q, k, v, pos, jnp.int32(200), **kw)))

    def test_rejects_bad_arguments(self):
        q, k, v, pos, n = _decode_inputs(13, 1, 1, 2, 128, 256, 256, "float32")
        with pytest.raises(ValueError, match="block_size=64"):
            decode_attention_tpu(q, k, v, pos, n, block_size=64, interpret=self._interpret())
        with pytest.raises(ValueError, match="dtypes differ"):
            decode_attention_tpu(q, k.astype(jnp.bfloat16), v, pos, n, interpret=self._interpret())


@pytest.mark.slow
class TestDecodeAttentionTPUKernelInterpret(TestDecodeAttentionTPUKernel):
    INTERPRET = True


# A 16-bit cache kept as its bits (uint16: how vase_jax stores bf16 caches on CPU) reads exactly as the floats, in
# every implementation, straight from a stack of layers.
_DECODE_IMPLS = {
    "reference": lambda *a, layer: decode_attention_reference(*a, block_size=64, layer=layer),
    "triton_interpret": lambda *a, layer: decode_attention(*a, block_size=64, interpret=True, layer=layer),
    "tpu_interpret": lambda *a, layer: decode_attention_tpu(
        *a, block_size=128, interpret=dispatch.tpu_interpret_params(), layer=layer),
}


@pytest.mark.slow
@pytest.mark.parametrize("impl", sorted(_DECODE_IMPLS))
def test_decode_reads_a_cache_kept_as_bits(impl):
    run = _DECODE_IMPLS[impl]
    q, k, v, pos, n = _decode_inputs(14, 2, 2, 4, 128, 256, 200, "bfloat16")
    k, v, pos = (jnp.stack([x, x[::-1]]) for x in (k, v, pos))  # two layers, rows swapped in the second

    def bits(x):
        return jax.lax.bitcast_convert_type(x, jnp.uint16)

    for layer in (0, 1):
        want = run(q, k, v, pos, n, layer=layer)
        got = run(q, bits(k), bits(v), pos, n, layer=layer)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ValueError, match="dtypes differ"):  # bits of a 16-bit dtype only
        run(q.astype(jnp.float32), bits(k), bits(v), pos, n, layer=0)


# ------------------------------------------------------------------------------------------------------------
# window scores: the kernels (Triton, TPU) inside the score vs the reference
# ------------------------------------------------------------------------------------------------------------
def _score_with(mass_fn, queries, keys, valid, query_valid, *, smooth, temperature, **options):
    """The window score with `mass_fn` as its mass step (what `window_score` does with a kernel impl)."""
    rows, weights = query_rows(queries, query_valid)
    scale = 1.0 / (queries.shape[-1] ** 0.5 * temperature)
    return pool_and_mask(mass_fn(rows, keys, valid, weights, scale=scale, **options), valid, smooth)


# (group, window, head_dim, num_keys, dtype, smooth, temperature, block_keys, num_splits)
SCORE_CASES = [
    (1, 8, 64, 100, "float32", True, 1.0, 32, 2),
    (2, 16, 128, 64, "bfloat16", True, 1.0, 16, 4),
    (4, 16, 64, 150, "float32", False, 0.5, 64, 3),
    (8, 16, 128, 77, "float32", True, 2.0, 32, 1),
]


class TestWindowScoresKernel:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and not HAS_GPU:
            pytest.skip("compiled Triton kernel needs a GPU; TestWindowScoresKernelInterpret runs it on CPU")

    @pytest.mark.parametrize("case", SCORE_CASES, ids=lambda c: f"g{c[0]}-w{c[1]}-d{c[2]}-l{c[3]}-{c[4]}")
    def test_matches_reference(self, case):
        group, window, head_dim, num_keys, dtype, smooth, temperature, block_keys, num_splits = case
        queries, keys, valid, query_valid = _score_inputs(0, 2, 2, group, window, head_dim, num_keys, dtype)
        kw = dict(smooth=smooth, temperature=temperature)
        out = _score_with(
            window_mass, queries, keys, valid, query_valid, **kw,
            block_keys=block_keys, num_splits=num_splits, interpret=self.INTERPRET,
        )  # fmt: skip
        ref = window_score_reference(queries, query_valid, keys, valid, **kw)
        assert out.shape == keys.shape[:3] and out.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=TOL[dtype], atol=1e-7)
        assert np.all(np.asarray(out)[~np.asarray(valid)] == 0.0)
        assert np.all(np.asarray(out[1]) == 0.0)  # row 1 has no valid window query

    def test_rejects_bad_arguments(self):
        queries, keys, valid, query_valid = _score_inputs(1, 1, 1, 2, 8, 64, 32, "float32")
        rows, weights = query_rows(queries, query_valid)
        with pytest.raises(ValueError, match="block_keys=48"):
            window_mass(rows, keys, valid, weights, scale=1.0, block_keys=48, interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="row_weights has shape"):
            window_mass(rows, keys, valid, weights[:, :3], scale=1.0, interpret=self.INTERPRET)


@pytest.mark.slow
class TestWindowScoresKernelInterpret(TestWindowScoresKernel):
    INTERPRET = True


# (group, window, head_dim, num_keys, dtype, smooth, temperature, block_keys): GQA groups 1-8; candidate counts that
# end mid-block, fill one small block, and span several blocks
SCORE_TPU_CASES = [
    (1, 8, 128, 300, "float32", True, 1.0, 128),
    (2, 16, 128, 256, "bfloat16", True, 1.0, 128),
    (4, 8, 64, 150, "float32", False, 0.5, 128),
    (5, 8, 128, 100, "float32", True, 1.0, 256),
    (8, 16, 128, 400, "float32", True, 2.0, 256),
]


class TestWindowScoresTPUKernel:
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_device(self):
        if not self.INTERPRET and not HAS_TPU:
            pytest.skip("compiled TPU kernel needs a TPU; TestWindowScoresTPUKernelInterpret runs it on CPU")

    def _interpret(self):
        return dispatch.tpu_interpret_params() if self.INTERPRET else False

    @pytest.mark.parametrize("case", SCORE_TPU_CASES, ids=lambda c: f"g{c[0]}-w{c[1]}-d{c[2]}-l{c[3]}-{c[4]}")
    def test_matches_reference(self, case):
        group, window, head_dim, num_keys, dtype, smooth, temperature, block_keys = case
        queries, keys, valid, query_valid = _score_inputs(3, 2, 2, group, window, head_dim, num_keys, dtype)
        kw = dict(smooth=smooth, temperature=temperature)
        out = _score_with(
            window_mass_tpu, queries, keys, valid, query_valid, **kw, block_keys=block_keys, interpret=self._interpret()
        )
        ref = window_score_reference(queries, query_valid, keys, valid, **kw)
        assert out.shape == keys.shape[:3] and out.dtype == jnp.float32
        if dtype == "float32":
            assert _rel_err(out, ref) <= 1e-5
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=TOL[dtype], atol=1e-7)
        assert np.all(np.asarray(out)[~np.asarray(valid)] == 0.0)
        assert np.all(np.asarray(out[1]) == 0.0)  # row 1 has no valid window query

    def test_garbage_in_invalid_slots_does_not_leak(self):
        queries, keys, valid, query_valid = _score_inputs(4, 2, 2, 2, 8, 128, 200, "float32")
        dirty_keys = jnp.where(valid[..., None], keys, jnp.nan)  # NaN keys on every invalid candidate
        dirty_queries = jnp.where(query_valid[:, None, None, :, None], queries, jnp.nan)  # and invalid queries
        kw = dict(smooth=True, temperature=1.0, block_keys=128, interpret=self._interpret())
        out = _score_with(window_mass_tpu, dirty_queries, dirty_keys, valid, query_valid, **kw)
        clean = _score_with(window_mass_tpu, queries, keys, valid, query_valid, **kw)
        assert np.all(np.isfinite(np.asarray(out)))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))

    def test_rejects_bad_arguments(self):
        queries, keys, valid, query_valid = _score_inputs(5, 1, 1, 2, 8, 128, 32, "float32")
        rows, weights = query_rows(queries, query_valid)
        with pytest.raises(ValueError, match="block_keys=64"):
            window_mass_tpu(rows, keys, valid, weights, scale=1.0, block_keys=64, interpret=self._interpret())
        with pytest.raises(ValueError, match="keys has shape"):
            window_mass_tpu(rows, keys[:, :, :, :64], valid, weights, scale=1.0, interpret=self._interpret())


@pytest.mark.slow
class TestWindowScoresTPUKernelInterpret(TestWindowScoresTPUKernel):
    INTERPRET = True


# ------------------------------------------------------------------------------------------------------------
# window scores: reference vs NumPy
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
class TestWindowScoreReference:
    @pytest.mark.parametrize(
        "group,window,num_keys,dtype,smooth,temperature",
        [
            (2, 8, 40, "float32", True, 1.0),
            (4, 4, 33, "float32", False, 1.0),
            (1, 16, 20, "float32", True, 0.7),
            (8, 4, 24, "bfloat16", True, 1.0),
        ],
    )
    def test_window_scores_match_numpy(self, group, window, num_keys, dtype, smooth, temperature):
        queries, keys, valid, query_valid = _score_inputs(2, 2, 3, group, window, 64, num_keys, dtype)
        out = window_score_reference(queries, query_valid, keys, valid, smooth=smooth, temperature=temperature)
        expected = _np_scores(queries, keys, valid, query_valid, smooth, temperature)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-8)
        assert np.all(np.asarray(out)[~np.asarray(valid)] == 0.0)

    def test_window_scores_sum_to_one_without_smoothing(self):
        # each valid query's distribution sums to 1, so the group/window mean does too
        queries, keys, valid, query_valid = _score_inputs(3, 2, 2, 2, 8, 64, 50, "float32")
        out = np.asarray(window_score_reference(queries, query_valid, keys, valid, smooth=False))
        np.testing.assert_allclose(out[0, 1].sum(), 1.0, rtol=1e-5)
        assert out[0, 0].sum() == 0.0 and out[1].sum() == 0.0

    def test_rejects_bad_arguments(self):
        queries, keys, valid, query_valid = _score_inputs(1, 1, 1, 2, 8, 64, 32, "float32")
        with pytest.raises(ValueError, match="temperature=0"):
            window_score(queries, query_valid, keys, valid, temperature=0.0)
        with pytest.raises(ValueError, match="query_valid has shape"):
            window_score(queries, query_valid[:, :3], keys, valid)
        with pytest.raises(ValueError, match="impl='triton'"):
            window_score(queries, query_valid, keys, valid, impl="triton")


# ------------------------------------------------------------------------------------------------------------
# dispatch: by the platform being lowered for
# ------------------------------------------------------------------------------------------------------------
KERNEL_NAMES = {
    "decode": {"cuda": "vase_decode_attention", "tpu": "vase_decode_attention_tpu"},
    "scores": {"cuda": "vase_window_scores_accumulate", "tpu": "vase_window_mass_tpu"},
}


def _lowered(fn, args, platform: str) -> str:
    with dispatch.lowering_target(platform):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("op", ["decode", "scores"])
def test_auto_picks_the_kernel_of_the_lowering_platform(op):
    if op == "decode":
        args = _decode_inputs(14, 2, 2, 4, 128, 512, 300, "bfloat16")
        fn = pallas_kernels.get_decode_attention("auto")
    else:
        queries, keys, valid, query_valid = _score_inputs(15, 2, 2, 4, 16, 128, 512, "bfloat16")
        args = (queries, query_valid, keys, valid)
        fn = functools.partial(window_score, impl="auto")
    cuda, tpu, cpu = (_lowered(fn, args, p) for p in ("cuda", "tpu", "cpu"))
    assert "__gpu$xla.gpu.triton" in cuda and KERNEL_NAMES[op]["cuda"] in cuda and "tpu_custom_call" not in cuda
    assert "tpu_custom_call" in tpu and KERNEL_NAMES[op]["tpu"] in tpu and "triton" not in tpu
    assert "custom_call" not in cpu  # the XLA path


# on an accelerator, the other platform's kernel family would run in interpret mode: not what a device run checks
OTHER_FAMILY = {"gpu": "pallas_tpu", "tpu": "pallas_gpu"}.get(jax.default_backend())


@pytest.mark.slow
def test_explicit_impls_on_this_host():
    q, k, v, pos, n = _decode_inputs(16, 1, 2, 2, 128, 256, 200, "float32")
    ref = decode_attention_reference(q, k, v, pos, n)
    for impl in (i for i in dispatch.IMPLS if i != OTHER_FAMILY):
        out = jax.jit(pallas_kernels.get_decode_attention(impl))(q, k, v, pos, n)
        assert _rel_err(out, ref) <= 1e-5, impl
    with pytest.raises(ValueError, match="impl='triton'"):
        pallas_kernels.get_decode_attention("triton")
    assert dispatch.check_impl("pallas_tpu") == "pallas_tpu"


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "pallas_tpu"])
def test_stacked_cache_layer(impl):
    if impl == OTHER_FAMILY:
        pytest.skip(f"{impl} would run in interpret mode on this {jax.default_backend()}")
    # a cache stacked over 3 layers, the layer a traced index: every implementation equals attention over that layer
    q, k, v, pos, n = _decode_inputs(17, 2, 2, 4, 128, 256, 200, "float32")
    ks, vs = (jnp.stack([x, 0.5 * x + 1, -x]) for x in (k, v))  # [3, batch, kv_heads, capacity, head_dim]
    ps = jnp.stack([pos, pos, pos.at[:, :, 100:].set(-1)])  # layer 2: its own empty slots
    attend = jax.jit(pallas_kernels.get_decode_attention(impl))
    for layer in range(3):
        out = attend(q, ks, vs, ps, n, jnp.int32(layer))
        ref = decode_attention_reference(q, ks[layer], vs[layer], ps[layer], n)
        assert _rel_err(out, ref) <= 1e-5, (impl, layer)
