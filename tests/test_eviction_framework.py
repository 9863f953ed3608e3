"""The periodic eviction framework inside generate (spec section 2), for every registered method."""

from __future__ import annotations

import functools

import calibrations
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vase_jax as vj
from vase_jax.cache import cache_bytes
from vase_jax.eviction import METHODS, framework
from vase_jax.generate import decode_step, prefill, query_window

EVICTING = sorted(METHODS)
SINK_METHODS = ("vase_attnv", "curdkv", "vase_dkv")
GENERATE_CHECKED = ("snapkv", "h2o", "vase_dkv")  # test_framework_invariants compiles generate for these
N, B = 64, 16


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny model with peaked next-token distributions (init std 0.1), so greedy decoding has no near-ties."""
    from conftest import save_tiny_checkpoint

    folder, _ = save_tiny_checkpoint(tmp_path_factory.mktemp("peaked"), seed=7, init_std=0.1)
    return vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)


def reference_schedule(prompt_len: int, decode_steps: int, budget: int, buffer: int) -> list[int]:
    """The reference trigger (VaSE `post_attention_update`): the cur_len at each eviction."""
    cur, events = prompt_len, []
    for _ in range(decode_steps):
        cur += 1
        if cur > budget and cur % buffer == 0:
            events.append(cur)
            cur = budget
    return events


def final_cur_len(prompt_len: int, decode_steps: int, budget: int, buffer: int) -> int:
    cur = prompt_len
    for _ in range(decode_steps):
        cur += 1
        if cur > budget and cur % buffer == 0:
            cur = budget
    return cur


@functools.partial(jax.jit, static_argnums=(2,))
def _step(model, cache, impl, token):
    logits, cache = decode_step(model, cache, token, impl)
    return jnp.argmax(logits, -1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnums=(1,))
def _evict(cache, ev, key, row_ids):
    return framework.evict(cache, ev, key, row_ids)


def drive(model, ids, mask, ev, max_new, key):
    """generate's schedule as a Python loop (greedy), returning tokens and a snapshot around every eviction."""
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    t = ids.shape[1]
    cap = framework.capacity_for(ev, t, max_new)
    logits, cache = prefill(model, ids, mask, cap, query_window(ev), "auto", framework.slot_state(ev))
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    tokens, events = [token], []
    _, evict_key = jax.random.split(key)
    row_ids = jnp.arange(ids.shape[0], dtype=jnp.int32)
    for _ in range(max_new - 1):
        token, cache = _step(model, cache, "auto", token)
        if bool(framework.should_evict(cache, ev)):
            before = cache
            cache = _evict(cache, ev, evict_key, row_ids)
            events.append((before, cache))
        tokens.append(token)
    return np.stack([np.asarray(x) for x in tokens], 1), events


