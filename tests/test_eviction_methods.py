"""Every registered eviction method: invariants, a float64 NumPy re-implementation of it, randomness.

Inputs are random candidates (and B = 8 buffer slots, and h2o's accumulated attention) with invalid slots (a
padded prefix, and in one row an invalid suffix with fewer valid candidates than K), positions shuffled within each
(row, kv head), and two invalid (garbage) queries.
The NumPy references compute the spec's formulas on the valid block only and order candidates by (tier, score,
slot); stochastic methods are compared given the same random numbers (position-keyed Gumbel noise, projection
G), whose distribution is tested in test_eviction_scores.py.
"""

from __future__ import annotations

import math

import calibrations
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vase_jax.eviction import METHODS, EvictionConfig, EvictionInputs, framework, scores

B, H, G, W, L, D = 3, 2, 2, 8, 40, 16
BUF = 8  # buffer slots (the config's B)
VALID_BLOCKS = ((0, 40), (6, 40), (14, 34))  # per row: valid slots [start, stop); row 2 has 20 < K valid
EVICTING = sorted(METHODS)
STOCHASTIC = {"attn_sample", "range_sample_attn", "vase_attnv", "attn_random", "vase_dkv", "random", "curdkv"}
EVENT_KEYED = STOCHASTIC - {"curdkv"}  # curdkv's projection comes from the layer key, fixed across evictions
SINK_MODES = {"vase_attnv", "curdkv", "vase_dkv"}
PROTECT_MODES = {"range_attn", "range_sample_attn", "vase_attnv"}


def make_config(method, **kw):
    if method == "rkv_official":
        kw = {"rkv_window": 4} | kw
    if method == "triattention":  # statistics for one layer of H * G query heads
        kw = {"calibration": calibrations.stats_file(1, H * G, D, 10000.0)} | kw
    return EvictionConfig(method=method, budget=32, buffer=BUF, **kw).validate()  # K = 24 (N for triattention)


def make_inputs(seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(B, H, L, D)) * 1.5
    keys[:, :, 5:9] += rng.normal(size=D) * 2.0  # a few similar keys (R-KV threshold rule)
    values = rng.normal(size=(B, H, L, D)) * rng.uniform(0.5, 2.0, size=(B, H, L, 1))
    queries = rng.normal(size=(B, H, G, W, D)) * 1.5
    pos = np.full((B, H, L), -1, np.int32)
    for r, (lo, hi) in enumerate(VALID_BLOCKS):
        for h in range(H):
            pos[r, h, lo:hi] = rng.permutation(hi - lo)
        keys[r, :, :lo] = keys[r, :, hi:] = 1e3  # garbage in invalid slots
        values[r, :, :lo] = values[r, :, hi:] = 1e3
    query_valid = np.ones((B, W), bool)
    query_valid[1, :2] = False
    queries[1, :, :, :2] = 1e4
    buffer_keys = rng.normal(size=(B, H, BUF, D)) * 1.5
    buffer_keys[:, :, -2:] = keys[:, :, 6:8] + 0.2 * rng.normal(size=(B, H, 2, D))  # similar to a candidate
    mass = rng.uniform(0.0, 5.0, size=(B, H, L))  # an accumulated attention (h2o's state)
    mass = np.where(pos >= 0, mass, 1e6)  # garbage in invalid slots
    return EvictionInputs(
        keys=jnp.asarray(keys, jnp.float32),
        values=jnp.asarray(values, jnp.float32),
        queries=jnp.asarray(queries, jnp.float32),
        query_valid=jnp.asarray(query_valid),
        pos=jnp.asarray(pos),
        layer_key=jax.random.key(100),
        row_ids=jnp.arange(B, dtype=jnp.int32),
        buffer_keys=jnp.asarray(buffer_keys, jnp.float32),
        buffer_values=jnp.asarray(rng.normal(size=(B, H, BUF, D)), jnp.float32),
        buffer_pos=jnp.broadcast_to(jnp.arange(100, 100 + BUF, dtype=jnp.int32), (B, H, BUF)),
        state={"attention_mass": jnp.asarray(mass, jnp.float32)},
        layer=jnp.int32(0),
        prompt_length=jnp.asarray([0, 3, 0], jnp.int32),  # row 1: positions 0-2 are its prompt
        next_position=jnp.full((B,), 120, jnp.int32),
    )


_JIT = {}


