"""benchmarks.bench: a smoke run on the tiny-1k model (output schema, every figure positive, the replayed cache
schedule equal to generate's), one-line errors on bad input, and the shared pieces (`benchmarks.timing`,
`decode_step`, `workload`) against independent references. No timing assertions."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import vase_jax as vj
from benchmarks import bench
from benchmarks import decode_step as ds
from benchmarks import workload as wl
from benchmarks.timing import Stat, decode_rate
from vase_jax.cache import init_cache
from vase_jax.eviction import framework
from vase_jax.random_model import SMALL, TINY_1K, shrink

ROOT = Path(__file__).resolve().parents[1]


def _bench(args: list[str]) -> subprocess.CompletedProcess:
    """`python -m benchmarks.bench ARGS` from the repository root, as the docs run it."""
    return subprocess.run([sys.executable, "-m", "benchmarks.bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
STAT_KEYS = {"median", "min", "max", "runs"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = ["--model", "tiny-1k", "--batch", "2", "--prompt-len", "16", "--output-lens", "64", "--methods",
            "full,vase_dkv", "--budgets", "32", "--buffer", "8", "--warmup", "0", "--micro-steps", "4",
            "--bandwidth-mib", "16", "--out", str(out)]
    res = _bench(args)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), out


def _check_stat(stat: dict, repeats: int = 3):
    assert set(stat) == STAT_KEYS
    assert len(stat["runs"]) >= repeats
    assert 0 < stat["min"] <= stat["median"] <= stat["max"]


@pytest.mark.slow
def test_smoke_outputs_and_positive_figures(smoke):
    result, out = smoke
    assert {"meta", "bandwidth", "runs"} <= set(result)
    assert (out / "results.md").read_text().startswith("Command: `python -m benchmarks.bench --model tiny-1k")
    assert set(result["bandwidth"]) == {"read", "copy"} and all(v > 0 for v in result["bandwidth"].values())
    runs = {(r["method"], r["output_len"]): r for r in result["runs"]}
    assert set(runs) == {("full", 64), ("vase_dkv", 64)}
    for r in runs.values():
        for key in ("total_s", "prefill_s", "decode_tok_s", "step_ms_end"):
            _check_stat(r[key])
        for key in ("compile_s", "tok_s_end", "cache_bytes", "program_bytes"):
            assert r[key] > 0, key
        # the 16-bit cache alone: no mixed-precision setting, its own tokens
        assert (r["kv_bits"], r["protected"], r["x_bf16_cache"], r["tokens_agree_with_bf16"]) == ("K16V16", None, 1, 1)
        roof = r["roofline"]
        assert roof["bytes_step_start"] <= roof["bytes_step_mean"] * 1.5 and roof["bound_tok_s"] > 0
        assert roof["achieved_over_bound"] > 0 and 0 < roof["bound_tok_s_end"] <= roof["bound_tok_s"] * 1.5
    full, dkv = runs["full", 64], runs["vase_dkv", 64]
    assert full["evict_ms"] is None and full["evictions"] == 0 and full["evict_overhead"] == 0
    _check_stat(dkv["evict_ms"], repeats=5)
    assert dkv["evictions"] > 0 and dkv["evict_overhead"] > 0


def test_smoke_schedule_and_cache_bytes(smoke):
    """The replayed schedule (events, final length) equals what generate reports, and the cache bytes equal
    the layout's formula: 16 tokens (left-padded to the 64 bucket; the cache holds no padding), N=32, B=8, 64 new
    tokens."""
    result, _ = smoke
    cfg = TINY_1K
    for r in result["runs"]:
        assert r["evictions"] == r["evictions_expected"]
        assert r["cache_length_end"] == r["cache_length_expected"]
        per_slot = cfg.num_layers * 2 * cfg.num_kv_heads * (2 * cfg.head_dim * 4 + 4)  # batch 2, k+v f32, pos
        # + row_pos, length, seen, evictions, prompt_length ([batch] int32) and active ([batch] bool)
        assert r["cache_bytes"] == r["capacity"] * per_slot + 5 * 2 * 4 + 2
    runs = {r["method"]: r for r in result["runs"]}
    align = getattr(framework, "CAPACITY_ALIGN", 1)
    for method, slots in (("full", 64 + 64), ("vase_dkv", max(64, 32) + 8)):
        # full: bucket + new tokens; eviction: max(bucket, budget) + buffer; rounded up to `align`
        assert runs[method]["capacity"] == -(-slots // align) * align
    # 63 steps: the first event when 40 real tokens are held (step 24), then one every 8 steps: 5 events
    assert runs["vase_dkv"]["evictions"] == 5 and runs["full"]["cache_length_end"] == 16 + 63


@pytest.mark.parametrize("args, needle", [
    (["--methods", "full,nope"], "--methods"),
    (["--methods", "vase_dkv", "--budgets", "100", "--buffer", "64"], "budget=100"),
    (["--output-lens", "64,0"], "--output-lens"),
    (["--output-lens", "6x"], "--output-lens"),
    (["--repeats", "2"], "--repeats: '2': must be >= 3"),
    (["--batch", "0"], "--batch: '0': must be >= 1"),
    (["--prefill-chunk", "8"], "--prefill-chunk"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--model", "tiny-1k", "--layers", "0"], "--layers=0"),
    (["--model", "/no/such/folder", "--layers", "2"], "apply to named random models"),
    (["--workload", "aime25", "--seconds", "0"], "--seconds: '0': must be > 0"),
    (["--workload", "aime25", "--kv-bits", "K8V8"], "not allowed with"),
    (["--budgets", "512,0"], "--budgets: '512,0': must be >= 1"),
    (["--workload", "aime25", "--scale", "tiny", "--prompt-len", "300"], "--prompt-len=300"),
    (["--scale", "tiny"], "--scale applies to --workload aime25"),
    (["--kv-bits", "K8V8,K3V3"], "--kv-bits: key_bits=3"),
    (["--micro", "--workload", "aime25"], "--micro is the decode mode's"),
])
def test_bad_input_is_one_line_error_before_any_work(args, needle, capsys):
    try:
        code = bench.main(["--model", "tiny-1k", *args] if "--model" not in args else args)
    except SystemExit as e:  # argparse errors
        code = e.code
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench.py: error:") and needle in lines[0], captured.err
    assert captured.out == ""  # nothing measured or compiled


def _param_count(cfg: vj.Qwen3Config) -> tuple[int, int]:
    """(all parameters, embedding table) of a Qwen3 from its config."""
    e, f, d, hq, hkv = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    layer = 2 * e + e * hq * d + 2 * e * hkv * d + hq * d * e + 2 * d + 3 * e * f
    embed = cfg.vocab_size * e
    return cfg.num_layers * layer + embed + e + (0 if cfg.tie_word_embeddings else embed), embed


@pytest.mark.parametrize("cfg", [TINY_1K, shrink(SMALL, layers=1)], ids=["untied", "tied"])
def test_weight_bytes(cfg):
    model = vj.Qwen3(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))
    total, embed = _param_count(cfg)
    assert ds.param_bytes(model) == 4 * total
    # an untied table is read one row per token; a tied one is the LM head, read whole
    assert ds.weight_bytes_per_step(model) == 4 * (total - (0 if cfg.tie_word_embeddings else embed))


def test_roofline_sums_the_schedule():
    """A row's replayed cache (`row_replay`), and the bytes over a run: weights every step + the live slots each
    step attends + 2x (N + B) slots per event."""
    model = vj.Qwen3(TINY_1K, dtype=jnp.float32, rngs=nnx.Rngs(0))
    ev = vj.EvictionConfig("vase_dkv", budget=32, buffer=8)
    reads, after, triggers = ds.row_replay(ev, 16, 49)
    # length after each step: 17..40 -> evict at 40 (> 32, % 8 == 0), then 33..40 -> evict, ...
    lengths, length, events = [], 16, 0
    for _ in range(49):
        lengths.append(length + 1)
        length += 1
        if length == 40:
            length, events = 32, events + 1
    assert reads.tolist() == lengths and len(triggers) == events == 4 and after[-1] == 33
    assert triggers.tolist() == [24, 32, 40, 48]  # the steps after which the row is evicted
    per_slot = 1 * 2 * 2 * (2 * 32 * 4 + 4)  # batch 1, 2 layers, 2 kv heads
    w = ds.weight_bytes_per_step(model)
    roof = ds.roofline(model, ev, reads, len(triggers), batch=1, itemsize=4)
    total = 49 * w + sum(lengths) * per_slot + events * 2 * 40 * per_slot
    assert roof["bytes_step_start"] == w + 17 * per_slot and roof["bytes_step_end"] == w + lengths[-1] * per_slot
    assert math.isclose(roof["bytes_step_mean"], total / 49) and roof["bytes_per_eviction"] == 2 * 40 * per_slot


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_filled_cache_is_init_cache_filled_and_donatable(dtype):
    """The same structure, dtypes and storage (bits for bf16 on CPU) as `init_cache`; `length` slots filled, the
    policy state on them; every leaf its own buffer, so that the benchmark can donate the cache."""
    state = framework.slot_state(vj.EvictionConfig("h2o", budget=8, buffer=4))
    cache = ds.filled_cache(TINY_1K, 2, 16, 10, 4, dtype, 0, state)
    empty = init_cache(TINY_1K, 2, 16, 4, dtype, state)
    assert jax.tree.structure(cache) == jax.tree.structure(empty)
    for x, e in zip(jax.tree.leaves(cache), jax.tree.leaves(empty), strict=True):
        assert (x.shape, x.dtype) == (e.shape, e.dtype)
    assert cache.length.tolist() == cache.seen.tolist() == cache.row_pos.tolist() == [10, 10]
    assert (np.asarray(cache.pos[..., :10]) == np.arange(10)).all() and (np.asarray(cache.pos[..., 10:]) == -1).all()
    mass = np.asarray(cache.state["attention_mass"])
    assert (mass[..., 10:] == 0).all() and (mass[..., :10] > 0).all()
    buffers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(cache)]
    assert len(set(buffers)) == len(buffers)
    jax.block_until_ready(jax.jit(lambda c: jax.tree.map(lambda x: x + 0, c), donate_argnums=0)(cache))


def test_stat_and_decode_rate():
    s = Stat.of([3.0, 1.0, 2.0])
    assert (s.median, s.min, s.max) == (2.0, 1.0, 3.0)
    rate = decode_rate(Stat.of([1.5, 2.0, 3.0]), Stat.of([0.5, 0.5, 0.6]), 100)
    assert rate.runs == (100.0, 100 / 1.5, 40.0) and rate.min == 40.0 and rate.max == 100.0
    assert decode_rate(Stat.of([0.4, 2.0, 3.0]), Stat.of([0.5] * 3), 100) is None
    # the fastest prefill is subtracted: one slow prefill sample (a busy machine) does not cancel the figures
    noisy = decode_rate(Stat.of([1.0, 1.1, 1.2]), Stat.of([0.2, 0.3, 5.0]), 80)
    assert noisy is not None and np.allclose(noisy.runs, (100.0, 80 / 0.9, 80.0))


@pytest.mark.slow
def test_kv_bits_rows(tmp_path):
    """--kv-bits: a row per (method, setting, protection) with the cache's bytes, the program's, decode tokens/s
    and the agreement with the 16-bit cache's tokens; the 16-bit row first, with the step and eviction figures.
    No timing assertions."""
    # one method (3 programs, not 6): `full`'s default protection, a quarter of the cache, is checked by
    # tests/test_tiers.py::test_a_quarter_protected_k4v4_cache_is_half_the_16_bit_cache without compiling
    args = ["--model", "tiny-1k", "--batch", "2", "--prompt-len", "16", "--output-lens", "24", "--methods",
            "vase_attnv", "--budgets", "16", "--buffer", "8", "--kv-bits", "K8V8", "--micro-steps", "2",
            "--bandwidth-mib", "16", "--out", str(tmp_path)]
    res = _bench(args)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [(r["method"], r["kv_bits"], r["protected"]) for r in rows] == [
        ("vase_attnv", "K16V16", None), ("vase_attnv", "K8V8", 4), ("vase_attnv", "K8V8", 0)]  # Nv = N / 4
    for r in rows:
        _check_stat(r["decode_tok_s"])
        assert r["cache_bytes"] > 0 and r["program_bytes"] > 0 and r["x_bf16_decode"] > 0
        assert 0 <= r["tokens_agree_with_bf16"] <= 1
        # head_dim 32 in float32: 2 x 32 x 4 bytes; K8V8 with one group per head: 2 x (32 codes + 2 x 4 bytes)
        assert r["token_bytes"] == (256 if r["kv_bits"] == "K16V16" else 80)
        assert r["x_bf16_cache"] == r["cache_bytes"] / rows[0]["cache_bytes"]
    assert rows[0]["tokens_agree_with_bf16"] == 1 and rows[0]["x_bf16_decode"] == 1
    # the quantized tier: a smaller cache; without protection not larger (the tiers' alignment may even them out)
    assert rows[2]["cache_bytes"] <= rows[1]["cache_bytes"] < rows[0]["cache_bytes"]
    assert rows[0]["evict_ms"]["median"] > 0 and "step_ms_end" not in rows[1]  # the pieces: the 16-bit cache's
    text = (tmp_path / "results.md").read_text()
    assert "| tokens = bf16 |" in text and "| vase_attnv@16 K8V8 P=0 | 24 |" in text


# ---- the AIME25 workload ----------------------------------------------------------------------------------------
def test_lognormal_lengths():
    a = wl.lognormal_lengths(4000, median=1000, sigma=0.5, cap=3000, seed=1)
    assert a.dtype == np.int32 and a.min() >= 2 and a.max() == 3000
    assert abs(np.median(a) / 1000 - 1) < 0.05 and 0.01 < (a == 3000).mean() < 0.03  # P(z > ln 3 / 0.5) = 1.4%
    assert (wl.lognormal_lengths(50, median=1000, sigma=0.5, cap=3000, seed=1) == a[:50]).all()
    protocol = wl.lognormal_lengths(480, median=12000, sigma=0.5, cap=32768 - 256, seed=0)
    assert 5.8e6 < protocol.sum() < 7e6  # the issue's ~6M tokens per method
    with pytest.raises(ValueError, match="cap=1"):
        wl.lognormal_lengths(3, median=10, sigma=0.5, cap=1)


def test_simulated_lockstep_schedule():
    """R samples of L tokens on R rows: one round, L - 1 steps; every step reads the rows' common length; the
    events are the row's triggers (first when P + k > N and P + k = 0 mod B)."""
    ev = vj.EvictionConfig("vase_dkv", budget=32, buffer=8)
    reads, after, triggers = ds.row_replay(ev, 16, 59)
    assert triggers.tolist() == [24, 32, 40, 48, 56]
    s = wl.simulate_engine([60] * 3, 3, ev, 16)
    assert (s.rounds, s.steps, s.events, s.useful_row_steps) == (1, 59, 5, 177) and s.utilization == 1.0
    assert s.own_slot_reads == s.longest_slot_reads == 3 * int(reads.sum())
    full = wl.simulate_engine([5, 3], 2, vj.EvictionConfig("full"), 10)
    # row 0 reads 11, 12, 13, 14; row 1 reads 11, 12, then nothing (ended: inactive, its length 0 to the attention)
    assert (full.steps, full.utilization) == (4, 6 / 8)
    assert full.own_slot_reads == (11 + 12 + 13 + 14) + (11 + 12)
    assert full.longest_slot_reads == 2 * (11 + 12 + 13 + 14)
    assert full.slot_reads("own") == full.own_slot_reads and full.slot_reads("longest") == full.longest_slot_reads
    assert wl.attention_reads("cuda", "auto") == "own" and wl.attention_reads("cpu", "auto") == "longest"


