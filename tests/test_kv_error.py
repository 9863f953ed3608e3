"""vase_jax.analysis.kv_error: the attention-output error of a quantized KV cache against the 16-bit cache, with
and without protection, on the tiny random Qwen3; and scripts/analyze.py's --kv-error report."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

from vase_jax.analysis.kv_error import (
    attention_forms,
    dequantized,
    kv_error,
    layer_errors,
    layer_qkv,
    parse_settings,
    protection,
)
from vase_jax.cache import init_cache
from vase_jax.model import dense_attention
from vase_jax.random_model import TINY
from vase_jax.target import Target

SETTINGS = parse_settings("K8V8g32,K4V4g32", TINY.head_dim)  # the tiny model's head_dim is 32
N = 160  # tokens of the test sequence


@pytest.fixture(scope="module")
def model():
    return models.peaked()


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, models.VOCAB, N).astype(np.int32)


@pytest.fixture(scope="module")
def qkv(model, tokens):
    """Every layer's (q, k, v) [kv_heads, ...] of the test sequence through the module's hook, and the last
    layer's output."""
    target = Target.of(model.embedding[...])
    positions = jnp.arange(N, dtype=jnp.int32)[None]
    x = model.embed(jnp.asarray(tokens)[None], target)
    layers = []
    for w in model.layer_weights():
        q, k, v, x = layer_qkv(model.cfg, w, x, positions, target)
        layers.append((q[0], k[0], v[0]))
    return layers, x


def rel_errors(summary, name):
    return [(row["rel_error"][name]["unprotected"], row["rel_error"][name]["protected"]) for row in summary["layers"]]


def test_reference_is_the_models_own_attention(model, tokens, qkv):
    """K and V are what the model's prefill writes into its cache; the float32 reference output is the model's
    `dense_attention` on them; the hook's last layer output gives the model's logits."""
    layers, x_last = qkv
    ids = jnp.asarray(tokens)[None]
    positions = jnp.arange(N, dtype=jnp.int32)[None]
    _, cache = model.forward(ids, positions, init_cache(model.cfg, 1, N, 0, jnp.float32))
    mask = jnp.tril(jnp.ones((N, N), bool))[None]
    qpos = jnp.arange(N - 48, N, dtype=jnp.int32)
    hats = tuple((dequantized(k, 4, 32), dequantized(v, 4, 32)) for _, k, v in layers[:1])
    for layer, (q, k, v) in enumerate(layers):
        # the same math in another program (the jitted prefill): equal up to float32 rounding
        np.testing.assert_allclose(np.asarray(cache.k[layer, 0]), np.asarray(k), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(cache.v[layer, 0]), np.asarray(v), rtol=1e-5, atol=1e-5)
        o, _, _ = attention_forms(q[:, :, qpos], k, v, hats, qpos, 0.25, 4, 8)
        want = dense_attention(q[None], k[None], v[None], mask)[0][:, :, qpos]  # [kv_heads, group, 48, D]
        np.testing.assert_allclose(np.asarray(o), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(model.logits(x_last)), np.asarray(model(ids)), rtol=1e-5, atol=1e-5)


def test_protection_rule():
    """Sinks, the recent window and the top floor(protected * (t + 1)) of the rest by Range (ties: earlier)."""
    ranges = jnp.asarray([[9.0, 1.0, 5.0, 2.0, 5.0, 7.0, 0.5, 3.0, 1.0, 1.0]])  # [1 kv head, 10 tokens]
    qpos = jnp.asarray([9, 7, 2])
    got = np.asarray(protection(ranges, qpos, 0.25, 1, 2))[0]  # 1 sink, 2 recent
    # t = 9: sink 0, recent 8, 9; floor(2.5) = 2 of 1..7 by Range: 5 (7.0), then 2 and 4 tie at 5.0 -> 2
    assert np.flatnonzero(got[0]).tolist() == [0, 2, 5, 8, 9]
    # t = 7: recent 6, 7; floor(2.0) = 2 of 1..5: 5 (7.0), 2 (5.0 before 4)
    assert np.flatnonzero(got[1]).tolist() == [0, 2, 5, 6, 7]
    assert np.flatnonzero(got[2]).tolist() == [0, 1, 2]  # everything of a short prefix is sink or recent
    assert np.asarray(protection(ranges, qpos, 1.0, 0, 0)).sum(-1).tolist() == [[10, 8, 3]]
    assert np.asarray(protection(ranges, qpos, 0.0, 0, 0)).sum() == 0


