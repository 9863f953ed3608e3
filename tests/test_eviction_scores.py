"""The shared eviction scores and selection helpers vs float64 NumPy references of the spec's formulas."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from vase_jax.eviction import scores

TOL = dict(rtol=2e-5, atol=1e-6)


# ---- NumPy references (float64, one (row, kv head) at a time, on the valid candidates only) ----------------
def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_avg_pool5(p):
    n = len(p)
    return np.array([sum(p[j + o] for o in range(-2, 3) if 0 <= j + o < n) / 5.0 for j in range(n)])


def np_max_pool(p, kernel):
    n, r = len(p), kernel // 2
    return np.array([max(p[max(0, j - r) : min(n, j + r + 1)]) for j in range(n)])


def np_window_score(q, qv, k, temperature=1.0, smooth=True):
    """q [G, W, D], qv [W] bool, k [n, D] -> s [n] (spec 3.0)."""
    d = k.shape[-1]
    per_head = []
    for g in range(q.shape[0]):
        rows = [np_softmax(q[g, t] @ k.T / (math.sqrt(d) * temperature)) for t in range(q.shape[1]) if qv[t]]
        p = np.mean(rows, axis=0)
        per_head.append(np_avg_pool5(p) if smooth else p)
    return np.mean(per_head, axis=0)


def np_redundancy_full(k):
    """VaSE R-KV redundancy from the full L x L matrix."""
    kn = k / (np.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)
    c = kn @ kn.T
    np.fill_diagonal(c, 0.0)
    return np_softmax(c.mean(axis=0))


def np_rkv_official(q, k, lam, threshold=0.5, kernel=7):
    """Official R-KV score (R1KV._compute_scores + cal_similarity), q [G, alpha, D] the window, k [n, D]."""
    d, n = k.shape[-1], k.shape[0]
    logits = np.einsum("gtd,nd->gtn", q, k).max(axis=0) / math.sqrt(d)  # [alpha, n]
    attn = np_max_pool(np_softmax(logits).mean(axis=0), kernel)
    kn = k / (np.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)
    c = kn @ kn.T
    np.fill_diagonal(c, 0.0)
    idx = np.where(c > threshold, np.arange(n)[None, :], 0)
    last = idx.max(axis=-1)
    c[np.arange(n), last] = 0.0
    red = np_softmax(c.mean(axis=0))
    return lam * attn - (1 - lam) * red


# ---- inputs ------------------------------------------------------------------------------------------------
def padded_case(seed, b=2, h=2, g=2, w=6, length=20, d=8, pads=(0, 5)):
    """Random candidates with an invalid (garbage) prefix of pads[r] slots in row r."""
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(b, h, length, d)) * 1.5
    values = rng.normal(size=(b, h, length, d))
    queries = rng.normal(size=(b, h, g, w, d)) * 1.5
    valid = np.zeros((b, h, length), bool)
    for r, p in enumerate(pads):
        valid[r, :, p:] = True
        keys[r, :, :p] = 1e3 * rng.normal(size=(h, p, d))  # garbage that would dominate if it leaked
    return keys, values, queries, valid


PG = jax.jit(scores.position_gumbel)
GP = jax.jit(scores.gaussian_projection, static_argnums=(2, 3))


def f32(x):
    return jnp.asarray(x, jnp.float32)


# ---- pooling -----------------------------------------------------------------------------------------------
def test_avg_pool5_zero_padding_divides_by_five():
    x = np.random.default_rng(0).normal(size=(2, 3, 11))
    got = np.asarray(jax.jit(scores.avg_pool)(f32(x)))
    want = np.apply_along_axis(np_avg_pool5, -1, x)
    np.testing.assert_allclose(got, want, **TOL)
    # edge: the first output averages 3 real entries but divides by 5
    np.testing.assert_allclose(got[0, 0, 0], x[0, 0, :3].sum() / 5, **TOL)


def test_max_pool_minus_inf_padding():
    x = np.random.default_rng(1).normal(size=(2, 13))
    got = np.asarray(jax.jit(scores.max_pool, static_argnums=1)(f32(x), 7))
    np.testing.assert_allclose(got, np.apply_along_axis(np_max_pool, -1, x, 7), **TOL)


def test_pool_rejects_even_kernel():
    with pytest.raises(ValueError, match="kernel=4"):
        scores.avg_pool(jnp.zeros((3, 8)), 4)


# ---- window attention score --------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("smooth", [True, False])
def test_window_score_padded_prefix_equals_unpadded(group, smooth):
    pads = (0, 5)
    keys, _, queries, valid = padded_case(2, g=group, pads=pads)
    qv = np.ones((2, queries.shape[3]), bool)
    fn = jax.jit(scores.window_attention_score, static_argnames=("temperature", "smooth"))
    got = np.asarray(fn(f32(queries), jnp.asarray(qv), f32(keys), jnp.asarray(valid), smooth=smooth))
    for r, p in enumerate(pads):
        assert np.all(got[r, :, :p] == 0.0)
        for hh in range(keys.shape[1]):
            want = np_window_score(queries[r, hh], qv[r], keys[r, hh, p:], smooth=smooth)
            np.testing.assert_allclose(got[r, hh, p:], want, **TOL)


def test_window_score_group_mean_and_temperature():
    """s is the plain mean over the G query heads of each kv head's per-head scores."""
    keys, _, queries, valid = padded_case(3, g=4, pads=(0, 0))
    qv = jnp.ones((2, queries.shape[3]), bool)
    full = scores.window_attention_score(f32(queries), qv, f32(keys), jnp.asarray(valid), temperature=2.0)
    per_head = [
        scores.window_attention_score(
            f32(queries[:, :, i : i + 1]), qv, f32(keys), jnp.asarray(valid), temperature=2.0
        )
        for i in range(4)
    ]
    np.testing.assert_allclose(np.asarray(full), np.mean(np.asarray(per_head), axis=0), **TOL)
    want = np_window_score(queries[1, 0], np.ones(queries.shape[3], bool), keys[1, 0], temperature=2.0)
    np.testing.assert_allclose(np.asarray(full)[1, 0], want, **TOL)


