"""Continuous batching (vase_jax.batching) and per-row state in generate: a sample's tokens do not depend on its
batch, its row or when it ran; each row evicts on its own reference schedule; at most one event per B steps;
no recompiles; bad input fails before compiling.

The model's head is scaled (`HEAD_SCALE`, as the eval's random models) so that its next-token distributions are
peaked like a trained model's. XLA:CPU picks its matmul kernels by size, so a row's logits can differ in the last
bit between batch sizes (found: batches of 1-3 vs 8-10 rows); with the flat distribution of an unscaled random
model, such a bit can move a sampled token across a CDF boundary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from flax import nnx
from hlo_utils import per_step_copies
from test_eviction_framework import reference_schedule  # the authors' trigger, one sequence

import vase_jax as vj
from vase_jax import batching
from vase_jax.eviction import framework
from vase_jax.generate import generate_program
from vase_jax.target import Target

N, B = 64, 16
LENGTHS = (20, 37, 50, 9, 61, 33, 44, 12, 58, 27)  # mixed prompt lengths (one bucket: 64)
CAPS = (90, 40, 130, 70, 25, 110, 60, 130, 85, 15)  # per-sample caps: rows end at different steps
MAX_NEW = 130


@pytest.fixture(scope="module")
def model():
    return models.peaked()  # the prompts' ids are below 500


@pytest.fixture(scope="module")
def samples():
    rng = np.random.default_rng(0)
    prompts = [tuple(int(x) for x in rng.integers(1, 500, n)) for n in LENGTHS]
    # samples 2i and 2i + 1 are two row streams of one "problem" key, as in the eval
    keys = [jax.random.fold_in(jax.random.key(0), i // 2) for i in range(len(prompts))]
    row_ids = [i % 2 for i in range(len(prompts))]
    return prompts, keys, row_ids


def static_batch(model, samples, config, eviction, caps=CAPS):
    """Every sample as one row of one static `generate` call (per-row keys and caps): [tokens of sample i]."""
    prompts, keys, row_ids = samples
    t = max(len(p) for p in prompts)
    ids = np.stack([np.pad(np.array(p, np.int32), (t - len(p), 0)) for p in prompts])
    mask = np.stack([np.pad(np.ones(len(p), np.int32), (t - len(p), 0)) for p in prompts])
    out = vj.generate(model, ids, mask, key=jnp.stack(keys), config=config, eviction=eviction,
                      row_ids=jnp.asarray(row_ids), max_new_tokens=np.array(caps))
    n = np.asarray(out.num_tokens)
    return [np.asarray(out.tokens)[i, : n[i]] for i in range(len(prompts))], out


def requests(samples, caps=CAPS):
    prompts, keys, row_ids = samples
    return [batching.Request(p, k, r, c, tag=i) for i, (p, k, r, c) in enumerate(zip(prompts, keys, row_ids, caps,
                                                                                        strict=True))]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["vase_attnv", "full"])
def test_tokens_identical_static_and_continuous_any_batch_size(model, samples, method):
    ev = vj.EvictionConfig(method, budget=N, buffer=B, value_slots=16)
    free_cfg = vj.GenerateConfig(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.95, eos_token_ids=())
    free, _ = static_batch(model, samples, free_cfg, ev)
    # end tokens: tokens that some samples draw mid-way, so those rows end early
    eos = (int(free[0][30]), int(free[5][12]))
    cfg = vj.GenerateConfig(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.95, eos_token_ids=eos)
    static, out = static_batch(model, samples, cfg, ev)
    assert any(np.isin(t[-1], eos) and len(t) < c for t, c in zip(static, CAPS, strict=True))  # ended by a token
    assert any(len(t) == c for t, c in zip(static, CAPS, strict=True))  # ended by its cap
    if ev.evicts:
        assert int(np.asarray(out.row_evictions).min()) == 0 and int(np.asarray(out.row_evictions).max()) >= 4
    # a lone row, and fewer rows than samples with queue != rows; without eviction (no event to place) the latter
    for rows, queue in ((1, None), (3, 4)) if ev.evicts else ((3, 4),):
        stats = batching.EngineStats()
        results = batching.run(model, requests(samples), rows=rows, config=cfg, eviction=ev, stats=stats, queue=queue)
        assert sorted(r.tag for r in results) == list(range(len(LENGTHS)))
        # one host round trip per `queue` samples staged
        assert stats.segments == -(-len(LENGTHS) // max(queue or rows, 2)), stats
        for r in results:
            np.testing.assert_array_equal(r.tokens, static[r.tag], err_msg=f"rows={rows} sample {r.tag}")
            assert r.evictions == int(out.row_evictions[r.tag])
            assert r.finished == bool(out.finished[r.tag])
        if ev.evicts:  # one eviction event per B steps at most, for the whole batch
            assert stats.events >= 1 and stats.min_event_gap >= B, stats
        else:
            assert stats.events == 0
        assert 0 < stats.utilization <= 1


@pytest.mark.slow
def test_each_row_evicts_on_its_own_reference_schedule(model, samples):
    """generate with mixed prompt lengths: every row's eviction count and final length follow the reference
    trigger for that sequence alone, and the batch's events are at least B steps apart."""
    ev = vj.EvictionConfig("snapkv", budget=N, buffer=B)
    cfg = vj.GenerateConfig(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.95, eos_token_ids=())
    caps = (MAX_NEW,) * len(LENGTHS)
    tokens, out = static_batch(model, samples, cfg, ev, caps)
    for i, p in enumerate(LENGTHS):
        schedule = reference_schedule(p, MAX_NEW - 1, N, B)
        assert int(out.row_evictions[i]) == len(schedule), i
        cur = p
        for _ in range(MAX_NEW - 1):
            cur += 1
            cur = N if cur > N and cur % B == 0 else cur
        assert int(out.cache_length[i]) == cur
    # each event evicts at least one row, and the events are ticks of period B
    assert int(out.evictions) <= sum(np.asarray(out.row_evictions).tolist())
    assert int(out.evictions) <= (MAX_NEW - 1 + B - 1) // B + 1
    # a row alone gives the same tokens (its schedule is its own, not the longest row's)
    prompts, keys, row_ids = samples
    for i in (3, 8):
        ids = np.array([prompts[i]], np.int32)
        alone = vj.generate(model, ids, np.ones_like(ids), key=keys[i], config=cfg, eviction=ev,
                            row_ids=jnp.array([row_ids[i]]))
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], tokens[i])
        assert int(alone.row_evictions[0]) == int(out.row_evictions[i])