def select(method, inputs, key, config=None):
    fn = _JIT.setdefault(method, jax.jit(framework.run_policy, static_argnums=1))
    return np.asarray(fn(inputs, config or make_config(method), key))


@pytest.fixture(scope="module")
def inputs():
    return make_inputs()


# ---- NumPy references (float64) ----------------------------------------------------------------------------
def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_pool(p, kernel, op):
    n, r = len(p), kernel // 2
    if op == "avg":
        return np.array([p[max(0, j - r) : j + r + 1].sum() / kernel for j in range(n)])
    return np.array([p[max(0, j - r) : j + r + 1].max() for j in range(n)])


def np_window_score(q, qv, k, smooth=True):
    rows = [[np_softmax(q[g, t] @ k.T / math.sqrt(D)) for t in range(W) if qv[t]] for g in range(q.shape[0])]
    per_head = [np.mean(r, axis=0) for r in rows]
    if smooth:
        per_head = [np_pool(p, 5, "avg") for p in per_head]
    return np.mean(per_head, axis=0)


def np_unit(k):
    return k / (np.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)


def np_rkv_vase_redundancy(k):
    c = np_unit(k) @ np_unit(k).T
    np.fill_diagonal(c, 0.0)
    return np_softmax(c.mean(0))


def np_rkv_official(q, qv, k, window_keys, cfg):
    """R-KV's score on the cache [k, window_keys]: importance over k, redundancy over both, sliced to k."""
    sel = np.flatnonzero(qv)[-cfg.rkv_window :]
    logits = np.einsum("gtd,nd->gtn", q[:, sel], k).max(0) / math.sqrt(D)
    imp = np_pool(np_softmax(logits).mean(0), cfg.rkv_pool, "max")
    every = np.concatenate([k, window_keys])
    c = np_unit(every) @ np_unit(every).T
    np.fill_diagonal(c, 0.0)
    last = np.where(c > cfg.rkv_threshold, np.arange(len(every))[None], 0).max(-1)
    c[np.arange(len(every)), last] = 0.0
    red = np_softmax(c.mean(0))[: len(k)]
    return cfg.rkv_lambda * imp - (1 - cfg.rkv_lambda) * red


def np_keydiff(k):
    """kvpress KeyDiffPress: -cos(k_j, mean_j k_j / ||k_j||)."""
    anchor = (k / np.linalg.norm(k, axis=-1, keepdims=True)).mean(0)
    return -(k @ anchor) / (np.linalg.norm(k, axis=-1) * np.linalg.norm(anchor))


def np_magnitude(v, kind):
    return {"range": v.max(-1) - v.min(-1), "l2": np.linalg.norm(v, axis=-1), "var": v.var(-1, ddof=1)}[kind]


def np_rank(key, tier, k):
    """The first k slots ordered by tier (desc), key (desc), slot (asc)."""
    return np.lexsort((np.arange(len(key)), -key, -tier))[:k]


def np_top(score, eligible, allowed, k):
    tier = np.where(eligible, 2, np.where(allowed, 1, 0))
    return np_rank(np.where(eligible, score, 0.0), tier, k)


def np_sample(weights, noise, eligible, allowed, k):
    positive = eligible & (weights > 0)
    tier = np.where(positive, 3, np.where(eligible, 2, np.where(allowed, 1, 0)))
    key = np.where(positive, np.log(np.where(positive, weights, 1.0)) + noise, np.where(eligible, noise, 0.0))
    return np_rank(key, tier, k)