def test_window_score_ignores_invalid_queries():
    keys, _, queries, valid = padded_case(4, pads=(3, 0))
    qv = np.ones((2, queries.shape[3]), bool)
    qv[0, :2] = False  # two padding queries in row 0
    qv[1, 4] = False
    queries[0, :, :, :2] = 1e4  # garbage that would dominate if it counted
    queries[1, :, :, 4] = np.nan
    got = np.asarray(
        scores.window_attention_score(f32(queries), jnp.asarray(qv), f32(keys), jnp.asarray(valid))
    )
    assert np.isfinite(got).all()
    for r, p in enumerate((3, 0)):
        for hh in range(2):
            want = np_window_score(queries[r, hh], qv[r], keys[r, hh, p:])
            np.testing.assert_allclose(got[r, hh, p:], want, **TOL)


# ---- value magnitude ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, ref",
    [
        ("range", lambda v: v.max(-1) - v.min(-1)),
        ("l2", lambda v: np.linalg.norm(v, axis=-1)),
        ("var", lambda v: v.var(-1, ddof=1)),
    ],
)
def test_value_magnitude(kind, ref):
    v = np.random.default_rng(5).normal(size=(2, 3, 7, 16)) * 2 + 0.5
    got = np.asarray(jax.jit(scores.value_magnitude, static_argnums=1)(f32(v), kind))
    np.testing.assert_allclose(got, ref(v), rtol=1e-5)


def test_value_magnitude_rejects_unknown():
    with pytest.raises(ValueError, match="magnitude='abs'"):
        scores.value_magnitude(jnp.zeros((1, 1, 2, 4)), "abs")


# ---- R-KV --------------------------------------------------------------------------------------------------
def test_rkv_closed_form_equals_full_matrix():
    pads = (0, 7)
    keys, _, _, valid = padded_case(6, length=24, pads=pads)
    keys[:, :, 10] += 3.0  # some strongly similar keys
    got = np.asarray(jax.jit(scores.rkv_redundancy)(f32(keys), jnp.asarray(valid)))
    for r, p in enumerate(pads):
        assert np.all(got[r, :, :p] == 0.0)
        for hh in range(2):
            np.testing.assert_allclose(got[r, hh, p:], np_redundancy_full(keys[r, hh, p:]), **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 2])
