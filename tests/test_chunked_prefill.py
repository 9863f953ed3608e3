"""The chunked prefill (`GenerateConfig.prefill_chunk`, `vase_jax.generate.chunked_prefill`): a long prompt runs in
chunks through every layer, its attention one key block at a time, and gives what the dense prefill gives: the
logits, the cache's keys, values and positions, the query ring, the per-slot state (H2O's summed attention), the
counters; then the same greedy tokens and evictions, with every method, on left-padded batches of mixed lengths
whose width is not a multiple of the chunk."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

import vase_jax as vj
from vase_jax.eviction import METHODS, framework
from vase_jax.generate import GenerateConfig, generate, prefill, query_window
from vase_jax.kvquant import KVBits
from vase_jax.tiers import tier_layout

CHUNK = 16
WIDTH = 100  # columns of the padded prompts: 7 chunks of 16, the last one partly past the prompt
LENGTHS = (100, 37, 64)  # real tokens per row (left-padded)
CAPACITY = 140


def _eviction(method: str) -> vj.EvictionConfig:
    if method == "full":
        return vj.EvictionConfig("full")
    kw = {}
    if "calibration" in METHODS[method].option_names:  # statistics of random numbers: the code path
        import tempfile

        from vase_jax.calibration import random_statistics
        from vase_jax.eviction.triattention import save_calibration
        kw["calibration"] = save_calibration(tempfile.mkdtemp(), random_statistics(models.peaked().cfg))
    return vj.EvictionConfig(method, budget=32, buffer=8, **kw).validate()


def _prompts(lengths=LENGTHS, width=WIDTH, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros((len(lengths), width), np.int32)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = rng.integers(0, models.VOCAB, n)
        mask[row, width - n:] = 1
    return jnp.asarray(ids), jnp.asarray(mask)


@functools.cache
def _prefill(window: int, state: tuple, chunk: int | None, capacity=CAPACITY):
    model = models.peaked()
    return jax.jit(lambda ids, mask: prefill(model, ids, mask, capacity, window, "auto", state, chunk=chunk))


def _live(cache, row: int, length: int):
    """Row `row`'s keys, values, positions and state over its live slots, in float32 NumPy."""
    c = cache.as_floats()
    return dict(k=np.asarray(c.k[:, row, :, :length], np.float32), v=np.asarray(c.v[:, row, :, :length], np.float32),
                pos=np.asarray(c.pos[:, row]), **{n: np.asarray(x[:, row, :, :length]) for n, x in c.state.items()})


@pytest.mark.parametrize("method", ["full", *sorted(METHODS)])
def test_chunked_prefill_equals_the_dense_one(method):
    ev = _eviction(method)
    window, state = query_window(ev), framework.slot_state(ev)
    ids, mask = _prompts()
    dense_logits, dense = _prefill(window, state, None)(ids, mask)
    logits, cache = _prefill(window, state, CHUNK)(ids, mask)
    scale = float(np.abs(np.asarray(dense_logits)).max())
    np.testing.assert_allclose(np.asarray(logits), np.asarray(dense_logits), rtol=0, atol=1e-5 * scale)
    for name in ("length", "seen", "row_pos", "prompt_length", "evictions", "active", "query_valid"):
        np.testing.assert_array_equal(np.asarray(getattr(cache, name)), np.asarray(getattr(dense, name)), name)
    for row, n in enumerate(LENGTHS):
        got, want = _live(cache, row, n), _live(dense, row, n)
        np.testing.assert_array_equal(got.pop("pos"), want.pop("pos"))
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
    assert set(cache.state) == {s.name for s in state}
    np.testing.assert_allclose(np.asarray(cache.as_floats().queries), np.asarray(dense.as_floats().queries),
                               rtol=1e-5, atol=1e-5)
    if window:  # the ring holds each row's newest real queries: a row shorter than the window keeps zeros
        assert np.abs(np.asarray(cache.as_floats().queries)).sum() > 0


@pytest.mark.parametrize("method", ["full", "snapkv", "h2o", "vase_dkv"])
def test_generate_gives_the_same_tokens_with_a_chunked_prefill(method):
    """Greedy tokens and per-row evictions equal with and without chunks; the prompts longer than N evict at
    their first trigger, over the prompt (the methods' scores of the chunked prompt agree). One method per kind of
    prompt input: none, the query ring (the attention-scored methods), per-slot state, values and keys only (every
    method's prefill is compared above)."""
    ids, mask = _prompts()
    ev = _eviction(method)
    outs = [generate(models.peaked(), ids, mask, key=jax.random.key(1), eviction=ev,
                     config=GenerateConfig(max_new_tokens=40, temperature=0.0, eos_token_ids=(), prompt_buckets=(128,),
                                           prefill_chunk=chunk)) for chunk in (None, CHUNK)]
    np.testing.assert_array_equal(np.asarray(outs[1].tokens), np.asarray(outs[0].tokens))
    np.testing.assert_array_equal(np.asarray(outs[1].row_evictions), np.asarray(outs[0].row_evictions))
    if ev.evicts:
        assert int(outs[0].evictions) >= 3