@pytest.mark.slow
@pytest.mark.parametrize("method", EVICTING)
def test_framework_invariants(peaked, tokenizer, method):
    ev = calibrations.eviction(method, peaked.cfg, budget=N, buffer=B, value_slots=16)
    batch = vj.encode_prompts(tokenizer, ["Count to ten.", "Name three colors of the rainbow, please."])
    ids, mask = batch.input_ids, batch.attention_mask
    max_new = 120
    tokens, events = drive(peaked, ids, mask, ev, max_new, jax.random.key(0))
    lengths = [int(x) for x in batch.lengths]
    assert len(set(lengths)) == 2  # two prompt lengths: each row runs its own schedule
    schedules = [reference_schedule(p, max_new - 1, N, B) for p in lengths]
    fired = [np.asarray(framework.rows_to_evict(before, ev)) for before, _ in events]
    for r, schedule in enumerate(schedules):
        assert [int(before.seen[r]) for (before, _), f in zip(events, fired, strict=True) if f[r]] == schedule
        assert len(schedule) >= 4
    recent = ev.recent  # the newest slots kept unscored: B, or 0 (triattention)
    k = N - recent
    for (before, after), f in zip(events, fired, strict=True):
        for r in range(len(lengths)):
            if not f[r]:  # a row whose trigger did not fire keeps its slots untouched
                assert int(after.length[r]) == int(before.length[r]) and int(after.seen[r]) == int(before.seen[r])
                np.testing.assert_array_equal(np.asarray(after.pos)[:, r], np.asarray(before.pos)[:, r])
                np.testing.assert_array_equal(np.asarray(after.k)[:, r], np.asarray(before.k)[:, r])
                continue
            length = int(before.length[r])
            assert int(after.length[r]) == N and int(after.seen[r]) == N
            for layer in range(peaked.cfg.num_layers):
                pb, pa = np.asarray(before.pos[layer])[r], np.asarray(after.pos[layer])[r]  # [kv_heads, capacity]
                # the newest R slots survive, moved behind the kept ones
                np.testing.assert_array_equal(pa[:, k:N], pb[:, length - recent:length])
                assert (pa[:, N:] == -1).all()
                np.testing.assert_array_equal(np.asarray(after.k[layer])[r, :, k:N],
                                              np.asarray(before.k[layer])[r, :, length - recent:length])
                for h in range(pb.shape[0]):
                    cand = pb[h, :length - recent]
                    valid_cand = set(cand[cand >= 0].tolist())
                    kept = pa[h, :k]
                    kept_valid = kept[kept >= 0]
                    assert len(set(kept_valid.tolist())) == len(kept_valid)  # distinct
                    assert set(kept_valid.tolist()) <= valid_cand  # only candidates
                    assert len(kept_valid) == min(k, len(valid_cand))  # no empty slot kept while a valid one is left
                    if method in SINK_METHODS:
                        assert {0, 1, 2, 3} <= set(kept_valid.tolist())
    # generate runs exactly these schedules (each row its own). Its tokens equal the driver's up to the first
    # eviction; after it they may part, since one fused program and separately jitted pieces may round differently
    # and flip near-ties. The schedule is the framework's, the same for every method: generate is compiled for one
    # method of each kind (stateless window-scored, stateful, value-scored with sinks), not all 14 (~3 s each).
    if method not in GENERATE_CHECKED:
        return
    out = vj.generate(peaked, ids, mask, key=jax.random.key(0), eviction=ev,
                      config=vj.GenerateConfig(max_new_tokens=max_new, temperature=0.0, eos_token_ids=()))
    assert np.asarray(out.row_evictions).tolist() == [len(s) for s in schedules]
    assert np.asarray(out.cache_length).tolist() == [final_cur_len(p, max_new - 1, N, B) for p in lengths]
    first = min(s[0] - p for s, p in zip(schedules, lengths, strict=True))  # decode steps before the first eviction
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, : first + 1], tokens[:, : first + 1])


@pytest.mark.slow
def test_sinks_kept_forever_over_many_evictions(peaked, tokenizer):
    ev = vj.EvictionConfig("vase_attnv", budget=N, buffer=B, value_slots=16)
    batch = vj.encode_prompts(tokenizer, ["Say something long."])
    out = vj.generate(peaked, batch.input_ids, batch.attention_mask, key=jax.random.key(3), eviction=ev,
                      config=vj.GenerateConfig(max_new_tokens=400, temperature=1.0, top_p=1.0, eos_token_ids=(),
                                               return_cache=True))
    assert int(out.evictions) >= 20
    for pos in out.cache.pos:
        pos = np.asarray(pos)[:, :, : int(out.cache.length[0])]
        for r in range(pos.shape[0]):
            for h in range(pos.shape[1]):
                assert {0, 1, 2, 3} <= set(pos[r, h].tolist())


@pytest.mark.slow
@pytest.mark.parametrize("method, temperature", [("snapkv", 0.0), ("vase_attnv", 0.8), ("vase_dkv", 0.8),
                                                 ("h2o", 0.8), ("keydiff", 0.0)])
def test_budget_above_total_length_equals_full(peaked, prompt_batch, method, temperature):
    ids, mask = prompt_batch.input_ids, prompt_batch.attention_mask
    cfg = vj.GenerateConfig(max_new_tokens=40, temperature=temperature, top_p=0.95, eos_token_ids=())
    full = vj.generate(peaked, ids, mask, key=jax.random.key(9), config=cfg)
    ev = vj.EvictionConfig(method, budget=256, buffer=16)
    evicting = vj.generate(peaked, ids, mask, key=jax.random.key(9), config=cfg, eviction=ev)
    assert int(evicting.evictions) == 0
    np.testing.assert_array_equal(np.asarray(evicting.tokens), np.asarray(full.tokens))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["snapkv", "vase_attnv", "curdkv"])