def test_protecting_every_token_gives_exactly_zero_error(model, tokens):
    summary = kv_error(model, tokens, SETTINGS, protected=1.0, buffer=8, queries=64).summary()
    for s in SETTINGS:
        for unprot, prot in rel_errors(summary, s.name):
            assert prot == 0.0 and unprot > 0.0
    assert all(row["kept_16bit"] == 1.0 for row in summary["layers"])


def test_error_grows_as_bits_shrink_and_protection_lowers_it(model, tokens):
    summary = kv_error(model, tokens, SETTINGS, buffer=8, queries=64).summary()
    k8, k4 = rel_errors(summary, "K8V8g32"), rel_errors(summary, "K4V4g32")
    for (k8u, k8p), (k4u, k4p) in zip(k8, k4, strict=True):
        assert 0.0 < k8u <= 1e-2 and k8p <= 1e-2
        assert k4u > k8u and k4p > k8p
        assert k8p < k8u and k4p < k4u
    assert summary["sequences"] == 1 and len(summary["layers"]) == TINY.num_layers
    assert all(0.25 < row["kept_16bit"] < 1.0 for row in summary["layers"])
    assert all(row["pairs"] == 64 * TINY.num_heads for row in summary["layers"])
    assert summary["mean"]["rel_error"]["K4V4g32"]["unprotected"] == pytest.approx(np.mean([u for u, _ in k4]))


def test_protection_removes_most_of_the_error_of_a_planted_large_range_channel(qkv):
    """One value channel of 10% of the tokens made very large: those tokens have the largest Range, their groups
    quantize coarsely; protection keeps them in 16 bits."""
    q, k, v = qkv[0][0]
    rng = np.random.default_rng(1)
    planted = rng.choice(np.arange(4, N - 8), N // 10, replace=False)
    v = v.at[:, planted, 3].set(40.0)
    qidx = jnp.arange(N - 64, N, dtype=jnp.int32)
    stats = jax.device_get(layer_errors(q, k, v, qidx, jnp.ones(64, bool), SETTINGS, 0.25, 4, 8, 64))
    rel = np.sqrt(stats["err2"] / stats["ref2"])  # [settings, (unprotected, protected)]
    assert (rel[:, 1] < 0.2 * rel[:, 0]).all(), rel


@pytest.fixture(scope="module")
def script():
    from conftest import load_script

    return load_script("analyze")


@pytest.mark.script
def test_analyze_kv_error_option_writes_the_table(script, tmp_path, capsys):
    out = tmp_path / "analysis"
    rc = script.main(["--random-model", "tiny", "--limit", "1", "--max-new-tokens", "8", "--dtype", "float32",
                      "--groups", "32", "--kv-error", "K8V8g32,K4V4g32", "--kv-queries", "32", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = json.loads((out / "summary.json").read_text())
    kv = summary["kv_error"]
    assert kv["settings"] == ["K8V8g32", "K4V4g32"] and kv["protected"] == 0.25 and kv["sequences"] == 1
    assert len(kv["layers"]) == TINY.num_layers
    for row in kv["layers"]:
        for name in kv["settings"]:
            assert 0.0 < row["rel_error"][name]["unprotected"] < 1.0
    md = (out / "summary.md").read_text()
    assert "| layer | K8V8g32 unprot | K8V8g32 prot | K4V4g32 unprot | K4V4g32 prot | 16-bit share |" in md
    assert "## Pearson correlation" in md  # the existing report is still there


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-error", "K3V3"], "--kv-error: 'K3V3': key_bits=3"),
    (["--kv-error", "K8V8g32,K4V8g32"], "--kv-error: 'K4V8g32': key_bits=4 < value_bits=8"),
    (["--kv-error", "K8V8"], "--kv-error: 'K8V8': key_group=128 must divide head_dim=32"),
    (["--kv-error", "bf16"], "--kv-error: 'bf16': quantizes nothing"),
    (["--kv-error", "K8V4g32", "--kv-protected", "1.5"], "--kv-protected=1.5 must be in [0, 1]"),
    (["--kv-protected", "0.5"], "--kv-protected needs --kv-error"),
])
@pytest.mark.script
def test_analyze_kv_error_bad_values(script, tmp_path, capsys, args, message):
    assert script.main(["--random-model", "tiny", "--out", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()
