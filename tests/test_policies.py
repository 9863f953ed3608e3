"""Policies own their options and state: option handling, rkv_official vs the R-KV authors' algorithm, KeyDiff and
H2O against float64 NumPy references, and the cost of per-slot state (none for stateless policies)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

import vase_jax as vj
from vase_jax.eviction import METHODS, EvictionConfig, EvictionInputs, framework, register
from vase_jax.eviction.h2o import ATTENTION_MASS
from vase_jax.eviction.keydiff import keydiff_score
from vase_jax.eviction.rkv import RKVOfficialOptions
from vase_jax.generate import decode_step, generate_program, prefill, query_window


# ---- options ---------------------------------------------------------------------------------------------------
def test_options_are_the_policys_own():
    ev = EvictionConfig("rkv_official", budget=64, buffer=16, rkv_lambda=0.1, rkv_window=4).validate()
    assert ev.options == RKVOfficialOptions(rkv_lambda=0.1, rkv_window=4)
    assert ev.rkv_lambda == 0.1 and ev.options.rkv_pool == 7  # attribute shortcut and defaults
    opts = RKVOfficialOptions(rkv_lambda=0.1, rkv_window=4)
    same = EvictionConfig("rkv_official", budget=64, buffer=16, options=opts)
    assert same == ev and hash(same) == hash(ev)
    assert EvictionConfig("snapkv") == EvictionConfig("snapkv", smooth=True)  # defaults resolve: one compile
    assert dataclasses.replace(ev, budget=128).options == ev.options
    assert EvictionConfig("h2o").options == METHODS["h2o"].options()  # no options: an empty dataclass
    with pytest.raises(AttributeError, match="projection_rank"):
        _ = EvictionConfig("snapkv").projection_rank
    assert (ev.label, EvictionConfig("full").label) == ("rkv_official@64", "full")  # as tables and logs name them


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(method="snapkv", rkv_lambda=0.1), ["'snapkv'", "rkv_lambda", "rkv, rkv_official", "smooth"]),
        (dict(method="h2o", magnitude="l2"), ["'h2o'", "magnitude", "vase_attnv", "none"]),
        (dict(method="keydiff", bogus=1), ["'keydiff'", "bogus"]),
        (dict(method="full", smooth=False), ["full", "smooth"]),
        (dict(method="snapkv", attention_impl="xla"), ["GenerateConfig.attention_impl"]),
        (dict(method="nope", smooth=False), ["nope", "known"]),
        (dict(method="rkv", options=RKVOfficialOptions()), ["RKVOptions", "RKVOfficialOptions"]),
    ],
)
def test_bad_option_names_raise_at_construction(kwargs, names):
    with pytest.raises(ValueError) as err:
        EvictionConfig(**kwargs)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(method="rkv", rkv_lambda=1.5), "rkv_lambda=1.5"),
        (dict(method="rkv_official", rkv_lambda=-0.1), "rkv_lambda=-0.1"),
        (dict(method="rkv_official", rkv_window=17), "rkv_window=17"),
        (dict(method="rkv_official", rkv_pool=4), "rkv_pool=4"),
        (dict(method="rkv_official", rkv_threshold=2.0), "rkv_threshold=2.0"),
        (dict(method="snapkv", score_temperature=0.0), "score_temperature=0.0"),
        (dict(method="vase_attnv", magnitude="max"), "magnitude='max'"),
        (dict(method="curdkv", projection_rank=0), "projection_rank=0"),
        (dict(method="nope"), "method='nope'"),
    ],
)
def test_bad_option_values_raise_before_compiling(kwargs, name):

    ev = EvictionConfig(budget=64, buffer=16, **kwargs)
    with pytest.raises(ValueError, match=re.escape(name)):
        ev.validate()
    before = generate_program.traces
    with pytest.raises(ValueError, match=re.escape(name)):
        vj.generate(models.full_vocab(), np.ones((1, 3), np.int32), np.ones((1, 3), np.int32), key=jax.random.key(0),
                    eviction=ev, config=vj.GenerateConfig(max_new_tokens=4))
    assert generate_program.traces == before


def test_register_rejects_bad_declarations():
    with pytest.raises(ValueError, match="reserved"):
        register("full")
    with pytest.raises(ValueError, match="frozen"):
        register("x", options=dataclasses.make_dataclass("Opts", [("a", int, 1)]))
    with pytest.raises(ValueError, match="budget"):
        register("x", options=dataclasses.make_dataclass("Opts", [("budget", int, 1)], frozen=True))
    assert "x" not in METHODS


# ---- rkv_official vs a NumPy transcription of R-KV's R1KV.update_kv (spec 3.2b) ---------------------------------
def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_r1kv_keep(keys, queries, alpha, lam, kept, kernel=7, threshold=0.5):
    """R-KV's R1KV.update_kv on one (row, kv head) cache `keys` [n, D] whose last `alpha` keys are the window,
    `queries` [group, alpha, D] the window's queries (float64). Returns the indices (into keys[:-alpha]) of the
    `kept` candidates, best first, and their scores. Transcribed from spec 3.2b:

        logits = max_g q k^T / sqrt(D) over keys[:-alpha];  I = MaxPool7(mean_t softmax(logits))
        C = kn kn^T, diag 0;  last(i) = max_j (j if C_ij > 0.5 else 0);  C[i, last(i)] = 0   (over ALL keys)
        R = softmax_j(mean_i C_ij)[:-alpha];  Z = lam I - (1 - lam) R;  topk(Z, kept)
    """
    n, d = keys.shape
    cand = keys[:-alpha]
    logits = np.einsum("gtd,nd->gtn", queries, cand).max(axis=0) / math.sqrt(d)  # [alpha, n - alpha]
    p = np_softmax(logits).mean(axis=0)
    r = kernel // 2
    imp = np.array([p[max(0, j - r): j + r + 1].max() for j in range(len(p))])
    kn = keys / (np.linalg.norm(keys, axis=-1, keepdims=True) + 1e-8)
    c = kn @ kn.T
    np.fill_diagonal(c, 0.0)
    last = np.where(c > threshold, np.arange(n)[None, :], 0).max(axis=-1)
    c[np.arange(n), last] = 0.0
    red = np_softmax(c.mean(axis=0))[:-alpha]
    z = lam * imp - (1 - lam) * red
    order = np.argsort(-z, kind="stable")[:kept]
    return order, z


RKV_CASES = [  # (budget N, buffer B, alpha, lambda); 3 rows (row 1 padded) x 2 kv heads each: 24 kept sets
    (32, 8, 8, 0.1),
    (48, 16, 16, 0.5),
    (64, 16, 8, 0.3),
    (40, 8, 4, 0.9),
]


def rkv_case(seed, budget, buffer, group=2, heads=2, d=16, pads=(0, 5, 0)):
    """Candidates [rows, heads, N, D] (row r with pads[r] padding slots first), B buffer keys, B window queries."""
    rng = np.random.default_rng(seed)
    rows = len(pads)
    keys = rng.normal(size=(rows, heads, budget + buffer, d))
    base = rng.normal(size=d) * 1.5
    keys[:, :, ::3] += base  # a third of the keys share a direction: many pairs above the 0.5 threshold
    keys[:, :, -2:] += base
    queries = rng.normal(size=(rows, heads, group, buffer, d)) * 1.5
    pos = np.tile(np.arange(budget + buffer), (rows, heads, 1)).astype(np.int32)
    for r, p in enumerate(pads):
        pos[r, :, :p] = -1
        pos[r, :, p:] -= p
        keys[r, :, :p] = 1e3
    return keys, queries, pos


@functools.partial(jax.jit, static_argnums=(1,))
def _run_policy(inputs, ev):
    return framework.run_policy(inputs, ev, jax.random.key(0))


def rkv_inputs(keys, queries, pos, buffer):
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    rows = keys.shape[0]
    return EvictionInputs(
        keys=f32(keys[:, :, :-buffer]), values=f32(np.zeros_like(keys[:, :, :-buffer])), queries=f32(queries),
        query_valid=jnp.ones((rows, buffer), bool), pos=jnp.asarray(pos[:, :, :-buffer]),
        layer_key=jax.random.key(0), row_ids=jnp.arange(rows, dtype=jnp.int32),
        buffer_keys=f32(keys[:, :, -buffer:]), buffer_values=f32(np.zeros_like(keys[:, :, -buffer:])),
        buffer_pos=jnp.asarray(pos[:, :, -buffer:]))


@pytest.mark.slow
def test_rkv_official_keeps_the_authors_sets():
    """Kept sets equal R-KV's own algorithm run on the cache "valid candidates + the alpha newest keys" (with
    B == alpha that is the whole cache; with B > alpha the older B - alpha buffer keys are not candidates here,
    see the rkv module docstring), for several budgets, buffers, lambdas and a padded row: 24 of 24."""
    equal = total = 0
    for seed, (budget, buffer, alpha, lam) in enumerate(RKV_CASES):
        keys, queries, pos = rkv_case(seed, budget, buffer)
        ev = EvictionConfig("rkv_official", budget=budget, buffer=buffer, rkv_window=alpha, rkv_lambda=lam).validate()
        kept = np.asarray(_run_policy(rkv_inputs(keys, queries, pos, buffer), ev))
        for r in range(keys.shape[0]):
            for h in range(keys.shape[1]):
                valid = pos[r, h, :-buffer] >= 0
                theirs_keys = np.concatenate([keys[r, h, :-buffer][valid], keys[r, h, -alpha:]])
                order, _ = np_r1kv_keep(theirs_keys, queries[r, h, :, -alpha:], alpha, lam, ev.kept)
                want = set(pos[r, h, :-buffer][valid][order].tolist())
                got = set(pos[r, h, kept[r, h]].tolist())
                equal += got == want
                total += 1
    assert (equal, total) == (24, 24)


def test_rkv_official_scores_match_the_authors():
    from vase_jax.eviction.rkv import rkv_official_score

    budget, buffer, alpha, lam = 48, 16, 8, 0.5
    keys, queries, pos = rkv_case(11, budget, buffer)
    ev = EvictionConfig("rkv_official", budget=budget, buffer=buffer, rkv_lambda=lam).validate()
    z = np.asarray(jax.jit(rkv_official_score, static_argnums=1)(rkv_inputs(keys, queries, pos, buffer), ev))
    for r in range(keys.shape[0]):
        for h in range(keys.shape[1]):
            valid = pos[r, h, :-buffer] >= 0
            theirs_keys = np.concatenate([keys[r, h, :-buffer][valid], keys[r, h, -alpha:]])
            _, want = np_r1kv_keep(theirs_keys, queries[r, h, :, -alpha:], alpha, lam, ev.kept)
            np.testing.assert_allclose(z[r, h][valid], want, rtol=1e-5, atol=2e-6)
            assert (z[r, h][~valid] == 0).all()


# ---- KeyDiff -----------------------------------------------------------------------------------------------------
def np_keydiff(k):
    """kvpress KeyDiffPress.score: -cosine(k_j, mean_j normalize(k_j))."""
    anchor = (k / np.linalg.norm(k, axis=-1, keepdims=True)).mean(axis=0)
    return -(k @ anchor) / (np.linalg.norm(k, axis=-1) * np.linalg.norm(anchor))


def test_keydiff_score_with_masked_candidates():
    rng = np.random.default_rng(3)
    keys = rng.normal(size=(2, 3, 30, 8)) + rng.normal(size=8)
    valid = rng.uniform(size=(2, 3, 30)) < 0.7
    keys[~valid] = 1e4  # garbage that would dominate the anchor if it leaked
    got = np.asarray(keydiff_score(jnp.asarray(keys, jnp.float32), jnp.asarray(valid)))
    for r in range(2):
        for h in range(3):
            v = valid[r, h]
            np.testing.assert_allclose(got[r, h][v], np_keydiff(keys[r, h][v]), rtol=1e-5, atol=1e-6)
            assert (got[r, h][~v] == 0).all()


# ---- H2O: accumulated attention over real decode steps -----------------------------------------------------------
@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    from conftest import save_tiny_checkpoint

    folder, _ = save_tiny_checkpoint(tmp_path_factory.mktemp("peaked_policies"), seed=3, init_std=0.1)
    return vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _prefill(model, ids, mask, capacity, window, state):
    return prefill(model, ids, mask, capacity, window, "auto", state)


@jax.jit
def _step(model, cache, token):
    logits, cache = decode_step(model, cache, token)
    return jnp.argmax(logits, -1).astype(jnp.int32), cache


def run_with_full_query_ring(model, ids, mask, ev: EvictionConfig, steps: int):
    """Prefill and greedy decode steps with a query ring as long as the cache (every query of the run is kept,
    ring slot t = time t) and `ev`'s per-slot state, evicting as the framework says. Returns the cache before the
    first eviction (or at the end) and the cache right after it (or None)."""
    t = ids.shape[1]
    capacity = framework.capacity_for(ev, t, steps + 1)
    logits, cache = _prefill(model, jnp.asarray(ids), jnp.asarray(mask), capacity, capacity, framework.slot_state(ev))
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    for _ in range(steps):
        token, cache = _step(model, cache, token)
        if ev.evicts and bool(framework.should_evict(cache, ev)):
            after = framework.evict(cache, ev, jax.random.key(0), jnp.arange(ids.shape[0], dtype=jnp.int32))
            return cache, after
    return cache, None


def np_accumulated_attention(cache, layer):
    """float64 reference of H2O's state: for every real query t (prompt and decode, ring slot t; the prompt's
    padding is not stored) and every live slot j <= t, softmax_j(q_t . k_j / sqrt(D)) summed over the query group,
    accumulated per slot. [batch, kv_heads, L]"""
    q = np.asarray(cache.queries[layer], np.float64)  # [b, h, g, window, d], ring slot t = time t
    k = np.asarray(cache.k[layer], np.float64)  # [b, h, capacity, d]
    pos = np.asarray(cache.pos[layer])
    qv = np.asarray(cache.query_valid)
    b, h, g, _, d = q.shape
    mass = np.zeros(pos.shape)
    for r in range(b):
        for hh in range(h):
            for t in range(int(cache.row_pos[r])):
                if not qv[r, t]:
                    continue  # a padding token's query
                live = np.flatnonzero(pos[r, hh, : t + 1] >= 0)
                for gg in range(g):
                    mass[r, hh, live] += np_softmax(k[r, hh, live] @ q[r, hh, gg, t] / math.sqrt(d))
    return mass


@pytest.mark.slow
def test_h2o_state_is_the_accumulated_attention(peaked, prompt_batch):
    """Padded prompts of three lengths (GQA group 2), prefill plus 20 decode steps, no eviction yet."""
    ev = EvictionConfig("h2o", budget=256, buffer=16)
    ids, mask = prompt_batch.input_ids, prompt_batch.attention_mask
    assert len(set(np.asarray(mask).sum(1).tolist())) == 3 and peaked.cfg.group == 2
    cache, after = run_with_full_query_ring(peaked, ids, mask, ev, 20)
    assert after is None and set(cache.state) == {"attention_mass"}
    for layer in range(peaked.cfg.num_layers):
        want = np_accumulated_attention(cache, layer)
        got = np.asarray(cache.state["attention_mass"][layer])
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        pos = np.asarray(cache.pos[layer])
        assert (got[pos < 0] == 0).all()  # padding and empty slots never accumulate
        # every real query spreads `group` units of mass over the live slots
        real_queries = np.asarray(cache.query_valid).sum(1)
        np.testing.assert_array_equal(real_queries, np.asarray(mask).sum(1) + 20)
        np.testing.assert_allclose(got.sum(axis=(1, 2)), real_queries * peaked.cfg.num_heads, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["h2o", "keydiff"])
def test_first_eviction_keeps_the_numpy_selection(peaked, tokenizer, method):
    """The kept set of every (layer, row, kv head) at the first eviction equals top-K of the NumPy score computed
    from the full cache of the same run (its keys, and for H2O every query since the prompt)."""
    budget, buffer = 48, 16
    ev = EvictionConfig(method, budget=budget, buffer=buffer).validate()
    batch = vj.encode_prompts(tokenizer, ["Count to ten.", "Name three colors of the rainbow, please."])
    before, after = run_with_full_query_ring(peaked, batch.input_ids, batch.attention_mask, ev, 80)
    fired = np.asarray(framework.rows_to_evict(before, ev))
    assert after is not None and fired.any()
    np.testing.assert_array_equal(np.asarray(after.evictions), fired.astype(int))
    k_keep = ev.kept
    for layer in range(peaked.cfg.num_layers):
        pos_b, pos_a = np.asarray(before.pos[layer]), np.asarray(after.pos[layer])
        keys = np.asarray(before.k[layer], np.float64)
        mass = np_accumulated_attention(before, layer) if method == "h2o" else None
        for r in range(pos_b.shape[0]):
            if not fired[r]:  # a row whose trigger did not fire is untouched
                np.testing.assert_array_equal(pos_a[r], pos_b[r])
                continue
            length = int(before.length[r])
            for h in range(pos_b.shape[1]):
                cand = pos_b[r, h, : length - buffer]
                valid = np.flatnonzero(cand >= 0)
                if method == "h2o":
                    score = mass[r, h, valid]
                else:
                    score = np_keydiff(keys[r, h, valid])
                want = cand[valid[np.argsort(-score, kind="stable")[:k_keep]]]
                np.testing.assert_array_equal(np.sort(pos_a[r, h, :k_keep]), np.sort(want), err_msg=f"{layer} {r} {h}")
                np.testing.assert_array_equal(pos_a[r, h, k_keep:budget], pos_b[r, h, length - buffer: length])
        if method == "h2o":  # the state travels with the kept slots and is reset beyond N
            sb, sa = np.asarray(before.state["attention_mass"][layer]), np.asarray(after.state["attention_mass"][layer])
            for r in np.flatnonzero(fired):
                length = int(before.length[r])
                for h in range(pos_b.shape[1]):
                    by_pos = dict(zip(pos_b[r, h, :length].tolist(), sb[r, h, :length].tolist(), strict=True))
                    np.testing.assert_array_equal(sa[r, h, :budget], [by_pos[p] for p in pos_a[r, h, :budget]])
            assert (sa[fired][:, :, budget:] == 0).all()


# ---- the cost of state -------------------------------------------------------------------------------------------
def _strip_metadata(hlo: str) -> str:
    """Compiled HLO text without source locations (they name the Python lines that traced each op)."""
    lines = [ln for ln in hlo.splitlines() if not re.match(r"^\d+ (\{|\")", ln)]
    return "\n".join(re.sub(r", metadata=\{[^}]*\}|stack_frame_id=\d+", "", ln) for ln in lines)


def _decode_step_hlo(model, ev: EvictionConfig) -> str:
    ids = jnp.ones((2, 40), jnp.int32)
    _, cache = prefill(model, ids, ids, 128, query_window(ev), "auto", framework.slot_state(ev))
    step = jax.jit(lambda m, c, t: decode_step(m, c, t))
    return _strip_metadata(step.lower(model, cache, jnp.zeros((2,), jnp.int32)).compile().as_text())


@pytest.mark.slow
def test_state_costs_nothing_for_stateless_policies():
    """A policy's state declaration is the only thing that changes the decode step: snapkv's compiled step equals
    that of a stateless copy of it, while a stateful copy adds the weights' computation. (The compiled program of
    snapkv's whole `generate` was also compared, metadata stripped, with the one before per-slot state existed:
    identical.)"""
    from vase_jax.eviction.attention import WindowScoreOptions, snapkv

    model = models.full_vocab()
    for name, state in (("snapkv_copy", ()), ("snapkv_stateful", (ATTENTION_MASS,))):
        register(name, options=WindowScoreOptions, needs_queries=True, stochastic=False, state=state)(snapkv)
    try:
        base = EvictionConfig("snapkv", budget=64, buffer=16)
        ids = jnp.ones((2, 40), jnp.int32)
        _, cache = prefill(model, ids, ids, 128, query_window(base))
        assert cache.state == {} and len(jax.tree.leaves(cache)) == 11  # k v pos queries query_valid + 6 per-row
        hlo = _decode_step_hlo(model, base)
        assert hlo == _decode_step_hlo(model, EvictionConfig("snapkv_copy", budget=64, buffer=16))
        stateful = _decode_step_hlo(model, EvictionConfig("snapkv_stateful", budget=64, buffer=16))
        dots = [len(re.findall(r" dot\(", text)) for text in (hlo, stateful)]
        assert dots[1] == dots[0] + 1, dots  # the scanned layer body: one more dot (q . k over the layer's slots)
    finally:
        METHODS.pop("snapkv_copy", None)
        METHODS.pop("snapkv_stateful", None)
