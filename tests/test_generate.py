"""generate: greedy parity with HF, compiled-loop properties, reproducibility, argument validation."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hlo_utils import per_step_copies, per_step_slices

import vase_jax as vj
from vase_jax.eviction import framework
from vase_jax.generate import generate_program
from vase_jax.sampling import SamplingConfig, filtered_distribution
from vase_jax.target import LAYER_LOOPS, Target


@pytest.fixture(scope="module")
def model(tiny_untied):
    return vj.Qwen3.from_pretrained(str(tiny_untied[0]), dtype=jnp.float32)


@pytest.mark.slow
def test_greedy_matches_hf_generate(tiny_untied, model, prompt_batch):
    _, hf = tiny_untied
    ids, mask = prompt_batch.input_ids, prompt_batch.attention_mask
    assert len(set(prompt_batch.lengths.tolist())) == 3  # three different lengths, left padding
    n = 160
    out = vj.generate(model, ids, mask, key=jax.random.key(0),
                      config=vj.GenerateConfig(max_new_tokens=n, temperature=0.0, eos_token_ids=()))
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask), do_sample=False,
                          max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    ref = ref[:, ids.shape[1]:].numpy()
    ours = np.asarray(out.tokens)
    match_len = [int(np.argmin(np.append(r == o, False))) for r, o in zip(ref, ours, strict=True)]
    print("greedy match length per row:", match_len)
    assert match_len == [n] * 3
    assert np.asarray(out.num_tokens).tolist() == [n] * 3 and not np.asarray(out.finished).any()


@pytest.mark.slow
def test_end_tokens_stop_rows_and_pad(model, prompt_batch):
    ids, mask = prompt_batch.input_ids, prompt_batch.attention_mask
    free = vj.generate(model, ids, mask, key=jax.random.key(0),
                       config=vj.GenerateConfig(max_new_tokens=12, temperature=0.0, eos_token_ids=()))
    # declare the 3rd token of row 0 an end token: row 0 stops there, the others continue
    stop = int(free.tokens[0, 2])
    out = vj.generate(model, ids, mask, key=jax.random.key(0),
                      config=vj.GenerateConfig(max_new_tokens=12, temperature=0.0, eos_token_ids=(stop,),
                                               pad_token_id=7))
    toks = np.asarray(out.tokens)
    free_tokens = np.asarray(free.tokens)
    first_stop = [int(np.flatnonzero(row == stop)[0]) if (row == stop).any() else None for row in free_tokens]
    for r in range(3):
        if first_stop[r] is None:
            assert not out.finished[r] and out.num_tokens[r] == 12
            np.testing.assert_array_equal(toks[r], np.asarray(free.tokens[r]))
        else:
            k = first_stop[r]
            assert out.finished[r] and out.num_tokens[r] == k + 1
            np.testing.assert_array_equal(toks[r, : k + 1], np.asarray(free.tokens[r, : k + 1]))
            assert (toks[r, k + 1:] == 7).all()


@pytest.mark.slow
@pytest.mark.parametrize("layer_loop", LAYER_LOOPS)
def test_decode_loop_has_no_cache_sized_copy_per_step(model, layer_loop):
    graphdef, state = nnx.split(model)
    ids = jnp.ones((2, 64), jnp.int32)
    cfg = vj.GenerateConfig(max_new_tokens=200, temperature=0.6, layer_loop=layer_loop)
    target = Target.make("cpu", layer_loop)
    for ev in (vj.EvictionConfig("full"), vj.EvictionConfig("vase_attnv", budget=128, buffer=32)):
        cap = framework.capacity_for(ev, 64, cfg.max_new_tokens)
        caps = jnp.full((2,), cfg.max_new_tokens, jnp.int32)
        hlo = generate_program.lower(graphdef, state, ids, ids, jax.random.key(0), jnp.arange(2), caps, cfg, ev,
                              cap, target).compile().as_text()
        copies = per_step_copies(hlo, lambda dims, cap=cap: cap in dims)  # only cache arrays have a capacity axis
        assert copies == [], f"{ev.method}: cache-sized copies in the decode step:\n" + "\n".join(copies)
        # nor weight-sized copies (a transposed weight has the hidden size and at least as many elements)
        c = model.cfg
        smallest_weight = c.hidden_size * c.head_dim * c.num_kv_heads
        weights = per_step_copies(
            hlo, lambda dims, c=c, n=smallest_weight: c.hidden_size in dims and math.prod(dims) >= n)
        assert weights == [], "\n".join(weights)
        # nor a slice of a weight (XLA:CPU materializes a slice that a dot reads): every layer's weight is read
        # where it lives (tests/test_weight_copies.py checks the operands of every slice too)
        sliced = per_step_slices(
            hlo, lambda dims, c=c, n=smallest_weight: c.hidden_size in dims and math.prod(dims) >= n)
        assert sliced == [], "\n".join(sliced)
    # the check can see copies: a loop that keeps the old value of a cache-sized carry must copy it every step
    # (the eviction branch used to rewrite the cache through a copy; its per-row gather now writes in place)
    cap = framework.capacity_for(vj.EvictionConfig("full"), 64, cfg.max_new_tokens)

    def keeps_old(x):
        return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0, c[1]), (0, x, x))

    hlo = jax.jit(keeps_old).lower(jnp.ones((2, cap))).compile().as_text()
    assert per_step_copies(hlo, lambda dims: cap in dims)


@pytest.mark.slow
def test_generate_inside_a_users_jit(model, prompt_batch):
    """`generate` traced inside the caller's own `jax.jit` (where jax refuses a nested jit's compiler options):
    the same tokens as called on its own, and with the caller's jit compiled under our CPU options too. The
    caller's function is traced once (chex) for several keys."""
    ids, mask = jnp.asarray(prompt_batch.input_ids), jnp.asarray(prompt_batch.attention_mask)
    cfg = vj.GenerateConfig(max_new_tokens=8, temperature=0.6)
    direct = vj.generate(model, ids, mask, key=jax.random.key(1), config=cfg).tokens

    for options in (None, Target.make("cpu").compiler_options()):
        chex.clear_trace_counter()  # chex counts per definition site: one function per loop pass

        @chex.assert_max_traces(n=1)
        def users(ids, mask, key):
            return vj.generate(model, ids, mask, key=key, config=cfg).tokens

        jitted = jax.jit(users, compiler_options=options)
        np.testing.assert_array_equal(np.asarray(jitted(ids, mask, jax.random.key(1))), np.asarray(direct))
        jitted(ids, mask, jax.random.key(2))  # a second key: no retrace