def test_simulated_refills_wait_for_the_ticks():
    """Eviction: a sample admitted at step t starts at the next multiple of B; 2 rows, queue 1: a round per
    sample, and a free row with nothing staged ends the round."""
    ev = vj.EvictionConfig("vase_dkv", budget=32, buffer=8)
    s = wl.simulate_engine([4, 11, 3], 2, ev, 16, queue=1)
    # round 1: sample 0 (3 steps) on row 0 at step 0; row 1 free, more waiting -> back to the host at once.
    # round 2: sample 1 (10 steps) on row 1, waits to step 0 (0 % 8): ends at 10; sample 0 ends at 3 -> round ends.
    # round 3: sample 2 (2 steps) on row 0 at step 3 waits to step 8, ends at 10; the drain ends at 10.
    assert (s.rounds, s.steps, s.useful_row_steps) == (3, 10, 15)


def test_fit_step_model_recovers_the_seconds():
    """`full`: (steps, slot_reads) determine the seconds; eviction: past the first eviction a lockstep run's
    slot_reads is a combination of its steps and events, so the fit is one of many that reproduce the runs and
    predict a longer one."""
    truth = wl.StepModel(round_s=0.5, step_s=2e-3, slot_s=1e-6, event_s=4e-3)
    full = vj.EvictionConfig("full")
    windows = [(s, truth.seconds(s)) for s in (wl.simulate_engine([n] * 4, 4, full, 16) for n in (32, 64, 128))]
    fit = wl.fit_step_model(0.5, windows)
    assert np.allclose([fit.step_s, fit.slot_s, fit.event_s], [2e-3, 1e-6, 0.0], rtol=1e-6)
    ev = vj.EvictionConfig("vase_dkv", budget=32, buffer=8)
    windows = [(s, truth.seconds(s)) for s in (wl.simulate_engine([n] * 4, 4, ev, 16) for n in (32, 64, 128, 256))]
    fit = wl.fit_step_model(0.5, windows)
    longer = wl.simulate_engine([1024] * 4, 4, ev, 16)
    assert min(fit.step_s, fit.slot_s, fit.event_s) >= 0
    assert np.isclose(fit.seconds(longer), truth.seconds(longer), rtol=1e-6)
    # a slot term that would come out negative is left out (non-negative least squares)
    flat = [(s, 0.5 + 1e-3 * s.steps - 1e-9 * s.own_slot_reads) for s, _ in windows]
    fit = wl.fit_step_model(0.5, flat)
    assert fit.slot_s == 0 and fit.step_s > 0


