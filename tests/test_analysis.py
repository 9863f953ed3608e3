"""vase_jax.analysis: HQQ against a NumPy float64 transcription of the spec's loop, RTN, Pearson, the value-cache
selection, and the scripts/analyze.py smoke run on the tiny random model."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

from vase_jax.analysis import PAPER_CONFIGS, QuantConfig, hqq_quantize, pearson, rtn_quantize, token_mse, token_range
from vase_jax.analysis.values import Accumulator, Moments, value_rows


def numpy_hqq(x, bits, group, optimize=True, iters=20, p=0.7, beta=10.0):
    """The spec's section 5 pseudo-code, line by line, in float64."""
    w = np.asarray(x, np.float64).reshape(-1, group)
    qmax = 2.0**bits - 1
    m, big_m = w.min(axis=1, keepdims=True), w.max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = qmax / (big_m - m)
    s = np.where(np.abs(big_m - m) <= 1e-4, 1.0, s)
    s = np.minimum(s, 2e4)
    z = -m * s
    if optimize:
        best = np.inf
        for _ in range(iters):
            wq = np.clip(np.round(w * s + z), 0, qmax)
            wr = (wq - z) / s
            with np.errstate(divide="ignore"):
                we = np.sign(w - wr) * np.maximum(np.abs(w - wr) - (1 / beta) * np.abs(w - wr) ** (p - 1), 0)
            z = np.mean(wq - (w - we) * s, axis=1, keepdims=True)
            err = np.mean(np.abs(w - wr))
            if err < best:
                best = err
            else:
                break
    q = np.clip(np.round(w * s + z), 0, qmax)
    return ((q - z) * (1 / s)).reshape(np.shape(x))