@pytest.mark.slow
def test_compiles_once_per_shape(model, tokenizer):
    cfg = vj.GenerateConfig(max_new_tokens=8, temperature=0.6, top_p=0.9)
    before = generate_program.traces
    for i, texts in enumerate([["a b c", "d"], ["what is one plus one?", "x y"], ["hello", "hello there you"]]):
        batch = vj.encode_prompts(tokenizer, texts)  # different lengths, all within the 64-token bucket
        vj.generate(model, batch.input_ids, batch.attention_mask, key=jax.random.key(i), config=cfg)
    assert generate_program.traces - before == 1


@pytest.mark.slow
def test_same_key_same_tokens_and_different_keys_differ(model, prompt_batch):
    ids, mask = prompt_batch.input_ids, prompt_batch.attention_mask
    cfg = vj.GenerateConfig(max_new_tokens=24, temperature=1.0, top_p=1.0)
    a = vj.generate(model, ids, mask, key=jax.random.key(42), config=cfg)
    b = vj.generate(model, ids, mask, key=jax.random.key(42), config=cfg)
    c = vj.generate(model, ids, mask, key=jax.random.key(43), config=cfg)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()


@pytest.mark.script
@pytest.mark.slow
def test_bit_identical_across_processes(tiny_untied, model, prompt_batch):
    ids, mask = prompt_batch.input_ids, prompt_batch.attention_mask
    cfg = vj.GenerateConfig(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=50)
    here = np.asarray(vj.generate(model, ids, mask, key=jax.random.key(5), config=cfg).tokens)
    code = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np, vase_jax as vj
        m = vj.Qwen3.from_pretrained({str(tiny_untied[0])!r}, dtype=jnp.float32)
        ids = np.array({ids.tolist()}, np.int32); mask = np.array({mask.tolist()}, np.int32)
        cfg = vj.GenerateConfig(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=50)
        print(np.asarray(vj.generate(m, ids, mask, key=jax.random.key(5), config=cfg).tokens).tolist())
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert np.array_equal(np.array(eval(res.stdout.strip().splitlines()[-1])), here)