def test_simulator_matches_the_engine():
    """`simulate_engine` against `batching.run` on the tiny model: steps, events, rounds and useful row-steps, with
    a queue smaller than the rows, and a lone row (beside its idle companion on CPU)."""
    from vase_jax import batching

    model = vj.Qwen3(TINY_1K, dtype=jnp.float32, rngs=nnx.Rngs(0))
    lengths = wl.lognormal_lengths(9, median=30, sigma=0.6, cap=80, seed=3)
    rng = np.random.default_rng(0)
    prompts = [tuple(int(x) for x in rng.integers(0, 1024, 16)) for _ in lengths]
    config = vj.GenerateConfig(max_new_tokens=80, eos_token_ids=())
    ev = vj.EvictionConfig("vase_dkv", budget=32, buffer=8)
    for rows, queue in ((3, 2), (1, None)):
        reqs = [batching.Request(p, jax.random.key(i), i, int(n))
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
        stats = batching.EngineStats()
        batching.run(model, reqs, rows=rows, config=config, eviction=ev, stats=stats, queue=queue)
        sim = wl.simulate_engine(lengths, rows, ev, 16, queue)
        assert (sim.steps, sim.events, sim.rounds, sim.useful_row_steps) == (
            stats.steps, stats.events, stats.segments, stats.useful_row_steps), (rows, queue)


def test_aime25_workload_tiny(tmp_path):
    """--workload aime25 --scale tiny: the whole path (compile, round, windows, check, projection) in seconds; the
    simulated schedules equal the engine's, the projection covers the drawn lengths. No timing assertions."""
    # a deadline already past: each method still measures, for the 1 s floor instead of --seconds
    args = ["--workload", "aime25", "--scale", "tiny", "--methods", "vase_dkv,full", "--seconds", "2", "--out",
            str(tmp_path), "--deadline", str(time.time() - 100)]
    res = _bench(args)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    lengths = wl.lognormal_lengths(24, median=96, sigma=0.5, cap=240, seed=0)
    assert result["meta"]["lengths"]["tokens"] == int(lengths.sum())
    assert [r["label"] for r in result["methods"]] == ["vase_dkv@32", "full"]
    for r in result["methods"]:
        assert r["rows"] == 6 and r["schedules_match_engine"] and r["steady"] and r["seconds"] == 1.0
        p, c = r["protocol"], r["check"]
        assert p["tokens"] == int(lengths.sum()) and p["samples"] == 24 and 0 < p["utilization"] <= 1
        assert p["seconds"] > 0 and p["tok_s"] > 0 and p["rounds"] == 4
        assert c["steps"] == c["engine_steps"] and c["events"] == c["engine_events"] and c["seconds"] > 0
        assert c["samples"] == 18 and 0 < c["scale"] <= 1  # the first 3 x rows drawn samples, scaled to the time left
        assert len(r["windows"]) >= 2 and all(w["seconds"] > 0 for w in r["windows"])
        m = r["model"]
        assert m["round_s"] > 0 and min(m["step_s"], m["slot_s"], m["event_s"]) >= 0
        assert r["peak_bytes"] > 0
        assert m["reads"] == p["reads"] == result["meta"]["attention_reads"] == "longest"  # the XLA path on CPU
        expected = wl.StepModel(**m).seconds(wl.simulate_engine(lengths, 6, vj.EvictionConfig(
            r["method"], budget=32, buffer=8) if r["budget"] else vj.EvictionConfig("full"), 16))
        assert np.isclose(p["seconds"], expected) and p["seconds_if_own"] > 0
    text = (tmp_path / "results.md").read_text()
    assert "| method | rows |" in text and "T = rounds * round_s" in text