def test_rkv_official_matches_numpy_port(group):
    """Importance (GQA max, last alpha queries, max-pool 7) and retain-last redundancy vs the official."""
    pads, alpha, lam = (0, 4), 3, 0.3
    rng = np.random.default_rng(7)
    keys, _, queries, valid = padded_case(8, g=group, length=22, pads=pads)
    base = rng.normal(size=8)
    keys[:, :, 8:16] = base + 0.3 * keys[:, :, 8:16]  # a cluster above the 0.5 cosine threshold
    qv = np.ones((2, queries.shape[3]), bool)
    qv[1, -2] = False  # an invalid query inside the last alpha: the window reaches one further back
    window = scores.last_valid_queries(jnp.asarray(qv), alpha)
    imp = scores.rkv_official_importance(f32(queries), window, f32(keys), jnp.asarray(valid), pool=7)
    red = scores.rkv_official_redundancy(f32(keys), jnp.asarray(valid), 0.5)
    got = np.asarray(lam * imp - (1 - lam) * red)
    for r, p in enumerate(pads):
        sel = np.flatnonzero(qv[r])[-alpha:]
        for hh in range(2):
            want = np_rkv_official(queries[r, hh][:, sel], keys[r, hh, p:], lam)
            np.testing.assert_allclose(got[r, hh, p:], want, **TOL)


def test_last_valid_queries():
    qv = jnp.asarray([[True, True, True, True, True], [True, False, True, True, False], [False] * 5])
    got = np.asarray(scores.last_valid_queries(qv, 2))
    np.testing.assert_array_equal(got, [[0, 0, 0, 1, 1], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]])


# ---- CUR leverage ------------------------------------------------------------------------------------------
def test_cur_leverage_product():
    pads = (2, 0)
    keys, values, _, valid = padded_case(9, d=16, pads=pads)
    g = GP(jax.random.key(3), jnp.asarray([4, 9]), 16, 5)  # [b, D, r]
    got = np.asarray(jax.jit(scores.cur_leverage)(f32(keys), f32(values), g, jnp.asarray(valid)))
    g64 = np.asarray(g, np.float64)
    for r, p in enumerate(pads):
        assert np.all(got[r, :, :p] == 0.0)
        for hh in range(2):
            k2 = np.sum((keys[r, hh, p:] @ g64[r]) ** 2, -1)
            v2 = np.sum((values[r, hh, p:] @ g64[r]) ** 2, -1)
            np.testing.assert_allclose(got[r, hh, p:], k2 * v2 / np.sum(k2 * v2), rtol=1e-4)


def test_gaussian_projection_per_row_and_scale():
    key = jax.random.key(11)
    a = np.asarray(GP(key, jnp.asarray([0, 1, 2]), 64, 20))
    b = np.asarray(GP(key, jnp.asarray([2]), 64, 20))
    np.testing.assert_array_equal(a[2], b[0])  # a row's G depends on its id only
    assert not np.allclose(a[0], a[1])
    assert abs(a.var() * 20 - 1.0) < 0.1  # N(0, 1)/sqrt(r)


# ---- selection helpers -------------------------------------------------------------------------------------
def test_masked_top_k_tiers():
    score = jnp.asarray([[[0.3, 0.9, 0.1, 0.5, 0.7, 0.2]]])
    eligible = jnp.asarray([[[True, False, True, True, False, False]]])
    allowed = jnp.asarray([[[True, True, True, True, False, True]]])
    got = np.asarray(scores.masked_top_k(score, eligible, 6, allowed))[0, 0]
    # eligible by score, then allowed-only in slot order, then excluded
    np.testing.assert_array_equal(got, [3, 0, 2, 1, 5, 4])


def test_scatter_and_sink_mask():
    ids = jnp.asarray([[[3, 0], [1, 2]]])
    np.testing.assert_array_equal(np.asarray(scores.scatter_mask(ids, 4)), [[[1, 0, 0, 1], [0, 1, 1, 0]]])
    pos = jnp.asarray([[[-1, -1, 7, 2, 0, 9, 1, 3, 5]]])
    np.testing.assert_array_equal(
        np.asarray(jax.jit(scores.sink_mask, static_argnums=1)(pos, 4))[0, 0], [0, 0, 0, 1, 1, 0, 1, 1, 0]
    )
    few = jnp.asarray([[[-1, 5, -1, 2]]])  # fewer valid slots than sinks: only valid ones
    np.testing.assert_array_equal(
        np.asarray(jax.jit(scores.sink_mask, static_argnums=1)(few, 4))[0, 0], [0, 1, 0, 1]
    )


def _successive_probabilities(w, k):
    """Exact probability of every ordered k-draw of successive sampling without replacement."""
    w = np.asarray(w, np.float64)
    out = {}
    for seq in itertools.permutations(range(len(w)), k):
        prob, left = 1.0, w.sum()
        for i in seq:
            prob *= w[i] / left
            left -= w[i]
        out[seq] = prob
    return out


_N_DRAWS = 20_000