def _values(seed, rows=96, d=128):
    """Value-cache-like rows: per-token scales, per-channel offsets, a few outliers and constant groups."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, d)) * rng.uniform(0.05, 3.0, (rows, 1)) + rng.standard_normal((1, d)) * 0.5
    x[rng.integers(0, rows, 3), rng.integers(0, d, 3)] = rng.uniform(10, 50, 3)
    x[0, :64] = 0.25  # a constant group: |M - m| <= 1e-4 -> s' = 1
    return x


@pytest.mark.parametrize("config", PAPER_CONFIGS, ids=lambda c: c.name)
def test_without_refinement_hqq_is_rtn_exactly(config):
    for seed in range(3):
        x = jnp.asarray(_values(seed), jnp.float32)
        plain = hqq_quantize(x, config.bits, config.group_size, optimize=False)
        assert np.array_equal(np.asarray(plain), np.asarray(rtn_quantize(x, config.bits, config.group_size)))
        with jax.enable_x64(True):
            x64 = _values(seed)
            np.testing.assert_allclose(np.asarray(rtn_quantize(jnp.asarray(x64), config.bits, config.group_size)),
                                       numpy_hqq(x64, config.bits, config.group_size, optimize=False), atol=1e-12)


@pytest.mark.parametrize("config", PAPER_CONFIGS, ids=lambda c: c.name)
def test_hqq_never_worse_than_rtn_on_random_data(config):
    for seed in range(12):
        x = jnp.asarray(_values(100 + seed), jnp.float32)
        hqq = hqq_quantize(x, config.bits, config.group_size)
        rtn = rtn_quantize(x, config.bits, config.group_size)
        assert float(jnp.mean((hqq - x) ** 2)) <= float(jnp.mean((rtn - x) ** 2)), seed
        assert float(jnp.mean(jnp.abs(hqq - x))) <= float(jnp.mean(jnp.abs(rtn - x))), seed
        assert not np.array_equal(np.asarray(hqq), np.asarray(rtn))  # the refinement did something


@pytest.mark.parametrize("config", PAPER_CONFIGS, ids=lambda c: c.name)
def test_hqq_matches_the_numpy_float64_transcription(config):
    with jax.enable_x64(True):
        for seed in range(4):
            x = _values(200 + seed)
            got = hqq_quantize(jnp.asarray(x), config.bits, config.group_size)
            assert got.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(got), numpy_hqq(x, config.bits, config.group_size), atol=1e-9)
    # float32 (the default for bf16 caches): same quantization up to float32 rounding
    x = _values(300)
    got = np.asarray(hqq_quantize(jnp.asarray(x, jnp.float32), config.bits, config.group_size))
    assert np.mean(np.abs(got - numpy_hqq(x.astype(np.float32), config.bits, config.group_size)) > 1e-4) < 1e-3


def test_masked_rows_do_not_change_the_result():
    """Padding rows (invalid cache slots) do not enter the early-stop error: same result as without them."""
    x = _values(7)
    padded = np.concatenate([x, np.random.default_rng(1).standard_normal((40, 128)) * 100])
    valid = np.arange(len(padded)) < len(x)
    for c in PAPER_CONFIGS:
        want = hqq_quantize(jnp.asarray(x, jnp.float32), c.bits, c.group_size)
        got = hqq_quantize(jnp.asarray(padded, jnp.float32), c.bits, c.group_size, valid=jnp.asarray(valid))
        np.testing.assert_allclose(np.asarray(got)[: len(x)], np.asarray(want), rtol=0, atol=1e-6)


def test_token_mse_and_range():
    x = jnp.asarray([[1.0, 3.0, -1.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert np.allclose(token_range(x), [4.0, 0.0])
    assert np.allclose(token_mse(x, x + jnp.asarray([[1.0, -1.0, 0.0, 2.0], [0.0] * 4])), [1.5, 0.0])


def test_pearson_known_answers():
    a = jnp.asarray([1.0, 2.0, 3.0, 4.0, 5.0])
    assert float(pearson(a, jnp.asarray([2.0, 1.0, 4.0, 3.0, 5.0]))) == pytest.approx(0.8)  # 8 / sqrt(10 * 10)
    assert float(pearson(a, 3 * a + 2)) == pytest.approx(1.0)
    assert float(pearson(a, -a)) == pytest.approx(-1.0)
    assert float(pearson(a, jnp.asarray([1.0, -1.0, 0.0, -1.0, 1.0]))) == pytest.approx(0.0, abs=1e-7)
    assert math.isnan(float(pearson(a, jnp.ones(5))))
    valid = jnp.asarray([True, True, True, False, False])
    assert float(pearson(jnp.asarray([1.0, 2.0, 3.0, 9.0, -9.0]), jnp.asarray([2.0, 4.0, 6.0, 0.0, 5.0]),
                         valid)) == pytest.approx(1.0)


def test_streaming_moments_equal_the_pooled_correlation():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(1000) * 1e-4 + 5e-4  # MSE-like: tiny values around an offset
    b = 3e3 * a + rng.standard_normal(1000) * 0.1 + 2.0
    mom = Moments()
    for chunk in np.array_split(np.arange(1000), [3, 10, 400, 401, 999]):
        mom.add(a[chunk], b[chunk])
    assert mom.pearson == pytest.approx(np.corrcoef(a, b)[0, 1], rel=1e-10)
    assert mom.n == 1000 and mom.mean_a == pytest.approx(a.mean())


def test_value_rows_drop_invalid_slots_and_the_sink_tokens():
    pos = np.array([[-1, -1, 0, 1, 2, 3, 4, 5, 6, -1], [5, 0, 1, 2, 3, 4, 6, 7, -1, -1]], np.int32)
    v = np.arange(2 * 10 * 4, dtype=np.float32).reshape(2, 10, 4)
    rows, valid = value_rows(v, pos, max_pos=7, sinks=4)
    assert rows.shape == (20, 4) and np.array_equal(rows[13], v[1, 3])
    want = (pos >= 4) & (pos < 7)  # the 4 smallest positions of each head are 0..3 here
    assert np.array_equal(valid, want.reshape(-1))
    assert value_rows(v, pos, sinks=0)[1].sum() == (pos >= 0).sum()
    with pytest.raises(ValueError, match="sinks"):
        value_rows(v, pos, sinks=-1)


def test_accumulator_summary_from_known_values():
    configs = (QuantConfig(2, 4),)
    acc = Accumulator(1, configs, scatter_per_sample=10)
    ranges = np.array([[1.0, 2.0, 3.0, 100.0]])
    mse = np.stack([np.array([[1.0, 2.0, 3.0, 0.0]]) * k for k in (1.0, 2.0)], axis=1)[:, None]  # [L, C, 2, N]
    acc.add(ranges, mse, np.array([[True, True, True, False]]))
    summary = acc.summary()
    row = summary["layers"][0]
    assert row["tokens"] == 3 and row["range"]["max"] == 3.0 and row["range"]["p50"] == 2.0
    assert row["pearson"]["b2g4_hqq"] == pytest.approx(1.0) and row["mean_mse"]["b2g4_rtn"] == pytest.approx(4.0)


@pytest.mark.script
@pytest.mark.slow
def test_analyze_random_model_smoke_run(tmp_path, capsys):
    from conftest import load_script

    script = load_script("analyze")
    out = tmp_path / "analysis"
    rc = script.main(["--random-model", "tiny", "--limit", "2", "--max-new-tokens", "8", "--dtype", "float32",
                      "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "groups 64 skipped" in captured.err  # the tiny model's head_dim is 32
    summary = json.loads((out / "summary.json").read_text())
    assert summary["samples"] == 2 and summary["configs"] == ["b2g32", "b4g32"] and len(summary["layers"]) == 2
    for row in summary["layers"]:
        assert row["tokens"] > 0 and row["range"]["max"] >= row["range"]["p50"] > 0
        assert all(-1.0 <= r <= 1.0 for r in row["pearson"].values())
    md = (out / "summary.md").read_text()
    assert "| layer | tokens | b2g32 HQQ | b2g32 RTN | b4g32 HQQ | b4g32 RTN |" in md and "## Range(v)" in md
    for name in ("pearson_per_layer.png", "range_per_layer.png", "mse_vs_range.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert script.main(["--random-model", "tiny", "--bits", "9", "--out", str(out)]) == 2
    assert "--bits: 9 must be in 1..8" in capsys.readouterr().err


def test_kept_vs_range_counts_and_vase_protects_large_range(tokenizer):
    """`analysis.kept`: every method keeps the same share of tokens (same slots per head); vase_attnv, which
    protects the Nv largest Range(v) at every event, keeps more of the large-Range tokens than of all tokens."""
    import vase_jax as vj
    from vase_jax.analysis.kept import kept_vs_range, markdown
    from vase_jax.random_model import TINY

    model = models.full_vocab()
    batch = vj.encode_prompts(tokenizer, ["What is 7 * 8?", "Name a prime number above 10."])
    report = kept_vs_range(model, batch, tokenizer, ("snapkv", "vase_attnv"), budget=32, buffer=16,
                           config=vj.GenerateConfig(max_new_tokens=96, eos_token_ids=()), quantile=95.0)
    shares = {r["method"]: r for r in report["kept"]}
    assert shares["snapkv"]["kept_share_all"] == shares["vase_attnv"]["kept_share_all"] < 0.5
    assert shares["vase_attnv"]["kept_share_large"] > shares["vase_attnv"]["kept_share_all"]
    where = report["where"]
    assert where["large_tokens"] > 0 and abs(sum(where["by_kind"].values()) - 1) < 1e-9
    assert 0 <= where["in_prompt"] <= 1 and len(report["thresholds"]) == TINY.num_layers
    assert "| vase_attnv | 32 |" in markdown(report)
