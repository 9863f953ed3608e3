"""Per-layer weights run by either layer loop (unrolled or switched), the stacked cache, eviction layer by layer,
and what CPU stores as bits."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from hlo_utils import per_step_converts

import vase_jax as vj
from vase_jax import weights
from vase_jax.cache import CACHE_AXES, cache_shapes, init_cache
from vase_jax.config import PARAM_AXES, param_kind, param_shapes
from vase_jax.eviction import framework
from vase_jax.generate import lower_generate
from vase_jax.model import prompt_positions
from vase_jax.random_model import TINY, random_model
from vase_jax.target import LAYER_LOOPS, Target

N, B = 64, 16


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """The tiny HF checkpoint with peaked next-token distributions (init std 0.1): greedy has no near-ties."""
    from conftest import save_tiny_checkpoint

    folder, _ = save_tiny_checkpoint(tmp_path_factory.mktemp("peaked_layers"), seed=11, init_std=0.1)
    return vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)


@pytest.mark.slow
# sampled for every method (the sampler's draws and the scores' ties both see the layers' outputs), greedy once
@pytest.mark.parametrize("method, temperature", [("full", 0.6), ("vase_attnv", 0.6), ("vase_dkv", 0.6),
                                                 ("vase_attnv", 0.0)])
def test_every_layer_loop_gives_identical_tokens(peaked, prompt_batch, method, temperature):
    ev = vj.EvictionConfig(method, budget=N, buffer=B)
    outs = {}
    for loop in LAYER_LOOPS:
        cfg = vj.GenerateConfig(max_new_tokens=96, temperature=temperature, layer_loop=loop, eos_token_ids=())
        outs[loop] = vj.generate(peaked, prompt_batch.input_ids, prompt_batch.attention_mask,
                                 key=jax.random.key(3), config=cfg, eviction=ev)
    np.testing.assert_array_equal(np.asarray(outs["unroll"].tokens), np.asarray(outs["switch"].tokens))
    assert int(outs["unroll"].evictions) == int(outs["switch"].evictions)
    events = int(outs["unroll"].evictions)
    assert events == 0 if method == "full" else events >= 2  # the comparison covers eviction events


@pytest.mark.slow
def test_parameters_are_per_layer_and_the_cache_stacked_with_named_axes(peaked):
    cfg = peaked.cfg
    flat = weights.flat_params(peaked)
    assert {p: tuple(x.shape) for p, x in flat.items()} == param_shapes(cfg)
    assert {p[1] for p in flat if p[0] == "layers"} == set(range(cfg.num_layers))  # one array per layer and kind
    for path, x in flat.items():
        assert len(PARAM_AXES[param_kind(path)]) == x.ndim
    layer_buffers = [x for p, x in flat.items() if p[0] == "layers"]
    assert len({x.unsafe_buffer_pointer() for x in layer_buffers}) == len(layer_buffers)  # no shared storage
    out = vj.generate(peaked, np.ones((3, 5), np.int32), np.ones((3, 5), np.int32), key=jax.random.key(0),
                      config=vj.GenerateConfig(max_new_tokens=4, return_cache=True),
                      eviction=vj.EvictionConfig("snapkv", budget=N, buffer=B))
    shapes = cache_shapes(cfg, 3, out.cache.capacity, B)
    for name, axes in CACHE_AXES.items():
        assert getattr(out.cache, name).shape == shapes[name] and len(axes) == len(shapes[name])
    assert out.cache.k.shape[:3] == (cfg.num_layers, 3, cfg.num_kv_heads)


def test_hf_export_inverts_loading(tiny_tied):
    """The one key table maps both ways: our stacked params exported under HF names equal HF's own tensors."""
    folder, hf = tiny_tied
    model = vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)
    exported = weights.hf_state_dict(weights.flat_params(model), model.cfg)
    reference = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    assert set(exported) == set(reference)
    for name, array in reference.items():
        np.testing.assert_array_equal(exported[name], array, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16])  # the production dtype, whose cache CPU stores as bits