@pytest.fixture(scope="module")
def gumbel_draws():
    w = np.array([0.30, 0.22, 0.18, 0.12, 0.08, 0.06, 0.04])
    length = len(w) + 1  # one extra, ineligible slot
    weights = jnp.asarray(np.append(w, 0.5), jnp.float32)[None, None]  # [1, 1, L]
    eligible = jnp.asarray(np.arange(length) < len(w))[None, None]
    pos = jnp.asarray(np.arange(length) * 3 + 2, jnp.int32)[None, None]  # absolute positions, not slots

    @jax.jit
    def draw(keys):
        def one(key):
            noise = scores.position_gumbel(key, jnp.zeros((1,), jnp.int32), pos)
            return scores.gumbel_top_k(weights, noise, eligible, 3)[0, 0]

        return jax.vmap(one)(keys)

    got = np.asarray(draw(jax.random.split(jax.random.key(2024), _N_DRAWS)))
    return w, got


def test_gumbel_top_k_first_and_second_draw_chi_square(gumbel_draws):
    w, got = gumbel_draws
    assert got.max() < len(w)  # the ineligible slot is never drawn while eligible ones remain
    assert all(len(set(r)) == 3 for r in got[:200])
    exact = _successive_probabilities(w, 2)
    # first draw ~ w / sum(w)
    first = np.bincount(got[:, 0], minlength=len(w))
    assert stats.chisquare(first, _N_DRAWS * w / w.sum()).pvalue > 1e-3
    # ordered (first, second) pairs ~ successive sampling (checks the draw order, not only the set)
    pairs = list(exact)
    counts = np.array([np.sum((got[:, 0] == i) & (got[:, 1] == j)) for i, j in pairs])
    expected = _N_DRAWS * np.array([exact[p] for p in pairs])
    assert stats.chisquare(counts, expected).pvalue > 1e-3


def test_gumbel_top_k_inclusion_vs_successive_sampling(gumbel_draws):
    w, got = gumbel_draws
    inclusion = np.zeros(len(w))
    for seq, prob in _successive_probabilities(w, 3).items():
        inclusion[list(seq)] += prob
    freq = np.array([np.mean(np.any(got == i, axis=1)) for i in range(len(w))])
    se = np.sqrt(inclusion * (1 - inclusion) / _N_DRAWS)
    assert np.all(np.abs(freq - inclusion) < 4.5 * se), (freq, inclusion)
    # and against explicit successive sampling in NumPy (two-sample, same tolerance)
    rng = np.random.default_rng(0)
    ref = np.zeros(len(w))
    for _ in range(_N_DRAWS):
        left = list(range(len(w)))
        for _ in range(3):
            p = w[left] / w[left].sum()
            ref[left.pop(rng.choice(len(left), p=p))] += 1
    ref /= _N_DRAWS
    assert np.all(np.abs(freq - ref) < 4.5 * np.sqrt(2) * se), (freq, ref)


def test_gumbel_top_k_zero_weights_drawn_last_in_random_order():
    weights = jnp.broadcast_to(jnp.asarray([0.5, 0.0, 0.5, 0.0, 0.9]), (40, 1, 5))
    eligible = jnp.broadcast_to(jnp.asarray([True, True, True, True, False]), (40, 1, 5))
    noise = jax.random.gumbel(jax.random.key(0), (40, 1, 5))
    got = np.asarray(jax.jit(scores.gumbel_top_k, static_argnums=3)(weights, noise, eligible, 5))[:, 0]
    for row in got:
        assert set(row[:2]) == {0, 2} and set(row[2:4]) == {1, 3} and row[4] == 4
    assert set(got[:, 2]) == {1, 3}  # zero-weight entries come in random order, not slot order


def test_position_gumbel_keyed_by_position_row_and_head():
    key = jax.random.key(5)
    pos = jnp.asarray([[[-1, 4, 9, 2], [9, 2, 4, -1]]], jnp.int32)  # [1, 2, 4]
    a = np.asarray(PG(key, jnp.asarray([3]), pos))
    shifted = jnp.asarray([[[-1, -1, 4, 9, 2], [-1, 9, 2, 4, -1]]], jnp.int32)
    b = np.asarray(PG(key, jnp.asarray([3]), shifted))
    np.testing.assert_array_equal(a[0, 0, 1:], b[0, 0, 2:])  # same token, different slot: same noise
    np.testing.assert_array_equal(a[0, 1, :3], b[0, 1, 1:4])
    assert a[0, 0, 2] != a[0, 1, 0]  # same position, other kv head: independent noise
    other_row = np.asarray(PG(key, jnp.asarray([4]), pos))
    assert not np.any(other_row[0, 0, 1:] == a[0, 0, 1:])