def test_trigger_phase_wait_puts_rows_on_the_ticks():
    ev = vj.EvictionConfig("snapkv", budget=N, buffer=B)
    for seen in range(1, 100):
        for step in range(0, 40):
            wait = framework.phase_wait(seen, step, ev)
            assert 0 <= wait < B
            # after the wait, the row's counter and the batch's step agree modulo B
            assert (seen - (step + wait)) % B == 0
    assert framework.phase_wait(37, 5, vj.EvictionConfig("full")) == 0


@pytest.mark.slow
def test_no_recompiles_across_runs_and_buckets(model, samples):
    ev = vj.EvictionConfig("vase_dkv", budget=N, buffer=B)
    cfg = vj.GenerateConfig(max_new_tokens=40, temperature=0.7, eos_token_ids=())
    prompts, keys, _ = samples
    long_prompt = tuple(range(1, 100))  # bucket 128
    reqs = [batching.Request(p, keys[0], i, 10 + i, tag=i) for i, p in enumerate([*prompts[:4], long_prompt])]
    batching.run(model, reqs, rows=3, config=cfg, eviction=ev)
    before = batching.compile_counts()
    seen = []  # (tag, engine rounds dispatched when on_result saw it)
    stats = batching.EngineStats()
    results = batching.run(model, list(reversed(reqs)), rows=3, config=cfg, eviction=ev, stats=stats,
                           on_result=lambda r: seen.append((r.tag, stats.segments)))  # other order, same shapes
    assert batching.compile_counts() == before
    # results are handed out after the next round was dispatched: a round's results never wait for the host
    # (round 1 ends with at least one result: a row is free when the host has more samples)
    assert stats.segments == 2 and [t for t, _ in seen] == [r.tag for r in results] and len(seen) == 5
    assert all(n == 2 for _, n in seen), seen


def test_bad_input_raises_before_compiling(model, samples):
    cfg = vj.GenerateConfig(max_new_tokens=20)
    reqs = requests(samples, caps=(5,) * len(LENGTHS))
    before = batching.compile_counts()
    with pytest.raises(ValueError, match="rows"):
        batching.run(model, reqs, rows=0, config=cfg)
    with pytest.raises(ValueError, match="max_new_tokens"):
        batching.run(model, [batching.Request((1, 2), jax.random.key(0), 0, 0)], rows=2, config=cfg)
    with pytest.raises(ValueError, match="max_new_tokens"):
        batching.run(model, [batching.Request((1, 2), jax.random.key(0), 0, 21)], rows=2, config=cfg)
    with pytest.raises(ValueError, match="queue"):
        batching.run(model, reqs, rows=2, config=cfg, queue=0)
    assert batching.compile_counts() == before
    ids = np.ones((3, 4), np.int32)
    before = generate_program.traces
    for caps, what in [(np.array([5, 0, 5]), "caps"), (np.array([5, 5]), "shape"), (np.array([5, 5, 30]), "caps"),
                       (np.array([[5, 5, 5]]), "shape")]:
        with pytest.raises(ValueError, match=what):
            vj.generate(model, ids, ids, key=jax.random.key(0), config=cfg, max_new_tokens=caps)
    assert generate_program.traces == before


@pytest.mark.parametrize("method", ["full", "vase_attnv"])
def test_engine_rounds_copy_no_cache(model, method):
    """Neither a decode step nor an admission inside the engine's round copies a cache-sized array (the loop state
    is carried in place; admissions write one row)."""
    ev = vj.EvictionConfig(method, budget=N, buffer=B)
    cfg = vj.GenerateConfig(max_new_tokens=MAX_NEW, eos_token_ids=())
    capacity = framework.capacity_for(ev, 64, MAX_NEW)
    graphdef, params = nnx.split(model)
    target = Target.make("cpu")
    e = batching.init_state(model.cfg, model.dtype, 4, 4, 4, cfg, ev, capacity, target)
    ids = jnp.ones((4, 64), jnp.int32)
    keys = jax.vmap(jax.random.key)(jnp.arange(4))
    staged = batching.stage_prompts(graphdef, params, ids, ids, keys, jnp.zeros(4, jnp.int32),
                                    jnp.full(4, 10, jnp.int32), jnp.arange(4, dtype=jnp.int32), jnp.int32(4), cfg,
                                    ev, 64, target)
    hlo = batching.engine_program.lower(graphdef, params, e, staged, jnp.bool_(True), jnp.int32(5), cfg, ev,
                                 target).compile().as_text()
    copies = per_step_copies(hlo, lambda dims: capacity in dims, follow_branches=True)
    assert copies == [], "\n".join(copies)
