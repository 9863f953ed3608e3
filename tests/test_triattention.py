"""TriAttention: kept sets against a float64 NumPy port of the authors' scoring and selection, its calibration
against the HF model's own queries, and the method inside `generate`.

The reference follows the authors' HF path step by step: keys un-rotated with their positions, per frequency the
amplitude, phase and norm term, cos((t0 - p + o) w + phi) summed over frequencies and averaged (or maxed) over the
offsets, z-scores per (layer, query head) over the decode slots, then per_head (mean over layers of the max over
a kv head's query heads), union (max over every head, kept slots sorted) or per_layer_perhead; the prompt always
kept first; ties to the lower slot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

import vase_jax as vj
from vase_jax.cache import init_cache
from vase_jax.calibration import query_statistics
from vase_jax.config import Qwen3Config
from vase_jax.eviction import framework
from vase_jax.eviction.triattention import Calibration, load_calibration, save_calibration

LAYERS, HEADS, KV_HEADS, D = 3, 4, 2, 16  # GQA group 2
N, B = 24, 8
CFG = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=LAYERS, num_heads=HEADS,
                  num_kv_heads=KV_HEADS, head_dim=D, rope_theta=10000.0)
# per row: (prompt length, cache length, next position t0); row 3 is not due (its trigger does not fire)
ROWS = ((3, N + B, 70), (7, N + B, 45), (N + 2, N + B, N + B), (5, N + 5, 60))


def random_calibration(seed=0) -> Calibration:
    rng = np.random.default_rng(seed)
    shape = (LAYERS, HEADS, D // 2)
    q_mean = (rng.normal(size=shape) + 1j * rng.normal(size=shape)) * rng.uniform(0.2, 2.0, size=shape)
    q_abs = np.abs(q_mean) + rng.uniform(0.0, 1.5, size=shape)
    return Calibration(q_mean.astype(np.complex64), q_abs.astype(np.float32), {"rope_theta": CFG.rope_theta})


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    return save_calibration(str(tmp_path_factory.mktemp("ta") / "stats.npz"), random_calibration())


def positions(rng, shared: str):
    """pos [layers, rows, kv_heads, capacity]: each row's prompt in slots [0, P) in order, then decode positions
    in [P, t0) in a random order (as after earlier evictions); shared across layers and heads as the mode keeps
    them ("union": one order per row; "per_head": per kv head; "per_layer_perhead": per layer and kv head)."""
    cap = N + B
    pos = np.full((LAYERS, len(ROWS), KV_HEADS, cap), -1, np.int32)
    for r, (p, length, t0) in enumerate(ROWS):
        for layer in range(LAYERS):
            for h in range(KV_HEADS):
                if shared == "union" and (layer or h):
                    pos[layer, r, h] = pos[0, r, 0]
                    continue
                if shared == "per_head" and layer:
                    pos[layer, r, h] = pos[0, r, h]
                    continue
                prompt = min(p, length)
                decode = rng.choice(np.arange(p, t0), size=length - prompt, replace=False)
                pos[layer, r, h, :length] = np.concatenate([np.arange(prompt), decode])
    return pos


def make_cache(seed: int, shared: str):
    rng = np.random.default_rng(seed)
    cap = N + B
    cache = init_cache(CFG, len(ROWS), cap, 0, jnp.float32)
    keys = rng.normal(size=cache.k.shape) * rng.uniform(0.5, 2.0, size=cache.k.shape[:-1] + (1,))
    prompt, length, t0 = (np.array([r[i] for r in ROWS], np.int32) for i in range(3))
    seen = np.where(np.arange(len(ROWS)) == 3, N + 5, N + B).astype(np.int32)  # row 3: N + 5, not a tick
    cache = cache.replace(k=jnp.asarray(keys, jnp.float32), v=jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32),
                          pos=jnp.asarray(positions(rng, shared)), length=jnp.asarray(length), seen=jnp.asarray(seen),
                          row_pos=jnp.asarray(t0), prompt_length=jnp.asarray(prompt))
    return cache


def reference_scores(k_rot, pos, t0, q_mean, q_abs, opts):
    """[slots] float64 scores of one (layer, query head) row: the authors' formula on un-rotated keys."""
    f = D // 2
    w = 1.0 / (CFG.rope_theta ** (np.arange(0, D, 2) / D))
    angle = pos[:, None] * w  # [slots, F]
    k = k_rot[:, :f] + 1j * k_rot[:, f:]
    k_pre = k * np.exp(-1j * angle)  # un-rotated
    q = q_mean.astype(np.complex128)
    amp = np.abs(q) * np.abs(k_pre)
    phi = np.angle(q * np.conj(k_pre))
    extra = ((q_abs - np.abs(q)) * np.abs(k_pre)).sum(-1)  # [slots]
    offs = 2.0 ** np.arange(int(np.log2(opts.offset_max)) + 1)
    delta = (t0 - pos)[:, None] + offs  # [slots, offsets]
    per_offset = (amp[:, None] * np.cos(delta[..., None] * w + phi[:, None])).sum(-1) + extra[:, None]
    return per_offset.mean(1) if opts.offset_aggregation == "mean" else per_offset.max(1)