@pytest.mark.slow
def test_row_stream_does_not_depend_on_the_batch(model, prompt_batch):
    ids, mask = prompt_batch.input_ids, prompt_batch.attention_mask
    cfg = vj.GenerateConfig(max_new_tokens=16, temperature=1.0, top_p=1.0)
    full = np.asarray(vj.generate(model, ids, mask, key=jax.random.key(1), config=cfg).tokens)
    last = vj.encode_prompts  # the last prompt alone (no padding), keeping its row id
    del last
    real = mask[2].astype(bool)
    alone = vj.generate(model, ids[2:, real], mask[2:, real], key=jax.random.key(1), config=cfg,
                        row_ids=jnp.array([2]))
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], full[2])


def test_filtered_distribution_matches_hf_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 300)).astype(np.float32) * 3
    for temperature, top_k, top_p in [(0.6, 0, 0.95), (1.0, 20, 1.0), (0.7, 20, 0.8), (1.3, 0, 0.5)]:
        probs, ids = filtered_distribution(jnp.asarray(logits), SamplingConfig(temperature, top_p, top_k))
        ours = np.zeros(logits.shape, np.float64)  # the sampled distribution, scattered back to the vocabulary
        cols = np.asarray(ids) if ids is not None else np.broadcast_to(np.arange(logits.shape[1]), logits.shape)
        np.put_along_axis(ours, cols, np.asarray(probs, np.float64), axis=1)
        ours /= ours.sum(axis=1, keepdims=True)
        t = torch.tensor(logits)
        t = TemperatureLogitsWarper(temperature)(None, t)
        if top_k:
            t = TopKLogitsWarper(top_k)(None, t)
        if top_p < 1:
            t = TopPLogitsWarper(top_p)(None, t)
        ref = torch.softmax(t.double(), dim=-1).numpy()
        np.testing.assert_array_equal(ours > 0, ref > 0)  # the same kept set
        np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-9)
        assert (ref == 0).any()  # the filter removed something


def test_sampling_follows_the_filtered_distribution():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, top_k=0)  # keeps {0, 1, 2}: mass before token 3 is 0.95
    from vase_jax.sampling import sample

    draws = jax.vmap(lambda k: sample(logits, k, cfg, jnp.array([0]))[0])(jax.random.split(jax.random.key(0), 20000))
    freq = np.bincount(np.asarray(draws), minlength=4) / 20000
    np.testing.assert_allclose(freq[:3], np.array([0.5, 0.3, 0.15]) / 0.95, atol=0.015)
    assert freq[3] == 0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(config=vj.GenerateConfig(max_new_tokens=0)), "max_new_tokens"),
        (dict(config=vj.GenerateConfig(top_p=0.0)), "top_p"),
        (dict(config=vj.GenerateConfig(top_p=1.5)), "top_p"),
        (dict(config=vj.GenerateConfig(temperature=-0.1)), "temperature"),
        (dict(config=vj.GenerateConfig(top_k=-1)), "top_k"),
        (dict(mask=np.ones((3, 5), np.int32)), "attention_mask"),
        (dict(ids=np.zeros((3, 0), np.int32), mask=np.zeros((3, 0), np.int32)), "empty prompt"),
        (dict(mask=np.array([[1, 1, 1], [0, 0, 0], [0, 1, 1]], np.int32)), "empty prompt"),
        (dict(config=vj.GenerateConfig(layer_loop="python")), "layer_loop"),
        (dict(config=vj.GenerateConfig(layer_loop="scan")), "layer_loop"),
        (dict(config=vj.GenerateConfig(platform="metal")), "platform"),
        (dict(config=vj.GenerateConfig(platform="tpu")), "platform.*cpu devices"),
        (dict(config=vj.GenerateConfig(attention_impl="triton")), "attention_impl"),
        (dict(eviction=vj.EvictionConfig("nope", budget=128)), "method"),
        (dict(eviction=vj.EvictionConfig("snapkv", budget=100, buffer=64)), "budget"),
        (dict(eviction=vj.EvictionConfig("snapkv", budget=64, buffer=64)), "budget"),
        (dict(eviction=vj.EvictionConfig("vase_attnv", budget=128, buffer=64, value_slots=62)), "value_slots"),
    ],
)
def test_invalid_arguments_raise_before_compiling(model, kwargs, name):
    ids = kwargs.pop("ids", np.ones((3, 3), np.int32))
    mask = kwargs.pop("mask", np.ones((3, 3), np.int32))
    before = generate_program.traces
    with pytest.raises(ValueError, match=name):
        vj.generate(model, ids, mask, key=jax.random.key(0), **kwargs)
    assert generate_program.traces == before