def np_select(method, cfg, x, r, h, noise, proj):
    """Reference selection for row r, kv head h (slot indices into the full candidate array)."""
    lo, hi = VALID_BLOCKS[r]
    keys, values = np.asarray(x.keys, np.float64)[r, h], np.asarray(x.values, np.float64)[r, h]
    q, qv, pos = (
        np.asarray(x.queries, np.float64)[r, h],
        np.asarray(x.query_valid)[r],
        np.asarray(x.pos)[r, h],
    )
    noise = noise[r, h]
    valid = pos >= 0
    everything = np.ones(L, bool)
    k_keep, nv = cfg.kept, cfg.num_value_slots

    def on_block(f):
        out = np.zeros(L)
        out[lo:hi] = f(keys[lo:hi], values[lo:hi])
        return out

    s = on_block(lambda k, v: np_window_score(q, qv, k, getattr(cfg.options, "smooth", True)))
    sinks = valid & np.isin(pos, np.sort(pos[valid])[: cfg.sink_slots])

    def protect_then(m, sample):
        prot = np_top(m, valid, everything, nv)
        free = ~np.isin(np.arange(L), prot)
        if sample:
            rest = np_sample(s, noise, valid & free, free, k_keep - nv)
        else:
            rest = np_top(s, valid & free, free, k_keep - nv)
        return np.concatenate([prot, rest])

    rng_ = on_block(lambda k, v: np_magnitude(v, "range"))
    if method == "snapkv":
        return np_top(s, valid, everything, k_keep)
    if method == "attn_sample":
        return np_sample(s, noise, valid, everything, k_keep)
    if method == "range_attn":
        return protect_then(rng_, sample=False)
    if method == "range_sample_attn":
        return protect_then(rng_, sample=True)
    if method == "vase_attnv":
        m = on_block(lambda k, v: np_magnitude(v, cfg.magnitude))
        return protect_then(np.where(sinks, np.inf, m), sample=True)
    if method == "attn_random":
        rand = np_top(noise, valid, everything, nv)
        free = ~np.isin(np.arange(L), rand)
        return np.concatenate([rand, np_top(s, valid & free, free, k_keep - nv)])
    if method == "evict_large_range":
        return np_top(-rng_, valid, everything, k_keep)
    if method == "rkv":
        red = on_block(lambda k, v: np_rkv_vase_redundancy(k))
        lam = cfg.rkv_lambda
        return np_top(lam * s - (1 - lam) * red, valid, everything, k_keep)
    if method == "rkv_official":
        window_keys = np.asarray(x.buffer_keys, np.float64)[r, h, -cfg.rkv_window :]
        return np_top(on_block(lambda k, v: np_rkv_official(q, qv, k, window_keys, cfg)), valid, everything, k_keep)
    if method == "keydiff":
        return np_top(on_block(lambda k, v: np_keydiff(k)), valid, everything, k_keep)
    if method == "h2o":
        return np_top(np.asarray(x.state["attention_mass"], np.float64)[r, h], valid, everything, k_keep)
    if method in ("curdkv", "vase_dkv"):
        g = proj[r]

        def leverage(k, v):
            prod = np.sum((k @ g) ** 2, -1) * np.sum((v @ g) ** 2, -1)
            return prod / prod.sum()

        return np_top(np.where(sinks, 1.0, on_block(leverage)), valid, everything, k_keep)
    if method == "random":
        return np_top(noise, valid, everything, k_keep)
    raise AssertionError(method)


_NOISE = jax.jit(scores.position_gumbel)
_PROJECTION = jax.jit(scores.gaussian_projection, static_argnums=(2, 3))


def random_numbers(method, cfg, x, key):
    """The method's random numbers: position-keyed Gumbel noise [b, h, L] and projections G [b, D, r]."""
    noise = np.asarray(_NOISE(key, x.row_ids, x.pos), np.float64)
    proj_key = x.layer_key if method == "curdkv" else key
    rank = getattr(cfg.options, "projection_rank", 20)  # only the CUR methods have the option
    return noise, np.asarray(_PROJECTION(proj_key, x.row_ids, D, rank), np.float64)


# ---- tests -------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(set(EVICTING) - {"triattention"}))  # its reference: test_triattention
def test_method_invariants_and_numpy_reference(method, inputs):
    cfg = make_config(method)
    key = jax.random.key(1)
    kept = select(method, inputs, key, cfg)
    assert kept.shape == (B, H, cfg.kept) and kept.dtype == np.int32
    pos = np.asarray(inputs.pos)
    noise, proj = random_numbers(method, cfg, inputs, key)
    for r, (lo, hi) in enumerate(VALID_BLOCKS):
        for h in range(H):
            ids = kept[r, h]
            assert len(set(ids.tolist())) == cfg.kept, "indices must be distinct"
            assert ids.min() >= 0 and ids.max() < L
            kept_valid = pos[r, h, ids] >= 0
            if hi - lo >= cfg.kept:
                assert kept_valid.all(), "invalid slot kept while valid candidates remained"
            else:
                assert set(range(lo, hi)) <= set(ids.tolist()), "every valid candidate must be kept"
            if method in SINK_MODES:
                assert set(pos[r, h, ids[: cfg.sink_slots]].tolist()) == set(range(cfg.sink_slots))
            want = np_select(method, cfg, inputs, r, h, noise, proj)
            if method in PROTECT_MODES:
                nv = cfg.num_value_slots
                assert set(ids[:nv].tolist()) == set(want[:nv].tolist()), "protected value slots"
            np.testing.assert_array_equal(ids, want, err_msg=f"{method} row {r} head {h}")