def reference_kept(cache, cal: Calibration, eviction) -> np.ndarray:
    """[layers, rows, kv_heads, N] positions after one event, in slot order (rows not due: unchanged)."""
    opts = eviction.options
    keys, pos = np.asarray(cache.k, np.float64), np.asarray(cache.pos)
    out = pos[..., :N].copy()
    group = HEADS // KV_HEADS
    recent = eviction.recent
    for r, (p, length, t0) in enumerate(ROWS):
        if r == 3:
            continue
        cand = length - recent  # candidates [0, cand); the newest `recent` slots follow the kept ones
        z = np.zeros((LAYERS, HEADS, cand))
        for layer in range(LAYERS):
            for h in range(HEADS):
                g = h // group
                s = reference_scores(keys[layer, r, g, :cand], pos[layer, r, g, :cand], t0,
                                     cal.q_mean[layer, h], cal.q_abs_mean[layer, h], opts)
                scored = pos[layer, r, g, :cand] >= p
                if opts.normalize and scored.any():
                    s = (s - s[scored].mean()) / max(s[scored].std(), 1e-6)
                z[layer, h] = np.where(scored, s, 0.0)
        by_group = z.reshape(LAYERS, KV_HEADS, group, cand)
        if opts.mode == "per_head":
            agg = np.broadcast_to(by_group.max(2).mean(0), (LAYERS, KV_HEADS, cand))
        elif opts.mode == "union":
            agg = np.broadcast_to(z.max((0, 1)), (LAYERS, KV_HEADS, cand))
        else:
            agg = by_group.mean(2) if opts.head_aggregation == "mean" else by_group.max(2)
        for layer in range(LAYERS):
            for g in range(KV_HEADS):
                slots = np.arange(cand)
                prompt = slots[pos[layer, r, g, :cand] < p][: N - recent]
                decode = slots[pos[layer, r, g, :cand] >= p]
                order = decode[np.lexsort((decode, -agg[layer, g, decode]))]  # descending, ties: lower slot
                kept = np.concatenate([prompt, order])[: N - recent]
                if opts.mode == "union":
                    kept = np.sort(kept)
                newest = np.arange(length - recent, length)
                out[layer, r, g] = pos[layer, r, g, np.concatenate([kept, newest])]
    return out