def test_padding_and_batch_invariance(peaked, tokenizer, method):
    """One prompt: alone, padded to a larger bucket, and as one row of a batch of equal-length prompts."""
    ev = vj.EvictionConfig(method, budget=N, buffer=B, value_slots=16)
    texts = ["Tell me about cats.", "Tell me about dogs.", "Tell me about fish."]  # equal token lengths
    batch = vj.encode_prompts(tokenizer, texts)
    assert len(set(batch.lengths.tolist())) == 1
    cfg = vj.GenerateConfig(max_new_tokens=100, temperature=0.0, eos_token_ids=())
    key = jax.random.key(11)
    alone = vj.generate(peaked, batch.input_ids[1:2], batch.attention_mask[1:2], key=key, config=cfg,
                        eviction=ev, row_ids=jnp.array([1]))
    padded = vj.generate(peaked, batch.input_ids[1:2], batch.attention_mask[1:2], key=key, eviction=ev,
                         config=vj.GenerateConfig(max_new_tokens=100, temperature=0.0, eos_token_ids=(),
                                                  prompt_buckets=(128,)), row_ids=jnp.array([1]))
    together = vj.generate(peaked, batch.input_ids, batch.attention_mask, key=key, config=cfg, eviction=ev)
    assert int(alone.evictions) >= 3
    np.testing.assert_array_equal(np.asarray(padded.tokens), np.asarray(alone.tokens))
    np.testing.assert_array_equal(np.asarray(together.tokens)[1], np.asarray(alone.tokens)[0])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["vase_attnv", "vase_dkv", "snapkv", "curdkv"])
def test_kept_sets_reproducible_and_key_dependent(peaked, tokenizer, method):
    ev = vj.EvictionConfig(method, budget=N, buffer=B, value_slots=16)
    batch = vj.encode_prompts(tokenizer, ["Describe the moon."])
    cfg = vj.GenerateConfig(max_new_tokens=90, temperature=0.0, eos_token_ids=(), return_cache=True)

    def kept(seed):
        out = vj.generate(peaked, batch.input_ids, batch.attention_mask, key=jax.random.key(seed), config=cfg,
                          eviction=ev)
        return np.asarray(out.tokens), [np.asarray(p) for p in out.cache.pos]

    t1, p1 = kept(0)
    t2, p2 = kept(0)
    _, p3 = kept(1)
    np.testing.assert_array_equal(t1, t2)
    assert all(np.array_equal(a, b) for a, b in zip(p1, p2, strict=True))
    same = all(np.array_equal(np.sort(a, -1), np.sort(b, -1)) for a, b in zip(p1, p3, strict=True))
    assert same == (not METHODS[method].stochastic)


@pytest.mark.slow
def test_long_generation_static_memory_and_finite(peaked, tokenizer):
    ev = vj.EvictionConfig("vase_attnv", budget=128, buffer=16)  # half the N, B and steps of 256/32/2048: as long
    batch = vj.encode_prompts(tokenizer, ["Write a very long story.", "Write a poem."])  # relative to the budget
    sizes = []
    for n in (256, 1024):  # 1024: 8x the budget, about 55 evictions per row
        out = vj.generate(peaked, batch.input_ids, batch.attention_mask, key=jax.random.key(0), eviction=ev,
                          config=vj.GenerateConfig(max_new_tokens=n, temperature=0.8, top_p=1.0, eos_token_ids=(),
                                                   return_cache=True))
        assert int(out.num_tokens.min()) == n
        assert np.asarray(out.row_evictions).tolist() == [
            len(reference_schedule(int(p), n - 1, 128, 16)) for p in batch.lengths]
        for x in (*out.cache.k, *out.cache.v, *out.cache.queries):
            assert np.isfinite(np.asarray(x)).all()
        assert out.cache.capacity == framework.capacity_for(ev, 64, n)
        assert out.cache.capacity == 192  # max(P, N) + B = 128 + 16 (prompts hold no padding), rounded up to 64
        sizes.append(cache_bytes(out.cache))
    assert sizes[0] == sizes[1]


@pytest.mark.slow
def test_long_prompt_is_kept_until_the_first_eviction(peaked, tokenizer):
    """A prompt longer than the budget: the first eviction runs over more than N candidates (as the reference)."""
    ev = vj.EvictionConfig("snapkv", budget=32, buffer=16)
    batch = vj.encode_prompts(tokenizer, ["word " * 60])
    p = int(batch.lengths.max())
    assert p > 32
    out = vj.generate(peaked, batch.input_ids, batch.attention_mask, key=jax.random.key(0), eviction=ev,
                      config=vj.GenerateConfig(max_new_tokens=80, temperature=0.0, eos_token_ids=()))
    assert int(out.evictions) == len(reference_schedule(p, 79, 32, 16))