def test_eviction_adds_at_most_one_layer_of_temporaries(dtype):
    """`Compiled.memory_analysis()` of generate: an evicting method at the same cache capacity as `full` needs at
    most about one layer's candidates and scores more (layers are evicted one at a time, in place), not a
    multiple of the cache. The query ring of attention-scored methods is part of their cache and is counted out.
    In bfloat16 (a cache stored as its bits on CPU) the scores stay float32 and the bound is the same."""
    cfg = dataclasses.replace(TINY, num_layers=4, vocab_size=1024)
    model = random_model(cfg, dtype)
    ids = jnp.ones((2, 64), jnp.int32)

    def temp_bytes(ev, max_new):
        lowered = lower_generate(model, ids, ids, key=jax.random.key(0), eviction=ev,
                                 config=vj.GenerateConfig(max_new_tokens=max_new))
        return lowered.compile().memory_analysis().temp_size_in_bytes

    capacity = 192  # full: 64 + 128 new tokens; evicting: N + B = 160 -> 192 (rounded to the block)
    full = temp_bytes(vj.EvictionConfig("full"), 128)
    itemsize, b, h = jnp.dtype(dtype).itemsize, 2, cfg.num_kv_heads
    layer_share = b * h * capacity * (2 * cfg.head_dim * itemsize + 4)  # k, v, pos of one layer
    cache = cfg.num_layers * layer_share
    for method in ("snapkv", "rkv", "rkv_official", "curdkv", "vase_attnv", "vase_dkv"):
        ev = vj.EvictionConfig(method, budget=128, buffer=32)
        ring = 0
        scores = b * h * capacity * 4 * 4  # a few float32 values per candidate
        if vj.eviction.METHODS[method].needs_queries:
            window = 32
            ring = cfg.num_layers * b * h * cfg.group * window * cfg.head_dim * itemsize
            scores += b * h * cfg.group * window * capacity * 4  # one layer's window attention matrix
        extra = temp_bytes(ev, 2000) - full - ring
        print(f"{method}: extra {extra} B, one layer {layer_share} B, scores {scores} B, cache {cache} B")
        assert extra <= layer_share + scores, method
        assert extra < cache / 2, method  # all layers' temporaries at once would be a multiple of this