CASES = [
    dict(mode="per_head"),
    dict(mode="union"),
    dict(mode="per_layer_perhead"),
    dict(mode="per_layer_perhead", head_aggregation="mean"),
    dict(mode="per_head", keep_recent=True),
    dict(mode="per_head", offset_aggregation="max", offset_max=4096),
    dict(mode="union", normalize=False),
]


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("seed", [0, 1])
def test_kept_sets_equal_the_reference(options, seed, calibration_file):
    eviction = vj.EvictionConfig("triattention", budget=N, buffer=B, calibration=calibration_file,
                                 **options).validate()
    shared = "per_layer_perhead" if options["mode"] == "per_layer_perhead" else options["mode"]
    cache = make_cache(seed, shared)
    evicted = jax.jit(framework.evict, static_argnums=1)(cache, eviction, jax.random.key(0), jnp.arange(len(ROWS)))
    want = reference_kept(cache, load_calibration(calibration_file), eviction)
    got = np.asarray(evicted.pos)[..., :N]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(evicted.length), [N, N, N, N + 5])
    np.testing.assert_array_equal(np.asarray(evicted.pos)[:, 3], np.asarray(cache.pos)[:, 3])  # not due
    for r, (p, _, _) in enumerate(ROWS[:3]):  # the prompt is kept (row 2, P > N: its first N - R prompt slots)
        assert (got[:, r] < p).sum(-1).min() >= min(p, N - eviction.recent)


def test_the_folded_mean_matches_every_offset():
    """The mean over offsets folded into one complex factor (what runs) equals scoring every offset."""
    rng = np.random.default_rng(3)
    cal = random_calibration(3)
    k = rng.normal(size=(20, D))
    pos = rng.integers(0, 50, size=20)
    opts = vj.EvictionConfig("triattention", budget=N, buffer=B, calibration="x").options
    direct = reference_scores(k, pos, 60, cal.q_mean[0, 0], cal.q_abs_mean[0, 0], opts)
    f = D // 2
    w = 1.0 / (CFG.rope_theta ** (np.arange(0, D, 2) / D))
    mean_phase = np.exp(1j * (2.0 ** np.arange(17))[:, None] * w).mean(0) * np.exp(1j * 60 * w)
    kc = k[:, :f] + 1j * k[:, f:]
    q = cal.q_mean[0, 0].astype(np.complex128)
    folded = (np.real(q * np.conj(kc) * mean_phase).sum(-1)
              + ((cal.q_abs_mean[0, 0] - np.abs(q)) * np.abs(kc)).sum(-1))
    np.testing.assert_allclose(folded, direct, rtol=1e-9, atol=1e-9)


# ---- calibration ---------------------------------------------------------------------------------------------
def test_calibration_matches_the_hf_models_queries_and_round_trips(tiny_untied, tmp_path):
    """The statistics equal those of the HF model's own q_norm outputs (a forward hook: post-norm, pre-RoPE),
    twice the same, and the file gives back exactly what was saved."""
    import torch

    folder, hf = tiny_untied
    model = vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, hf.config.vocab_size, size=n).tolist() for n in (9, 30, 17)]
    first = query_statistics(model, seqs, batch=2, source="test")
    again = query_statistics(model, seqs, batch=2, source="test")
    np.testing.assert_array_equal(first.q_mean, again.q_mean)
    np.testing.assert_array_equal(first.q_abs_mean, again.q_abs_mean)

    captured = {}
    hooks = [layer.self_attn.q_norm.register_forward_hook(
        lambda mod, inp, out, i=i: captured.setdefault(i, []).append(out[0].double().numpy()))
        for i, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        for s in seqs:
            hf(torch.tensor([s]))
    for h in hooks:
        h.remove()
    f = hf.config.head_dim // 2
    for layer, outs in captured.items():
        q = np.concatenate(outs, axis=0)  # [tokens, heads, head_dim]
        qc = q[..., :f] + 1j * q[..., f:]
        np.testing.assert_allclose(first.q_mean[layer], qc.mean(0), rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(first.q_abs_mean[layer], np.abs(qc).mean(0), rtol=2e-5, atol=2e-6)
    assert first.meta["tokens"] == sum(map(len, seqs))

    path = save_calibration(str(tmp_path), first)  # a folder: the model's statistics file inside it
    loaded = load_calibration(str(tmp_path))
    assert path.endswith("triattention_stats.npz")
    np.testing.assert_array_equal(loaded.q_mean, first.q_mean)
    np.testing.assert_array_equal(loaded.q_abs_mean, first.q_abs_mean)
    assert loaded.meta["tokens"] == first.meta["tokens"] and loaded.meta["version"] == 1


# ---- in generate ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_and_stats(tmp_path_factory):
    from vase_jax.random_model import TINY

    model = models.full_vocab()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, TINY.vocab_size, size=48).tolist() for _ in range(4)]
    path = save_calibration(str(tmp_path_factory.mktemp("tiny_stats")), query_statistics(model, seqs, batch=4))
    return model, path


