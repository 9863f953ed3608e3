"""Batch invariance (`vase_jax.invariance`): the probe's rule, and a row whose tokens and cache bits are the same
alone and in batches of 2, 3 and 8, with and without eviction, greedy and sampled, in bfloat16 and float32.

The cache bits are the strict check: a row's tokens can agree while its logits differ in the last bit (then a
longer run or a flatter distribution would part them); its cache holds every key and value its steps wrote.
`test_unpadded_batch_shows_the_difference` runs the same comparison with the padding off: where the probe finds a
batch whose matmul rows differ (on every CPU so far, the one-row float32 matmul), the row's cache differs too, so
the tests above would fail without the padding."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vase_jax as vj
from vase_jax import invariance
from vase_jax.config import Qwen3Config
from vase_jax.invariance import (
    BATCHES,
    DEFAULT_MIN_ROWS,
    RULES_FOLDER,
    RowRule,
    _cancelling,
    padded_rows,
    probe_shapes,
    rule_for,
    rule_key,
    rules_folder,
)
from vase_jax.random_model import HEAD_SCALE, random_model
from vase_jax.target import Target

ROOT = Path(__file__).resolve().parents[1]
PACKAGED = ROOT / "vase_jax" / "data" / "models" / "varchain-qwen3"
CFG = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=64, max_position_embeddings=1024)
STEPS = 40


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 4000, (8, 24)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :5] = 0  # row 0 (the one compared) is left-padded
    mask[2, :9] = 0
    return ids, mask


def _row0(model, prompts, batch, method, temperature, invariant=True):
    """Row 0's tokens and its cache's bits (keys and values, every layer) in a batch of `batch` rows."""
    ids, mask = prompts
    config = vj.GenerateConfig(max_new_tokens=STEPS, temperature=temperature, top_p=1.0, eos_token_ids=(),
                               prompt_buckets=(32,), return_cache=True, batch_invariant=invariant)
    eviction = vj.EvictionConfig(method) if method == "full" else vj.EvictionConfig(method, budget=24, buffer=8)
    keys = jax.vmap(jax.random.key)(jnp.arange(batch) + 11)  # row 0's key is the same in every batch
    out = vj.generate(model, ids[:batch], mask[:batch], key=keys, config=config, eviction=eviction,
                      row_ids=jnp.arange(batch))
    bits = [np.asarray(x[:, 0]).view(np.uint8) for x in (out.cache.k, out.cache.v)]
    return np.asarray(out.tokens[0]), bits, int(out.row_evictions[0])


CASES = [("bfloat16", "full", 0.6), ("bfloat16", "vase_attnv", 0.0), ("float32", "vase_attnv", 0.6),
         ("float32", "vase_dkv", 0.0)]


@pytest.mark.parametrize("dtype, method, temperature", CASES)
def test_a_row_is_the_same_in_batches_of_1_2_3_and_8(prompts, dtype, method, temperature):
    model = random_model(CFG, dtype=getattr(jnp, dtype), seed=1, head_scale=HEAD_SCALE)
    tokens, bits, evictions = _row0(model, prompts, 8, method, temperature)
    if method != "full":
        assert evictions >= 3  # eviction happened, several times
    for batch in (1, 2, 3):
        got_tokens, got_bits, got_evictions = _row0(model, prompts, batch, method, temperature)
        np.testing.assert_array_equal(got_tokens, tokens, err_msg=f"batch {batch}")
        assert got_evictions == evictions
        for got, want in zip(got_bits, bits, strict=True):
            assert np.array_equal(got, want), f"batch {batch}: the row's cache differs from batch 8's"


def test_unpadded_batch_shows_the_difference(prompts):
    """With `batch_invariant=False` a batch whose matmul rows the probe finds different gives row 0 another cache:
    the comparison above is sensitive to what the padding fixes."""
    rule = rule_for(CFG, jnp.float32, Target.make("cpu"))
    small = [m for m in (1, 2, 3) if m in dict(rule.differs).get(f"linear {CFG.hidden_size}->{CFG.vocab_size}", ())]
    if not small:
        pytest.skip(f"this machine's float32 matmuls are row-invariant at batches 1-3 ({rule.describe()})")
    model = random_model(CFG, dtype=jnp.float32, seed=1, head_scale=HEAD_SCALE)
    _, bits, _ = _row0(model, prompts, 8, "full", 0.0, invariant=False)
    _, got, _ = _row0(model, prompts, small[0], "full", 0.0, invariant=False)
    assert not all(np.array_equal(a, b) for a, b in zip(got, bits, strict=True))
    _, padded, _ = _row0(model, prompts, small[0], "full", 0.0)
    assert all(np.array_equal(a, b) for a, b in zip(padded, bits, strict=True))


def test_probe_rule_and_padding():
    rule = probe_shapes(hidden=64, q_dim=128, kv_dim=64, mlp=192, vocab=512, dtype=jnp.float32)
    assert rule.platform == "cpu" and rule.dtype == "float32" and rule.batches == BATCHES
    assert [op for op, _ in rule.differs] == ["linear 64->128", "linear 64->64", "linear 64->192", "linear 64->512",
                                              "linear 128->64", "linear 192->64"]
    bad = {m for _, ms in rule.differs for m in ms}
    if rule.invariant:  # every tested batch from min_rows on agrees, and min_rows is the least such
        assert not any(m >= rule.min_rows for m in bad)
        assert rule.min_rows == DEFAULT_MIN_ROWS["cpu"] or rule.min_rows - 1 in bad
        assert f"from {rule.min_rows} rows" in rule.describe()
    else:
        assert "NOT batch-invariant" in rule.describe()
    fixed = RowRule(3, True, (), "cpu", "x", "bfloat16")
    assert [padded_rows(b, fixed) for b in (1, 2, 3, 5)] == [3, 3, 3, 5]
    assert [padded_rows(b, fixed, data=4) for b in (4, 8, 12, 16)] == [12, 12, 12, 16]  # 3 rows per device
    unmeasured = rule_for(CFG, jnp.bfloat16, Target.make("tpu"))  # no TPU here: the documented default
    assert unmeasured.min_rows == DEFAULT_MIN_ROWS["tpu"] and not unmeasured.invariant
    assert rule_for(CFG, jnp.float32, Target.make("cpu")) is rule_for(CFG, jnp.float32, Target.make("cpu"))  # cached


def test_rules_are_kept_on_disk_and_probed_once_per_machine(tmp_path, monkeypatch):
    """With a rules folder (the persistent compilation cache's: the suite's is on), a rule is probed once and then
    read from disk by any process (here: this one, its per-process cache cleared); another dtype or width is
    probed; an unreadable file is probed again and rewritten; without a folder nothing is written."""
    assert rules_folder() == Path(jax.config.jax_compilation_cache_dir) / RULES_FOLDER  # the suite's cache is on
    folder = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", "gs://bucket/cache")  # remote: rules stay per process
        assert rules_folder() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", folder)
    cfg = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=160, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=32, max_position_embeddings=64)  # widths no other test probes
    probed = []

    def counting_probe(**kw):
        probed.append((kw["dtype"], kw["hidden"]))
        return probe_shapes(**kw)

    monkeypatch.setattr(invariance, "probe_shapes", counting_probe)
    monkeypatch.setattr(invariance, "rules_folder", lambda: tmp_path)

    def rule(c=cfg, dtype=jnp.float32) -> RowRule:
        invariance._cached_rule.cache_clear()  # as a new process
        return rule_for(c, dtype, Target.make("cpu"))

    first = rule()
    files = list(tmp_path.glob("*.json"))
    assert len(probed) == 1 and len(files) == 1
    assert rule() == first and len(probed) == 1  # read back whole, not probed
    rule(dtype=jnp.bfloat16)
    rule(c=dataclasses.replace(cfg, hidden_size=96))
    assert len(probed) == 3 and len(list(tmp_path.glob("*.json"))) == 3
    files[0].write_text("{not json")
    assert rule() == first and len(probed) == 4
    assert json.loads(files[0].read_text())["min_rows"] == first.min_rows  # rewritten
    monkeypatch.setattr(invariance, "rules_folder", lambda: None)
    rule(dtype=jnp.bfloat16)
    assert len(probed) == 5 and len(list(tmp_path.glob("*.json"))) == 3
    invariance._cached_rule.cache_clear()


def test_rule_key_covers_what_changes_the_kernels(monkeypatch):
    """Another dtype, width, device kind, XLA flags or matmul precision is another rule on disk."""
    widths = (64, 64, 32, 160, 320)
    key = rule_key("cpu", "cpu", "float32", widths)
    assert key == rule_key("cpu", "cpu", "float32", widths)
    others = {rule_key("cpu", "cpu", "bfloat16", widths), rule_key("cpu", "cpu", "float32", (64, 64, 32, 160, 321)),
              rule_key("cpu", "other cpu", "float32", widths)}
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")
    others.add(rule_key("cpu", "cpu", "float32", widths))
    monkeypatch.delenv("XLA_FLAGS")
    with jax.default_matmul_precision("highest"):
        others.add(rule_key("cpu", "cpu", "float32", widths))
    assert len(others) == 5 and key not in others


def test_probe_inputs_show_the_order_of_a_sum_in_bfloat16():
    """The probe's inputs make a matmul's summation order visible in a bfloat16 output: the same float32 products
    summed forwards and backwards round to other bfloat16 values in almost every output, where normal inputs (what
    the probe used when it missed a 2-row kernel on an Intel Xeon with AMX) almost never show it."""
    def orders_differ(x, w):  # share of outputs whose bfloat16 value depends on the order of the float32 sum
        products = (np.asarray(x, np.float32)[:, None, :] * np.asarray(w, np.float32)[None]).astype(np.float32)
        forwards = np.zeros(products.shape[:2], np.float32)
        backwards = np.zeros(products.shape[:2], np.float32)
        for i in range(products.shape[2]):
            forwards += products[..., i]
            backwards += products[..., -1 - i]
        bf16 = [np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (forwards, backwards)]
        return np.mean(bf16[0] != bf16[1])

    rng = np.random.default_rng(0)
    x, w = _cancelling(rng, 8, 256, 64, jnp.bfloat16)
    assert orders_differ(x, w) > 0.9
    normal = [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((8, 256), (64, 256))]
    assert orders_differ(*normal) < 0.05


def test_bad_batch_invariant_flag():
    with pytest.raises(ValueError, match=r"GenerateConfig.batch_invariant='yes' must be a bool"):
        vj.GenerateConfig(batch_invariant="yes").validate()


@pytest.mark.script
def test_check_invariance_command():
    """`python -m vase_jax.check_invariance` on the packaged model's folder: one JSON line per dtype, the exit
    status says whether both are invariant; a bad dtype or model is a one-line error."""
    proc = subprocess.run([sys.executable, "-m", "vase_jax.check_invariance", "--model", str(PACKAGED), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["dtype"] for r in lines] == ["bfloat16", "float32"]
    assert proc.returncode == (0 if all(r["invariant"] for r in lines) else 1), proc.stderr[-2000:]
    for r in lines:
        assert r["platform"] == "cpu" and set(r["differs"]) >= {"linear 128->96"}  # the LM head: 96 tokens
    for args, message in [(["--dtypes", "int8"], "--dtypes 'int8': allowed"),
                          (["--model", "Qwen3-3B"], "not a known size")]:
        proc = subprocess.run([sys.executable, "-m", "vase_jax.check_invariance", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_fixed_splits_make_the_gpu_kernels_split_count_batch_free():
    """The Triton decode kernel deals a row's blocks to `num_splits` programs, a count its rule takes from the batch
    (more splits for fewer rows): under `fixed_splits()` the count is the same at batch 1, 16 and 128."""
    from pallas_kernels import decode_tuning

    def splits(batch):
        return decode_tuning.decode_params(batch=batch, kv_heads=8, group=4, head_dim=128, capacity=4096,
                                           dtype=jnp.bfloat16, device_kind="NVIDIA H200").num_splits

    assert len({splits(b) for b in (1, 16, 128)}) == 3  # the tuned rule: batch-dependent
    with decode_tuning.fixed_splits():
        assert {splits(b) for b in (1, 16, 128)} == {splits(decode_tuning.INVARIANT_BATCH)}
    assert splits(128) == 1  # the context is left


@pytest.mark.parametrize("invariant", [True, False])
def test_generate_lowered_for_a_gpu_splits_as_batch_invariance_says(invariant):
    """`generate` lowered for an H200 (deviceless) at 128 rows: with `batch_invariant` the decode kernel splits as at
    16 rows and merges its partials; without, one split, no merge (the tuned rule for a large batch)."""
    from vase_jax.generate import lower_generate

    wide = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=16,
                       num_kv_heads=8, head_dim=128, max_position_embeddings=8192)  # 8 kv heads, the table's rows
    model = random_model(wide, dtype=jnp.bfloat16, seed=1)
    ids = jnp.ones((128, 24), jnp.int32)
    config = vj.GenerateConfig(max_new_tokens=4096, prompt_buckets=(32,), batch_invariant=invariant)
    text = lower_generate(model, ids, ids, key=jax.random.key(0), config=config, platforms=("cuda",)).as_text()
    assert ("vase_decode_attention_merge" in text) == invariant