@pytest.mark.slow
@pytest.mark.parametrize("layer_loop", LAYER_LOOPS)
def test_bf16_generate_holds_no_copy_of_the_embedding_table(layer_loop):
    """`Compiled.memory_analysis()` of a bf16 `generate` on the real vocabulary: the temporaries are the cache and
    activations, no copy of any weight. In particular no copy of the embedding table (19 MB here, the largest
    weight): XLA's loop-invariant code motion would hoist the decode step's uint16 view of the table out of the
    loop and materialize it, so `generate` compiles with that pass off on CPU (`vase_jax.target`)."""
    cfg = dataclasses.replace(TINY, num_layers=4)
    model = random_model(cfg, jnp.bfloat16)
    ids = jnp.ones((2, 64), jnp.int32)
    compiled = lower_generate(model, ids, ids, key=jax.random.key(0),
                              config=vj.GenerateConfig(max_new_tokens=64, layer_loop=layer_loop)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    flat = weights.flat_params(model)
    table = flat[("embedding",)].nbytes
    one_layer = sum(x.nbytes for path, x in flat.items() if path[:2] == ("layers", 0))
    cache = cfg.num_layers * 2 * cfg.num_kv_heads * 128 * (2 * cfg.head_dim * 2 + 4)  # 64 + 64 slots
    activations = 8 * 2 * cfg.vocab_size * 4  # several float32 [batch, vocab] logits and sampling arrays
    print(f"temporaries {temp} B: cache {cache}, activations {activations}, one layer {one_layer}, table {table}")
    assert temp <= cache + activations + one_layer < table


# ---- 16-bit caches are stored as bits on CPU ---------------------------------------------------------------------
@pytest.mark.slow
def test_bf16_cache_kept_as_bits_computes_exactly_as_floats():
    """On CPU a bf16 cache is stored as uint16 bits (`Target.storage`): prefill, decode steps and an eviction
    give bit-identical logits and cache contents to a cache stored as bf16 (as GPUs and TPUs store it)."""
    model = models.peaked("bfloat16")
    cpu, gpu = Target.make("cpu"), Target.make("cuda")
    assert cpu.storage(jnp.bfloat16) == jnp.uint16 and cpu.storage(jnp.float32) == jnp.float32
    assert gpu.storage(jnp.bfloat16) == jnp.bfloat16
    ev = vj.EvictionConfig("vase_attnv", budget=32, buffer=8)
    ids = jax.random.randint(jax.random.key(0), (2, 24), 0, model.cfg.vocab_size)
    mask = jnp.ones_like(ids).at[1, :5].set(0)

    def steps(carry, _):  # one greedy decode step
        cache, token = carry
        logits, cache = model.forward(token[:, None], cache.row_pos[:, None], cache)
        return (cache, jnp.argmax(logits[:, 0], -1)), logits[:, 0]

    @functools.partial(jax.jit, static_argnums=0)
    def run(bits_cache):  # prefill, 16 decode steps, an eviction, 4 more steps
        cache = init_cache(model.cfg, 2, 64, ev.buffer, jnp.bfloat16, target=cpu if bits_cache else gpu)
        logits, cache = model.forward(ids, prompt_positions(mask), cache, attention_mask=mask)
        (cache, token), before = jax.lax.scan(steps, (cache, jnp.argmax(logits[:, -1], -1)), length=16)
        cache = framework.evict(cache, ev, jax.random.key(1), jnp.arange(2), rows=jnp.ones((2,), bool))
        (cache, _), after = jax.lax.scan(steps, (cache, token), length=4)
        return jnp.concatenate([logits[:, -1][None], before, after]), cache

    logits_bits, cache_bits = run(True)
    logits_floats, cache_floats = run(False)
    assert cache_bits.k.dtype == jnp.uint16 and cache_floats.k.dtype == jnp.bfloat16
    assert np.asarray(cache_bits.evictions).tolist() == [1, 1]
    np.testing.assert_array_equal(np.asarray(logits_bits), np.asarray(logits_floats))
    for name in ("k", "v", "queries"):
        got, want = getattr(cache_bits.as_floats(), name), getattr(cache_floats, name)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(cache_bits.pos), np.asarray(cache_floats.pos))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "vase_attnv", "h2o"])
def test_bf16_decode_step_converts_no_cache_sized_array(method):
    """XLA:CPU converts the whole operand of a bf16 dynamic-update-slice to float32 and back; with the cache kept as
    bits no decode step converts a cache-sized array (every layer's write used to rewrite the stacked cache)."""
    model = models.peaked("bfloat16")
    ids = jnp.ones((2, 64), jnp.int32)
    cfg = vj.GenerateConfig(max_new_tokens=200)
    ev = vj.EvictionConfig(method) if method == "full" else vj.EvictionConfig(method, budget=128, buffer=32)
    cap = framework.capacity_for(ev, 64, cfg.max_new_tokens)
    hlo = lower_generate(model, ids, jnp.ones_like(ids), key=jax.random.key(0), config=cfg,
                         eviction=ev).compile().as_text()
    converts = per_step_converts(hlo, lambda dims: cap in dims and len(dims) >= 4)  # [layers, batch, heads, cap..]
    assert converts == [], "\n".join(converts[:5])
    out = vj.generate(model, ids, jnp.ones_like(ids), key=jax.random.key(0), config=cfg.__class__(
        max_new_tokens=8, return_cache=True), eviction=ev)
    assert out.cache.k.dtype == jnp.bfloat16  # handed back as floats