def test_in_generate(model_and_stats):
    """Same key, same tokens; a budget above the trace gives full's tokens; one trace for several prompts and
    keys of one shape; evictions happen at the framework's ticks (cache back to N)."""
    from vase_jax.generate import generate_program

    model, path = model_and_stats
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, 1000, size=(2, 10)), jnp.int32)
    mask = jnp.ones_like(ids).at[1, :3].set(0)  # row 1 left-padded
    cfg = vj.GenerateConfig(max_new_tokens=72, temperature=0.0)
    ev = vj.EvictionConfig("triattention", budget=32, buffer=8, calibration=path)
    before = generate_program.traces
    one = vj.generate(model, ids, mask, key=jax.random.key(0), config=cfg, eviction=ev)
    two = vj.generate(model, ids, mask, key=jax.random.key(0), config=cfg, eviction=ev)
    other = jnp.asarray(rng.integers(0, 1000, size=(2, 10)), jnp.int32)
    vj.generate(model, other, jnp.ones_like(other), key=jax.random.key(5), config=cfg, eviction=ev)
    assert generate_program.traces - before == 1
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(two.tokens))
    assert int(one.evictions) > 0 and (np.asarray(one.cache_length) <= 32 + 8).all()

    full = vj.generate(model, ids, mask, key=jax.random.key(0), config=cfg)
    roomy = vj.generate(model, ids, mask, key=jax.random.key(0), config=cfg,
                        eviction=dataclasses.replace(ev, budget=128))
    assert int(roomy.evictions) == 0
    np.testing.assert_array_equal(np.asarray(roomy.tokens), np.asarray(full.tokens))


def test_bad_options_and_missing_calibration_fail_before_compiling(model_and_stats, tmp_path):
    from vase_jax.generate import generate_program

    model, path = model_and_stats
    ids = jnp.ones((1, 4), jnp.int32)
    before = generate_program.traces

    def run(**kw):
        ev = vj.EvictionConfig("triattention", budget=32, buffer=8, **kw)
        vj.generate(model, ids, jnp.ones_like(ids), key=jax.random.key(0),
                    config=vj.GenerateConfig(max_new_tokens=4), eviction=ev)

    with pytest.raises(ValueError, match=r"needs calibration=.*python scripts/calibrate.py"):
        run()
    with pytest.raises(ValueError, match=r"no TriAttention calibration at .*triattention_stats.npz; make one with "
                                         r"`python scripts/calibrate.py --model "):
        run(calibration=str(tmp_path))
    with pytest.raises(ValueError, match=r"EvictionConfig.mode='per_token'; allowed: per_head, union"):
        run(calibration=path, mode="per_token")
    with pytest.raises(ValueError, match=r"offset_max=0 must be an integer >= 1"):
        run(calibration=path, offset_max=0)
    other = save_calibration(str(tmp_path / "other.npz"), random_calibration())  # another model's shape
    with pytest.raises(ValueError, match=r"statistics of shape \(3, 4, 8\).*\(2, 4, 16\)"):
        run(calibration=other)
    with pytest.raises(ValueError, match=r"'triattention' does not run on the mixed-precision cache"):
        vj.generate(model, ids, jnp.ones_like(ids), key=jax.random.key(0),
                    config=vj.GenerateConfig(max_new_tokens=4, key_bits=8, value_bits=8),
                    eviction=vj.EvictionConfig("triattention", budget=64, buffer=8, calibration=path))
    bad = tmp_path / "bad.npz"
    np.savez(bad, meta=np.array('{"format": "something-else", "version": 1}'), q_mean_real=np.zeros(1),
             q_mean_imag=np.zeros(1), q_abs_mean=np.zeros(1))
    with pytest.raises(ValueError, match=r"format 'something-else' version 1; this library reads"):
        run(calibration=str(bad))
    assert generate_program.traces == before