def test_a_mixed_precision_cache_is_prefilled_in_chunks_through_16_bits():
    """K4V4 with vase_dkv: the chunks run on a 16-bit cache of the prompt, then each layer is tiered as the dense
    prefill tiers it: the same positions in each tier, the same tokens."""
    ev = _eviction("vase_dkv")
    kv = KVBits(4, 4, 32, 32)
    ids, mask = _prompts()
    layout = tier_layout(kv, None, ev, 128, 40)
    caches = [jax.jit(lambda i, m, chunk=chunk: prefill(models.peaked(), i, m, layout, query_window(ev), "auto",
                                                         (), chunk=chunk))(ids, mask) for chunk in (None, CHUNK)]
    (_, dense), (_, chunked) = caches
    np.testing.assert_array_equal(np.asarray(chunked.pos), np.asarray(dense.pos))
    np.testing.assert_array_equal(np.asarray(chunked.qpos), np.asarray(dense.qpos))
    np.testing.assert_array_equal(np.asarray(chunked.qlength), np.asarray(dense.qlength))
    np.testing.assert_allclose(np.asarray(chunked.value_range), np.asarray(dense.value_range), rtol=1e-5, atol=1e-5)
    config = GenerateConfig(max_new_tokens=40, temperature=0.0, eos_token_ids=(), prompt_buckets=(128,),
                            key_bits=4, value_bits=4, kv_group=32)
    outs = [generate(models.peaked(), ids, mask, key=jax.random.key(1), eviction=ev,
                     config=dataclasses.replace(config, prefill_chunk=chunk)) for chunk in (None, CHUNK)]
    np.testing.assert_array_equal(np.asarray(outs[1].tokens), np.asarray(outs[0].tokens))


