"""The mixed-precision cache in `generate` (`vase_jax.tiers`): the tiers' invariants traced tick by tick
against NumPy, the 16-bit setting as today's program, errors before compiling, and the memory it saves."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

from vase_jax.cache import cache_bytes, init_cache
from vase_jax.config import Qwen3Config
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import GenerateConfig, decode_step, generate, lower_generate, prefill
from vase_jax.kvquant import KVBits
from vase_jax.random_model import TINY
from vase_jax.tiers import init_tiered_cache, tier_layout

B = 16  # the buffer (tick period) of these tests


@pytest.fixture(scope="module")
def tiny():
    return models.full_vocab()


def _prompts(seed: int = 0):
    ids = jnp.asarray(np.random.RandomState(seed).randint(0, TINY.vocab_size, (2, 64)), jnp.int32)
    mask = jnp.ones_like(ids).at[1, :21].set(0)  # row 0: 64 real tokens (64 % B = 0); row 1: 43 (43 % B = 11)
    return ids, mask


def _trace(model, eviction: EvictionConfig, kv_bits: KVBits, protected, steps: int):
    """Prefill then `steps` greedy decode steps with a tick after each; the cache after every step (NumPy)."""
    ids, mask = _prompts()
    layout = tier_layout(kv_bits, protected, eviction, 64, steps + 8)
    logits, cache = prefill(model, ids, mask, layout, 16 if eviction.evicts else 0, "xla",
                            eviction.policy.state if eviction.evicts else ())
    step = jax.jit(functools.partial(decode_step, attention_impl="xla"))
    tick = jax.jit(lambda c: framework.evict(c, eviction, jax.random.key(1), jnp.arange(2), "xla"))
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    snapshots = [jax.tree.map(np.asarray, cache)]
    for _ in range(steps):
        logits, cache = step(model, cache, token)
        cache = tick(cache)
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        snapshots.append(jax.tree.map(np.asarray, cache))
    return layout, snapshots


def _positions(c, layer, row, head):
    """(positions in the 16-bit tier, in the quantized tier, {position: its codes and scales})."""
    p16 = c.pos[layer, row, head]
    pq = c.qpos[layer, row, head]
    codes = {}
    for i in np.flatnonzero(pq >= 0):  # codes [.., slots, bytes]; scale and low group-major [.., groups, slots]
        codes[int(pq[i])] = tuple(np.asarray(x[layer, row, head, i]).tobytes() for x in (c.kq.codes, c.vq.codes)) + \
            tuple(np.asarray(x[layer, row, head, :, i]).tobytes() for x in (c.kq.scale, c.kq.low, c.vq.scale, c.vq.low))
    return set(p16[p16 >= 0].tolist()), set(pq[pq >= 0].tolist()), codes


def _check_history(snaps, layout, expect_all: bool):
    """Across the trace: a token once quantized is never in 16 bits again and keeps its codes (quantized once);
    both tiers never hold the same token; without eviction they hold every token so far."""
    for layer in range(TINY.num_layers):
        for row in range(2):
            for head in range(TINY.num_kv_heads):
                codes_seen: dict = {}
                for c in snaps:
                    s16, sq, codes = _positions(c, layer, row, head)
                    assert not s16 & sq
                    assert not s16 & set(codes_seen), "a quantized token came back to 16 bits"
                    for p, cd in codes.items():
                        assert codes_seen.setdefault(p, cd) == cd, "a token was quantized twice"
                    if expect_all:
                        assert s16 | sq == set(range(int(c.row_pos[row])))


def _top_range(c, layer, row, head, layout, sinks: bool) -> set:
    """NumPy reference of the 16-bit part after a tick: the P non-recent live tokens of largest Range(v) (the
    sinks first where forced), from the recorded 16-bit Range of every virtual slot."""
    f = layout.full_slots
    pos = np.concatenate([c.pos[layer, row, head], c.qpos[layer, row, head]])
    rng = c.value_range[layer, row, head].astype(np.float64)
    newest = int(c.row_pos[row]) - layout.buffer
    live = (pos >= 0) & (pos < newest)
    score = np.where(sinks & (pos < layout.sink_slots), np.inf, rng)
    order = sorted(np.flatnonzero(live), key=lambda j: (-score[j], j >= f))
    return set(pos[order[:layout.protected]].tolist())


def _check_ticks(snaps, layout) -> int:
    """After every tick of a row: its newest B and its sinks in 16 bits, and the other 16-bit tokens exactly the
    NumPy top-P by recorded Range. Returns the ticks checked."""
    ticks = 0
    for c in snaps[1:]:
        for row in range(2):
            if int(c.row_pos[row]) % B:
                continue
            ticks += 1
            newest = set(range(int(c.row_pos[row]) - B, int(c.row_pos[row])))
            for layer in range(TINY.num_layers):
                for head in range(TINY.num_kv_heads):
                    s16, _, _ = _positions(c, layer, row, head)
                    assert newest <= s16  # the recent window stays in 16 bits
                    assert s16 - newest == _top_range(c, layer, row, head, layout, sinks=True)
                    assert {0, 1, 2, 3} <= s16  # the sinks
    return ticks


def test_flush_keeps_the_top_range_tokens_in_16_bits_and_quantizes_each_token_once(tiny):
    layout, snaps = _trace(tiny, EvictionConfig("full", buffer=B), KVBits(8, 4, 32, 16), 24, 3 * B)
    assert layout.protected == 24 and layout.force_sinks
    _check_history(snaps, layout, expect_all=True)
    assert _check_ticks(snaps, layout) >= 4


def test_eviction_keeps_vase_protected_slots_in_16_bits(tiny):
    eviction = EvictionConfig("vase_attnv", budget=48, buffer=B)  # K = 32, Nv = 12
    layout, snaps = _trace(tiny, eviction, KVBits(8, 8, 32, 32), None, 5 * B)
    assert layout.protected == eviction.num_value_slots == 12
    _check_history(snaps, layout, expect_all=False)
    assert _check_ticks(snaps, layout) >= 8
    last = snaps[-1]
    assert (last.evictions >= 2).all()
    for row in range(2):
        for layer in range(TINY.num_layers):
            for head in range(TINY.num_kv_heads):
                s16, sq, _ = _positions(last, layer, row, head)
                assert len(s16) + len(sq) <= eviction.budget + B
                assert {0, 1, 2, 3} <= s16  # VaSE's sinks stay, in 16 bits


def test_16_bit_setting_is_the_existing_program(tiny):
    ids, mask = _prompts()
    base = GenerateConfig(max_new_tokens=8, temperature=0.0)
    explicit = GenerateConfig(max_new_tokens=8, temperature=0.0, key_bits=16, value_bits=16, kv_protected=5)
    eviction = EvictionConfig("vase_attnv", budget=32, buffer=B)
    key = jax.random.key(0)
    a = lower_generate(tiny, ids, mask, key=key, config=base, eviction=eviction).as_text()
    b = lower_generate(tiny, ids, mask, key=key, config=explicit, eviction=eviction).as_text()
    assert a == b


def test_generate_with_a_quantized_cache_is_deterministic_and_compiles_once(tiny):
    from vase_jax.generate import generate_program

    ids, mask = _prompts()
    config = GenerateConfig(max_new_tokens=40, temperature=0.6, key_bits=8, value_bits=4, kv_group=16,
                            return_cache=True)
    eviction = EvictionConfig("vase_attnv", budget=48, buffer=B)
    before = generate_program.traces
    a = generate(tiny, ids, mask, key=jax.random.key(3), config=config, eviction=eviction)
    b = generate(tiny, ids, mask, key=jax.random.key(3), config=config, eviction=eviction)
    assert generate_program.traces - before == 1
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert int(a.evictions) >= 1
    assert int(a.cache.qlength.max()) > 0


def test_ticks_and_steps_copy_no_stack_of_the_cache(tiny):
    """No copy of a whole stacked cache array ([layers, batch, kv_heads, slots, ...]) anywhere in the decode loop:
    neither per step nor in a tick's loops over layers, which rewrite one layer in place (a copy there costs
    the whole cache per layer, O(layers^2) per tick). Batch 3 keeps the leading dims apart."""
    from flax import nnx
    from hlo_utils import per_step_copies

    from vase_jax.generate import generate_program, generate_tiers
    from vase_jax.target import Target

    graphdef, state = nnx.split(tiny)
    ids = jnp.ones((3, 64), jnp.int32)
    lead = (TINY.num_layers, 3, TINY.num_kv_heads)
    for eviction in (EvictionConfig("full", buffer=B), EvictionConfig("vase_attnv", budget=48, buffer=B)):
        config = GenerateConfig(max_new_tokens=64, temperature=0.6, key_bits=8, value_bits=4, kv_group=16)
        layout = generate_tiers(TINY, config, eviction, 64)
        hlo = generate_program.lower(graphdef, state, ids, ids, jax.random.key(0), jnp.arange(3),
                              jnp.full((3,), 64, jnp.int32), config, eviction, layout,
                              Target.make("cpu", config.layer_loop)).compile().as_text()
        copies = per_step_copies(hlo, lambda dims: len(dims) >= 4 and dims[:3] == lead, follow_branches=True)
        assert copies == [], f"{eviction.method}: stack copies in the decode loop:\n" + "\n".join(copies)


@pytest.mark.parametrize("kwargs, match", [
    (dict(key_bits=4, value_bits=8), "key_bits=4 < value_bits=8"),
    (dict(key_bits=3, value_bits=3), "key_bits=3"),
    (dict(key_bits=8, value_bits=8, kv_group=48), "must divide head_dim=32"),
    (dict(key_bits=8, value_bits=8, kv_protected=4, method="snapkv"), "only methods that keep"),
    (dict(key_bits=8, value_bits=8, kv_protected=40, method="vase_attnv"), "value_slots Nv = 12"),
])
def test_bad_settings_raise_before_compiling(tiny, kwargs, match):
    method = kwargs.pop("method", "full")
    ids, mask = _prompts()
    eviction = EvictionConfig(method, budget=48, buffer=B)
    with pytest.raises(ValueError, match=match):
        generate(tiny, ids, mask, key=jax.random.key(0), config=GenerateConfig(max_new_tokens=4, **kwargs),
                 eviction=eviction)


def _bytes(layout=None, n=4096, b=64) -> int:
    cfg = Qwen3Config(vocab_size=16, hidden_size=4096, intermediate_size=16, num_layers=1, num_heads=32,
                      num_kv_heads=8, head_dim=128)
    if layout is None:
        return cache_bytes(jax.eval_shape(lambda: init_cache(cfg, 1, n + b, 0, jnp.bfloat16)))
    return cache_bytes(jax.eval_shape(lambda: init_tiered_cache(cfg, 1, layout, 0, jnp.bfloat16)))


def test_a_quarter_protected_k4v4_cache_is_half_the_16_bit_cache():
    """N = 4096, B = 64, P = N / 4 (VaSE-AttnV's Nv), K4V4: the whole cache (tiers, positions, recorded Range)
    against the 16-bit cache of the same budget."""
    eviction = EvictionConfig("vase_attnv", budget=4096, buffer=64)
    layout = tier_layout(KVBits(4, 4), None, eviction, 256, 32768)
    assert (layout.protected, layout.full_slots, layout.quant_slots) == (1024, 1152, 3072)
    # without eviction the default P is a quarter of the cache: prompt bucket + new tokens (bench.py --kv-bits)
    assert tier_layout(KVBits(8, 8), None, EvictionConfig("full", buffer=8), 64, 24).protected == (64 + 24) // 4
    assert _bytes(layout) / _bytes() <= 0.5, _bytes(layout) / _bytes()
    k8v8 = tier_layout(KVBits(8, 8), 0, EvictionConfig("vase_dkv", budget=4096, buffer=64), 256, 32768)
    assert _bytes(k8v8) / _bytes() <= 0.6


@pytest.mark.parametrize("method", ["vase_attnv", "full"])
def test_continuous_engine_gives_generates_tokens(tiny, method):
    """A quantized cache in the continuous engine: every sample's tokens equal its row of a static `generate`."""
    from vase_jax import batching

    rng = np.random.default_rng(0)
    lengths, caps = (20, 37, 50, 9, 61), (70, 40, 90, 25, 60)
    prompts = [tuple(int(x) for x in rng.integers(1, 500, n)) for n in lengths]
    keys = [jax.random.fold_in(jax.random.key(0), i) for i in range(len(prompts))]
    config = GenerateConfig(max_new_tokens=90, temperature=0.8, eos_token_ids=(), key_bits=8, value_bits=4,
                            kv_group=16)
    eviction = EvictionConfig(method, budget=48, buffer=B)
    ids = np.stack([np.pad(np.array(p, np.int32), (64 - len(p), 0)) for p in prompts])
    mask = (ids != 0).astype(np.int32)
    static = generate(tiny, ids, mask, key=jnp.stack(keys), config=config, eviction=eviction,
                      max_new_tokens=np.array(caps))
    reqs = [batching.Request(p, k, i, c, tag=i) for i, (p, k, c) in enumerate(zip(prompts, keys, caps, strict=True))]
    results = batching.run(tiny, reqs, rows=2, config=config, eviction=eviction)
    assert sorted(r.tag for r in results) == list(range(len(prompts)))
    for r in results:
        np.testing.assert_array_equal(r.tokens, np.asarray(static.tokens)[r.tag, : int(static.num_tokens[r.tag])])
        assert r.evictions == int(static.row_evictions[r.tag])


def test_a_rows_token_does_not_depend_on_the_batch_size():
    """XLA:CPU sums a [rows, vocab] array's rows in an order that depends on the number of rows; sampling one
    row at a time (`Target.rowwise_sampling`) gives a row the same token in batches of 1, 2, 4 and 8 rows."""
    from vase_jax.sampling import SamplingConfig, sample

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(8, 151936)) * 3, jnp.float32)
    cfg = SamplingConfig(temperature=0.8, top_p=0.95)
    draw = jax.jit(lambda lg, key, rows: sample(lg, key, cfg, rows, rowwise=True))
    for seed in range(16):
        key = jax.random.key(seed)
        tokens = [np.asarray(draw(logits[:n], key, jnp.arange(n)))[0] for n in (1, 2, 4, 8)]
        assert len(set(tokens)) == 1, tokens


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
def test_kernels_read_both_tiers_as_the_xla_path(tiny, impl):
    """Decode attention over a traced mixed-precision cache (both tiers in use): the Pallas kernels (interpret
    mode: the codes unpacked in the kernel, tiers merged by log-sum-exp) against the XLA path."""
    from vase_jax.tiers import decode_attention

    layout, snaps = _trace(tiny, EvictionConfig("full", buffer=B), KVBits(8, 4, 32, 32), 24, B)
    cache = jax.tree.map(jnp.asarray, snaps[-1]).replace(active=jnp.ones((2,), bool))
    assert int(cache.qlength.min()) > 0
    q = jnp.asarray(np.random.default_rng(0).normal(size=(2, TINY.num_kv_heads, TINY.group, TINY.head_dim)),
                    jnp.float32)
    for layer in range(TINY.num_layers):
        want = decode_attention(q, cache, layer, "xla")
        got = decode_attention(q, cache, layer, impl)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ticks_pinned_for_a_tpu_rewrite_the_tiers_as_without_pins(tiny):
    """A tick lowered for the TPU kernels ("pallas_tpu": the layout pins of `tiers.pinned` run, as the no-op Mosaic
    call in interpret mode, at the start and end of each loop body over layers) leaves the cache exactly as the XLA
    path's tick: the pins move nothing. One trace of vase_attnv (N = 48, B = 16): after 5 steps row 1 (43 prompt
    tokens) is due at its 48th token and flushes (48 is not past N); after 16 steps row 0 (64) is due at its 80th
    and evicts."""
    kv_bits = KVBits(4, 4, 16, 16)  # two groups of scales per token: the layout XLA:TPU copied
    eviction = EvictionConfig("vase_attnv", budget=48, buffer=B)
    _, snaps = _trace(tiny, eviction, kv_bits, None, B)
    tick = jax.jit(framework.evict, static_argnums=(1, 4))
    for steps, due, evicting in ((5, [False, True], False), (B, [True, False], True)):
        _, cache = decode_step(tiny, jax.tree.map(jnp.asarray, snaps[steps - 1]), jnp.zeros((2,), jnp.int32), "xla")
        row = due.index(True)
        assert np.asarray(cache.rows_due(eviction)).tolist() == due
        ticks = {impl: tick(cache, eviction, jax.random.key(1), jnp.arange(2), impl) for impl in ("xla", "pallas_tpu")}
        for want, got in zip(jax.tree.leaves(ticks["xla"]), jax.tree.leaves(ticks["pallas_tpu"]), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert int(ticks["xla"].evictions[row]) == int(cache.evictions[row]) + int(evicting)