# ---- the evaluation's settings ---------------------------------------------------------------------------------
def test_eval_finds_the_models_calibration_and_guards_resume(tmp_path):
    from vase_jax import evaluation as ev
    from vase_jax.evaluation.config import packaged_model_dir

    packaged = str(packaged_model_dir())
    cfg, _ = ev.resolve(model=packaged, task="varchain", methods=("full", "triattention"), limit=1)
    assert cfg.calibration == f"{packaged}/triattention_stats.npz" and len(cfg.calibration_sha256) == 64
    assert cfg.eviction("triattention", 96).options.calibration == cfg.calibration
    with pytest.raises(ValueError, match=r"--methods triattention with --model random:tiny: pass --calibration"):
        ev.resolve(model="random:tiny", task="gsm8k", methods=("triattention",), limit=1)
    with pytest.raises(ValueError, match=r"--calibration is for --methods triattention"):
        ev.resolve(model=packaged, task="varchain", methods=("snapkv",), limit=1, calibration=cfg.calibration)
    with pytest.raises(ValueError, match=r"no calibration at .*nothing.npz; make it with"):
        ev.resolve(model=packaged, task="varchain", methods=("triattention",), limit=1,
                   calibration=str(tmp_path / "nothing.npz"))

    out = tmp_path / "run"
    ev.write_config(cfg, out)
    (out / "records.jsonl").write_text("{}\n")
    other = dataclasses.replace(cfg, calibration_sha256="0" * 64)  # other statistics: other results
    with pytest.raises(ValueError, match=r"calibration_sha256="):
        ev.check_resume(other, out)
    others, _ = ev.resolve(model=packaged, task="varchain", methods=("full", "snapkv"), limit=1)
    ev.check_resume(others, out)  # methods that read no statistics resume the folder ...
    ev.write_config(others, out)
    with pytest.raises(ValueError, match=r"calibration_sha256="):  # ... and the folder remembers them
        ev.check_resume(other, out)


def test_eval_runs_the_mixed_precision_cache_for_the_methods_that_have_it():
    """TriAttention's kept set is shared over layers, which the mixed-precision cache does not do: a --kv-bits
    run leaves it out of the mixed-precision variants by default and refuses it when --kv-methods names it."""
    from vase_jax import evaluation as ev
    from vase_jax.evaluation.config import packaged_model_dir

    packaged = str(packaged_model_dir())
    cfg, _ = ev.resolve(model=packaged, task="varchain", methods=("full", "triattention", "vase_dkv"), limit=1,
                        budgets=(96,), kv_bits=("bf16", "K4V4"))
    assert cfg.variants == (("full", None, "K16V16"), ("triattention", 96, "K16V16"), ("vase_dkv", 96, "K16V16"),
                            ("full", None, "K4V4"), ("vase_dkv", 96, "K4V4"))
    with pytest.raises(ValueError, match=r"--kv-methods: 'triattention' does not run on the mixed-precision cache "
                                         r"of --kv-bits K4V4; methods that do: full, "):
        ev.resolve(model=packaged, task="varchain", methods=("triattention",), limit=1, kv_bits=("K4V4",),
                   kv_methods=("triattention",))
    plain, _ = ev.resolve(model=packaged, task="varchain", methods=("full", "vase_dkv"), limit=1, kv_bits=("K4V4",))
    assert plain.kv_methods is None  # every method runs on it: nothing left out