def test_a_prompt_within_one_chunk_runs_the_dense_prefill():
    """A bucket of at most `prefill_chunk` columns takes today's dense program: no loop over chunks in it."""
    ids, mask = _prompts(width=CHUNK, lengths=(CHUNK, 5))
    model = models.peaked()
    text = jax.jit(lambda i, m: prefill(model, i, m, 64, 8, "auto", (), chunk=CHUNK)).lower(ids, mask).as_text()
    dense = jax.jit(lambda i, m: prefill(model, i, m, 64, 8, "auto", ())).lower(ids, mask).as_text()
    assert text == dense
    longer = jax.jit(lambda i, m: prefill(model, i, m, 64, 8, "auto", (), chunk=CHUNK // 2)).lower(ids, mask)
    assert "while" in longer.as_text()


@pytest.mark.parametrize("chunk", [0, 8, 15, True, 16.0])
def test_bad_prefill_chunk_is_refused_before_compiling(chunk):
    with pytest.raises(ValueError, match=r"GenerateConfig.prefill_chunk=.*allowed: None \(dense prefill\) or an int"):
        GenerateConfig(prefill_chunk=chunk).validate()


# ---- prompt compression ----------------------------------------------------------------------------------------
def _np_snapkv_kept(keys, queries, kept):
    """VaSE's SnapKV on one (row, kv head), in float64: every window query's softmax over the candidates' keys
    (q.k / sqrt(D)), the mean over the window, an average pool of width 5 (zeros past the ends), the mean over the
    query group, then the top `kept` candidates (ties: the lower slot). keys [L, D], queries [group, W, D]."""
    d = keys.shape[-1]
    logits = queries @ keys.T / np.sqrt(d)  # [group, W, L]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    mean = probs.mean(axis=1)  # [group, L]
    padded = np.pad(mean, ((0, 0), (2, 2)))
    pooled = sum(padded[:, i:i + keys.shape[0]] for i in range(5)) / 5
    score = pooled.mean(axis=0)
    return set(np.lexsort((np.arange(len(score)), -score))[:kept].tolist())


@pytest.mark.parametrize("chunk", [None, CHUNK])
def test_prompt_compression_keeps_snapkvs_selection_and_n_plus_b_slots(chunk):
    """`compress_prompt`: each row longer than N keeps SnapKV's N - B prompt tokens (the last B prompt queries
    scoring the other prompt keys) and its newest B, in a cache of N + B slots; the reference runs on the dense
    prefill's keys and query ring."""
    from vase_jax.cache import ordered_queries
    from vase_jax.generate import cache_layout, prefill_prompts, split_keys
    from vase_jax.target import Target

    ev = vj.EvictionConfig("snapkv", budget=32, buffer=8, compress_prompt=True).validate()
    plain = dataclasses.replace(ev, compress_prompt=False)
    model = models.peaked()
    config = GenerateConfig(max_new_tokens=40, prefill_chunk=chunk)
    ids, mask = _prompts()
    layout = cache_layout(model.cfg, config, ev, WIDTH)
    assert layout.slots == framework.capacity_for(ev, 8192, 40) < WIDTH  # N + B (aligned), whatever the prompt
    paper = vj.EvictionConfig("vase_attnv", budget=2048, buffer=64, compress_prompt=True)
    assert framework.capacity_for(paper, 8192, 256) == 2112  # P = 8192, N = 2048, B = 64
    target = Target.of(model.embedding[...])
    _, evict_key = split_keys(jax.random.key(0), 3)
    _, cache = jax.jit(lambda i, m: prefill_prompts(model, i, m, layout, config, ev, evict_key, jnp.arange(3),
                                                    target))(ids, mask)
    _, dense = _prefill(query_window(plain), (), None)(ids, mask)
    assert cache.capacity == layout.slots
    np.testing.assert_array_equal(np.asarray(cache.length), [32, 32, 32])
    np.testing.assert_array_equal(np.asarray(cache.seen), [32, 32, 32])
    np.testing.assert_array_equal(np.asarray(cache.row_pos), LENGTHS)
    np.testing.assert_array_equal(np.asarray(cache.evictions), [1, 1, 1])
    pos = np.asarray(cache.pos)
    for layer in range(model.cfg.num_layers):
        queries = np.asarray(ordered_queries(dense, layer)[0], np.float64)  # [b, h, g, W, d]
        keys = np.asarray(dense.layer_keys(layer), np.float64)
        for row, n in enumerate(LENGTHS):
            for head in range(model.cfg.num_kv_heads):
                want = _np_snapkv_kept(keys[row, head, :n - 8], queries[row, head], 32 - 8) | set(range(n - 8, n))
                assert set(pos[layer, row, head, :32].tolist()) == want, (layer, row, head)
                assert (pos[layer, row, head, 32:] == -1).all()


def test_generate_with_prompt_compression_and_its_errors():
    """Through `generate` and the continuous engine: the same tokens (both compress the prompt with the row's own
    key), every row evicting at its first tick after the compression; `full` and the mixed-precision cache
    refuse it before compiling."""
    from vase_jax import batching

    ids, mask = _prompts()
    ev = vj.EvictionConfig("vase_attnv", budget=32, buffer=8, compress_prompt=True)
    config = GenerateConfig(max_new_tokens=24, temperature=0.0, eos_token_ids=(), prompt_buckets=(128,))
    keys = [jax.random.key(i) for i in range(3)]
    out = generate(models.peaked(), ids, mask, key=jnp.stack(keys), eviction=ev, config=config)
    assert int(out.evictions) >= 2
    # the compression, then ticks at 40 and 48 real tokens (32 after it, 23 decode steps)
    np.testing.assert_array_equal(np.asarray(out.row_evictions), [3, 3, 3])
    requests = [batching.Request(tuple(np.asarray(ids[r])[np.asarray(mask[r]) == 1].tolist()), keys[r], r, 24, r)
                for r in range(3)]
    results = sorted(batching.run(models.peaked(), requests, rows=2, config=config, eviction=ev),
                     key=lambda r: r.tag)
    for r in results:
        np.testing.assert_array_equal(r.tokens, np.asarray(out.tokens[r.tag]))
    with pytest.raises(ValueError, match="compress_prompt=True needs an evicting method"):
        generate(models.peaked(), ids, mask, key=jax.random.key(0), config=config,
                 eviction=vj.EvictionConfig("full", compress_prompt=True))
    with pytest.raises(ValueError, match="compress_prompt=True runs on the 16-bit cache"):
        generate(models.peaked(), ids, mask, key=jax.random.key(0), eviction=ev,
                 config=dataclasses.replace(config, key_bits=8, value_bits=8))


def test_a_prompt_that_cannot_fit_is_refused_before_compiling():
    """A dense prefill of a 65536-token bucket at batch 16 needs 1 TiB of float32 scores: refused, naming the
    prompt, the cache's slots and the settings that need less, before any program is traced (`generate_program`'s
    trace count stays the same); the chunked prefill of the same prompt passes the check."""
    from vase_jax import limits
    from vase_jax.generate import cache_layout, generate_program

    model = models.peaked()
    ids = jnp.zeros((16, 65536), jnp.int32)
    mask = jnp.ones_like(ids)
    traces = generate_program.traces
    config = GenerateConfig(max_new_tokens=4, prefill_chunk=None)
    with pytest.raises(ValueError, match=r"a prompt of 65536 tokens \(bucket 65536\) at batch 16 needs at least "
                                         r".* a cache of 65600 slots per row, layer and kv head .*prefill_chunk=None.*"
                                         r"Needs less: GenerateConfig\(prefill_chunk=256\).*; fewer rows than 16"):
        generate(model, ids, mask, key=jax.random.key(0), config=config)
    assert generate_program.traces == traces
    cache = jax.eval_shape(lambda: cache_layout(model.cfg, config, vj.EvictionConfig(), 65536).init(
        model.cfg, 16, 0, jnp.float32))
    limits.check_fits(model.cfg, jnp.float32, 16, 65536, 65536, cache, 256)  # chunks: about 1.1 GiB in all