@pytest.mark.parametrize("magnitude", ["l2", "var"])
def test_vase_attnv_magnitudes(magnitude, inputs):
    cfg = make_config("vase_attnv", magnitude=magnitude)
    key = jax.random.key(3)
    kept = select("vase_attnv", inputs, key, cfg)
    noise, proj = random_numbers("vase_attnv", cfg, inputs, key)
    for r in range(B):
        for h in range(H):
            np.testing.assert_array_equal(kept[r, h], np_select("vase_attnv", cfg, inputs, r, h, noise, proj))


@pytest.mark.parametrize("method", EVICTING)
def test_keys_reproducible_and_stochasticity(method, inputs):
    a = select(method, inputs, jax.random.key(1))
    np.testing.assert_array_equal(a, select(method, inputs, jax.random.key(1)))
    b = select(method, inputs, jax.random.key(2))
    same_sets = all(set(a[r, h]) == set(b[r, h]) for r in range(2) for h in range(H))  # rows with > K valid
    assert METHODS[method].stochastic == (method in STOCHASTIC)
    if method in EVENT_KEYED:
        assert not same_sets, "a different eviction key should change the kept set"
    else:
        np.testing.assert_array_equal(a, b)


def test_curdkv_projection_is_per_layer(inputs):
    a = select("curdkv", inputs, jax.random.key(1))
    b = select("curdkv", inputs.replace(layer_key=jax.random.key(101)), jax.random.key(1))
    assert any(set(a[r, h]) != set(b[r, h]) for r in range(2) for h in range(H))


@pytest.mark.parametrize("method", EVICTING)
def test_row_invariance(method, inputs):
    """A row's kept slots do not depend on the other rows of the batch."""
    key = jax.random.key(7)
    batch = select(method, inputs, key)
    for r in range(B):
        alone = jax.tree.map(lambda x, r=r: x[r : r + 1] if x.ndim else x, inputs)  # layer_key is a scalar
        np.testing.assert_array_equal(select(method, alone, key)[0], batch[r], err_msg=f"row {r}")


@pytest.mark.parametrize("method", EVICTING)
def test_padding_invariance(method, inputs):
    """Extra invalid slots before and after the candidates change no kept position."""
    key = jax.random.key(9)
    pre, post = 5, 3

    def pad(x, fill):
        widths = [(0, 0), (0, 0), (pre, post)] + [(0, 0)] * (x.ndim - 3)
        return jnp.pad(x, widths, constant_values=fill)

    padded = inputs.replace(
        keys=pad(inputs.keys, 7.0), values=pad(inputs.values, -9.0), pos=pad(inputs.pos, -1),
        state={"attention_mass": pad(inputs.state["attention_mass"], 1e6)},
    )
    base = select(method, inputs, key)
    wide = select(method, padded, key)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(padded.pos), wide, 2),
        np.take_along_axis(np.asarray(inputs.pos), base, 2),
    )


def test_registry_flags():
    needs = {m for m, v in METHODS.items() if v.needs_queries}
    assert needs == {
        "snapkv",
        "attn_sample",
        "range_attn",
        "range_sample_attn",
        "vase_attnv",
        "attn_random",
        "rkv",
        "rkv_official",
    }
    assert {m for m, v in METHODS.items() if v.stochastic} == STOCHASTIC
    assert {m for m, v in METHODS.items() if v.state} == {"h2o"}
    assert {"snapkv", "rkv", "curdkv", "vase_attnv", "vase_dkv", "h2o", "keydiff"} <= set(METHODS)


def test_full_is_not_a_policy():
    assert "full" not in METHODS
    assert not EvictionConfig("full").validate().evicts
    with pytest.raises(ValueError, match="reserved"):
        vj_register = __import__("vase_jax.eviction", fromlist=["register"]).register
        vj_register("full")


def test_too_few_candidates_raises(inputs):
    """The framework checks the candidate count once, for every method, with the method's name."""
    short = inputs.replace(keys=inputs.keys[:, :, :20], values=inputs.values[:, :, :20], pos=inputs.pos[:, :, :20],
                           state={"attention_mass": inputs.state["attention_mass"][:, :, :20]})
    for method in ("snapkv", "random", "h2o"):
        with pytest.raises(ValueError, match=f"{method!r}.*24 kept slots"):
            framework.run_policy(short, make_config(method), jax.random.key(0))
