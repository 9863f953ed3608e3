"""scripts/eval.py and vase_jax.evaluation: the evaluation protocol end to end, resuming, records, summaries.

The subprocess runs share a persistent JAX compilation cache (module tmp dir), so only the first run of each
program shape compiles. The tiny checkpoint has init std 1.0: its next-token distribution is peaked, which
keeps top-p sampling on its fast path (a flat distribution over 151936 tokens sorts the vocabulary each step).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "eval.py"

PROBLEMS = [  # gsm8k format; prompts of 24-34 tokens: one prompt bucket (64), so one program per method
    {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "Tom has 5 apples and eats 2 of them. How many apples are left?", "answer": "#### 3"},
    {"question": "A box holds 6 eggs. How many eggs are in 4 boxes?", "answer": "#### 24"},
]
VARIANTS = [("full", None), ("vase_attnv", 32)]
SAMPLES = 2
TOTAL_TOKENS = 80  # prompt + output cap: outputs are cut at 80 - prompt tokens (the total-cap mode)


def _load_script():
    from conftest import load_script

    return load_script("eval")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from conftest import save_tiny_checkpoint

    root = tmp_path_factory.mktemp("eval")
    # the shapes of --random-model tiny (max_position_embeddings too), so both share compiled programs
    model, _ = save_tiny_checkpoint(root / "model", seed=5, init_std=1.0, max_position_embeddings=40960)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(root / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return {"root": root, "model": str(model), "data": str(data), "env": env}


def _args(work, out) -> list[str]:
    return ["--model", work["model"], "--task", "gsm8k", "--data", work["data"],
            "--methods", "full,vase_attnv", "--budgets", "32", "--buffer", "8", "--samples", str(SAMPLES),
            "--batch-size", "2", "--max-total-tokens", str(TOTAL_TOKENS), "--dtype", "float32", "--save-text",
            "--out", str(out)]


def _run(work, args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=work["env"], cwd=work["root"], timeout=600, **kw)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def _by_key(records: list[dict]) -> dict:
    return {(r["problem_id"], r["sample"], r["method"], r["budget"]): r for r in records}


def _result_numbers(summary: dict) -> list[dict]:
    """Everything in the results but tokens/s (wall-clock)."""
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in summary["results"]]


@pytest.fixture(scope="module")
def full_run(work):
    """An uninterrupted run: 3 problems x 2 samples x (full, vase_attnv@32)."""
    out = work["root"] / "run_a"
    res = _run(work, _args(work, out))
    assert res.returncode == 0, res.stderr[-3000:]
    return out, res


# ---- end to end --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_end_to_end_records_summary_and_plots(work, full_run):
    from vase_jax.tasks import extract_answer, grade, load_problems

    out, res = full_run
    records = _records(out)
    keys = _by_key(records)
    assert len(records) == len(keys) == len(PROBLEMS) * SAMPLES * len(VARIANTS)
    assert set(keys) == {(str(p), s, m, b) for p in range(len(PROBLEMS)) for s in range(SAMPLES)
                         for m, b in VARIANTS}
    problems = {p.id: p for p in load_problems("gsm8k", work["data"])}
    for r in records:
        assert 16 <= r["prompt_tokens"] <= 64
        assert r["max_tokens"] == TOTAL_TOKENS - r["prompt_tokens"]  # the exact total cap
        assert 1 <= r["tokens"] <= r["max_tokens"]
        assert r["truncated"] == (not r["finished"])
        assert r["answer"] == extract_answer(r["text"], "gsm8k")
        assert r["correct"] == grade(r["text"], problems[r["problem_id"]])
        assert r["gold"] == problems[r["problem_id"]].answer
        assert (r["evictions"] > 0) == (r["method"] == "vase_attnv")  # eviction really happens

    # summary.json equals an independent recomputation from the records
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] and summary["missing_samples"] == 0
    for row in summary["results"]:
        recs = [r for r in records if (r["method"], r["budget"]) == (row["method"], row["budget"])]
        acc = np.array([np.mean([r["correct"] for r in recs if r["problem_id"] == str(p)])
                        for p in range(len(PROBLEMS))])
        assert row["samples"] == len(recs) == len(PROBLEMS) * SAMPLES and row["problems"] == len(PROBLEMS)
        assert row["pass_at_1"] == pytest.approx(acc.mean())
        assert row["se"] == pytest.approx(acc.std(ddof=1) / math.sqrt(len(acc)))
        assert row["mean_tokens"] == pytest.approx(np.mean([r["tokens"] for r in recs]))
        assert row["truncation_rate"] == pytest.approx(np.mean([r["truncated"] for r in recs]))
        tps = sum(r["tokens"] for r in recs) / sum(r["seconds"] for r in recs)
        assert row["tokens_per_s"] == pytest.approx(tps, rel=1e-6)
    md = (out / "summary.md").read_text()
    assert "| vase_attnv | 32 |" in md and "| full | - |" in md
    for name in ("accuracy_vs_budget.png", "output_lengths.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "config.json").read_text())
    assert config["temperature"] == 0.6 and config["top_p"] == 0.95 and config["top_k"] == 0
    assert config["max_total_tokens"] == TOTAL_TOKENS and config["max_new_tokens"] is None
    assert "gsm8k" in res.stdout and "Traceback" not in res.stderr

    # a rerun of a finished run generates nothing (and loads no model) and writes the same summary
    before = (out / "records.jsonl").read_bytes()
    again = _run(work, _args(work, out))
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "records.jsonl").read_bytes() == before
    assert json.loads((out / "summary.json").read_text()) == summary


@pytest.mark.slow
def test_kill_and_resume_matches_uninterrupted_run(work, full_run):
    """SIGKILL once the first batch is on disk, cut the last line in half, rerun: same records and summary."""
    ref_out, _ = full_run
    out = work["root"] / "run_b"
    records_file = out / "records.jsonl"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *_args(work, out)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=work["env"], cwd=work["root"])
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if records_file.exists() and records_file.read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL  # it was still running: killed, not finished
    raw = records_file.read_bytes()
    total = len(PROBLEMS) * SAMPLES * len(VARIANTS)
    assert 1 <= raw.count(b"\n") < total
    if raw.endswith(b"\n"):  # simulate a write cut short: keep half of the last line, no newline
        lines = raw.splitlines(keepends=True)
        raw = b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2]
        records_file.write_bytes(raw)
    complete_before = raw.count(b"\n")

    res = _run(work, _args(work, out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "incomplete last line" in res.stderr
    records = _records(out)
    assert len(records) == len(_by_key(records)) == total  # nothing lost, nothing twice
    assert len(records) > complete_before
    ref = _by_key(_records(ref_out))
    fields = ("tokens", "answer", "correct", "finished", "text", "prompt_tokens", "evictions")
    for key, rec in _by_key(records).items():
        assert {f: rec[f] for f in fields} == {f: ref[key][f] for f in fields}, key
    got = json.loads((out / "summary.json").read_text())
    want = json.loads((ref_out / "summary.json").read_text())
    assert _result_numbers(got) == _result_numbers(want)


@pytest.mark.slow
@pytest.mark.parametrize("scheduler, batch_size", [("static", "2"), ("continuous", "auto")])
def test_same_records_under_both_schedulers_and_any_batch_size(work, full_run, scheduler, batch_size):
    """The reference run is continuous on 2 rows (problems mixed); the static scheduler (a problem's samples per
    generate call) and the continuous rows `auto` plans (here 6: all the samples of a variant, the host's memory
    being ample) give every sample the same tokens, text, grade and eviction count."""
    out = work["root"] / f"run_{scheduler}_{batch_size}"
    args = _args(work, out)
    args[args.index("--batch-size") + 1] = batch_size
    res = _run(work, [*args, "--scheduler", scheduler])
    assert res.returncode == 0, res.stderr[-3000:]
    ref = _by_key(_records(full_run[0]))
    records = _by_key(_records(out))
    assert set(records) == set(ref)
    fields = ("tokens", "answer", "correct", "finished", "text", "prompt_tokens", "evictions", "max_tokens")
    for key, rec in records.items():
        assert {f: rec[f] for f in fields} == {f: ref[key][f] for f in fields}, key
    assert json.loads((out / "config.json").read_text())["scheduler"] == scheduler
    if batch_size == "auto":  # each variant's rows and the planner's reason, said once
        said = re.findall(r"--batch-size auto, (\S+): (\d+) rows \(capped at 6 rows", res.stderr)  # beside the bar
        assert said == [("full", "6"), ("vase_attnv@32", "6")], res.stderr[-2000:]


@pytest.mark.slow
def test_mixed_precision_cache_variants(work, full_run):
    """--kv-bits bf16,K8V4: every (method, budget) runs with each cache setting; the bf16 records are the 16-bit
    run's (the same program), the K8V4 ones carry their setting, and the summary keeps them apart."""
    out = work["root"] / "run_kv"
    args = _args(work, out)
    args[args.index("--methods") + 1] = "vase_attnv"
    res = _run(work, [*args, "--kv-bits", "bf16,K8V4"])
    assert res.returncode == 0, res.stderr[-3000:]
    records = _records(out)
    ref = _by_key(_records(full_run[0]))
    bf16 = [r for r in records if r["kv_bits"] == "K16V16"]
    quantized = [r for r in records if r["kv_bits"] == "K8V4"]
    assert len(bf16) == len(quantized) == len(PROBLEMS) * SAMPLES
    for r in bf16:
        assert r["text"] == ref[(r["problem_id"], r["sample"], r["method"], r["budget"])]["text"]
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["method"], r["budget"], r["kv_bits"], r["samples"]) for r in summary["results"]] == [
        ("vase_attnv", 32, "K16V16", 6), ("vase_attnv", 32, "K8V4", 6)]
    assert "| vase_attnv K8V4 |" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_random_model_smoke_run(work, full_run):
    """The README's offline smoke run (--random-model tiny: a random model built in memory) works. Same shapes
    and caps as the runs above (so no new compile), packaged data replaced by the 3 short problems."""
    out = work["root"] / "smoke"
    args = _args(work, out)
    args[:2] = ["--random-model", "tiny"]
    res = _run(work, args)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "random:tiny" and summary["complete"]
    assert [(r["method"], r["budget"], r["samples"]) for r in summary["results"]] == [
        ("full", None, 6), ("vase_attnv", 32, 6)]
    records = _records(out)
    assert all(r["tokens"] == TOTAL_TOKENS - r["prompt_tokens"] for r in records)  # never ends: cut at the cap
    ref = _by_key(_records(full_run[0]))  # a different model: different tokens
    assert any(r["text"] != ref[k]["text"] for k, r in _by_key(records).items())


# ---- bad input ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "malformed.jsonl").write_text(json.dumps(PROBLEMS[0]) + "\n{not json\n")
    (root / "no_weights").mkdir()
    (root / "no_weights" / "config.json").write_text("{}")
    return root


BASE = ["--random-model", "tiny", "--task", "gsm8k", "--limit", "2"]
BAD_CASES = {
    "unknown task": (["--random-model", "tiny", "--task", "nope"], "task='nope' is not known"),
    "missing data file": (BASE + ["--data", "{root}/missing.jsonl"], "is not an existing file"),
    "gpqa without data": (["--random-model", "tiny", "--task", "gpqa"], "pass --data"),
    "malformed line": (BASE + ["--data", "{root}/malformed.jsonl"], "malformed.jsonl:2: invalid JSON"),
    "budget % buffer": (BASE + ["--methods", "rkv", "--budgets", "100", "--buffer", "64"],
                        "multiple of buffer"),
    "unknown method": (BASE + ["--methods", "full,nope"], "'nope' is not a known method"),
    "misspelt method": (BASE + ["--methods", "full,vase_dvk"], "did you mean 'vase_dkv'?"),
    "misspelt task": (["--random-model", "tiny", "--task", "gsm8"], "did you mean 'gsm8k'?"),
    "task needed with a model": (["--random-model", "tiny"], "--task is required with --model"),
    "no weights": (["--model", "{root}/no_weights", "--task", "gsm8k"], "has no weights"),
    "not a model": (["--model", "./nowhere", "--task", "gsm8k"], "not an existing folder"),
    "budget not int": (BASE + ["--budgets", "512,abc"], "--budgets"),
    "zero samples": (BASE + ["--samples", "0"], "--samples=0 must be an integer >= 1"),
    "bad top-p": (BASE + ["--top-p", "1.5"], "top_p=1.5"),
    "zero batch size": (BASE + ["--batch-size", "0"], "--batch-size=0 must be an integer >= 1"),
    "batch size word": (BASE + ["--batch-size", "lots"], "'lots' is neither an integer nor 'auto'"),
    "auto static": (BASE + ["--batch-size", "auto", "--scheduler", "static"],
                    "--batch-size auto sizes the continuous engine's batch"),
    "kv bits": (BASE + ["--kv-bits", "bf16,K3V3"], "--kv-bits: key_bits=3"),
    "kv bits keys below values": (BASE + ["--kv-bits", "K4V8"], "key_bits=4 < value_bits=8"),
    "kv protected with snapkv": (BASE + ["--methods", "snapkv", "--kv-bits", "K8V8", "--kv-protected", "4"],
                                 "--kv-protected=4 with method 'snapkv'"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_one_line_error(case, bad_files, capsys):
    args, expected = BAD_CASES[case]
    args = [a.replace("{root}", str(bad_files)) for a in args]
    script = _load_script()
    try:
        rc = script.main([*args, "--out", str(bad_files / "out")])
    except SystemExit as e:  # argparse errors exit
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("eval.py: error:"), err
    assert expected in lines[0]
    assert not (bad_files / "out" / "config.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unknown task", "no weights", "malformed line"])
def test_bad_input_subprocess(case, bad_files, work):
    args, expected = BAD_CASES[case]
    res = _run(work, [a.replace("{root}", str(bad_files)) for a in args])
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], res.stderr


def test_continuous_rows_at_most_the_samples_left():
    """The continuous engine runs `--batch-size` rows, or fewer where fewer samples are left to run: a row with
    no sample would only cost its steps (and a record's seconds are its share of the rows' wall time)."""
    from vase_jax import evaluation as ev
    from vase_jax.evaluation.continuous import batch_rows

    cfg, _ = ev.resolve(model="random:tiny", task="gsm8k", limit=2, batch_size=8)
    assert [batch_rows(None, cfg, None, None, 16, samples) for samples in (1, 3, 8, 20)] == [1, 3, 8, 8]


def test_resume_refuses_changed_settings(tmp_path, capsys):
    from vase_jax import evaluation as ev

    cfg, _ = ev.resolve(model="random:tiny", task="gsm8k", limit=2)
    ev.write_config(cfg, tmp_path)
    # a folder whose run stopped before its first record binds nothing: another model may take it
    assert ev.check_resume(ev.resolve(model="random:tiny", task="gsm8k", limit=2, temperature=0.7)[0],
                           tmp_path) is None
    (tmp_path / "records.jsonl").write_text('{"problem_id": "0"}\n')
    script = _load_script()
    rc = script.main(["--random-model", "tiny", "--task", "gsm8k", "--limit", "2", "--temperature", "0.7",
                      "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert "temperature=0.6" in err and "temperature=0.7" in err
    # settings that only select records (methods, budgets, samples, limit) may change
    assert ev.check_resume(ev.resolve(model="random:tiny", task="gsm8k", limit=1, methods=("rkv",),
                                      budgets=(256,), samples=4, batch_size=4)[0], tmp_path) is None
    with pytest.raises(ValueError, match="batch_size"):
        ev.check_resume(ev.resolve(model="random:tiny", task="gsm8k", limit=2, samples=8)[0], tmp_path)


def test_prompt_settings_reach_the_run_and_bind_its_folder(tmp_path):
    """--compress-prompt and --prefill-chunk reach every evicting method's `EvictionConfig` and the
    `GenerateConfig`; a folder written before they existed ran the dense prefill with the prompt kept, and resumes
    only under those settings; bad values are refused before any model loads."""
    import json as json_

    from vase_jax import evaluation as ev

    cfg, _ = ev.resolve(model="random:tiny", task="gsm8k", limit=1, methods=("full", "vase_dkv"),
                        compress_prompt=True, prefill_chunk=64)
    assert cfg.eviction("vase_dkv", 256).compress_prompt and not cfg.eviction("full", None).compress_prompt
    assert cfg.generate_config(16).prefill_chunk == 64
    old, _ = ev.resolve(model="random:tiny", task="gsm8k", limit=1, prefill_chunk=None)
    ev.write_config(old, tmp_path)
    saved = json_.loads((tmp_path / "config.json").read_text())
    for name in ("compress_prompt", "prefill_chunk"):
        saved.pop(name)
    (tmp_path / "config.json").write_text(json_.dumps(saved))
    (tmp_path / "records.jsonl").write_text('{"problem_id": "0"}\n')
    assert ev.check_resume(old, tmp_path) is None
    with pytest.raises(ValueError, match="prefill_chunk=None, now prefill_chunk=256"):
        ev.check_resume(ev.resolve(model="random:tiny", task="gsm8k", limit=1)[0], tmp_path)
    with pytest.raises(ValueError, match="compress_prompt=False, now compress_prompt=True"):
        ev.check_resume(ev.resolve(model="random:tiny", task="gsm8k", limit=1, prefill_chunk=None,
                                   compress_prompt=True)[0], tmp_path)
    with pytest.raises(ValueError, match=r"--prefill-chunk=8; allowed: 0 \(the dense prefill\) or an int >= 16"):
        ev.resolve(model="random:tiny", task="gsm8k", prefill_chunk=8)
    with pytest.raises(ValueError, match="--compress-prompt runs on the 16-bit cache"):
        ev.resolve(model="random:tiny", task="gsm8k", methods=("vase_dkv",), compress_prompt=True,
                   kv_bits=("K4V4",))


# ---- library pieces ----------------------------------------------------------------------------------------
def test_record_store_repairs_a_cut_last_line(tmp_path):
    from vase_jax.evaluation import RecordStore

    recs = [{"problem_id": "0", "sample": s, "method": "full", "budget": None, "correct": True}
            for s in range(3)]
    lines = [json.dumps(r) + "\n" for r in recs]
    path = tmp_path / "records.jsonl"
    warnings: list[str] = []

    path.write_text(lines[0] + lines[1] + lines[2][:20])  # killed mid-write
    store = RecordStore(path, warn=warnings.append)
    assert set(store.records) == {("0", 0, "full", None, "K16V16"), ("0", 1, "full", None, "K16V16")}
    assert path.read_text() == lines[0] + lines[1]  # the cut line is gone from disk too
    assert len(warnings) == 1 and "incomplete last line" in warnings[0]
    store.append(recs[2:])
    assert RecordStore(path).records == store.records and len(store) == 3

    path.write_text(lines[0] + "{garbled}\n")  # an unparsable complete last line: redone as well
    assert set(RecordStore(path, warn=warnings.append).records) == {("0", 0, "full", None, "K16V16")}
    assert path.read_text() == lines[0]

    path.write_text(lines[0] + "{garbled}\n" + lines[1])  # corruption elsewhere is never skipped
    with pytest.raises(ValueError, match=r"records.jsonl:2: corrupt record"):
        RecordStore(path)

    path.write_text(lines[0] + lines[0].replace("true", "false"))  # a duplicate: the first one counts
    store = RecordStore(path, warn=warnings.append)
    assert len(store) == 1 and store.records[("0", 0, "full", None, "K16V16")]["correct"] is True


def test_summary_matches_numpy(tmp_path):
    from vase_jax import evaluation as ev

    cfg, problems = ev.resolve(model="random:tiny", task="math500", limit=5, samples=3,
                               methods=("full", "rkv"), budgets=(256, 512), buffer=64)
    rng = np.random.default_rng(0)
    store = ev.RecordStore(tmp_path / "records.jsonl")
    wanted = ev.wanted_keys(cfg, problems)
    store.append([{"problem_id": p, "sample": s, "method": m, "budget": b,
                   "correct": bool(rng.random() < 0.4), "tokens": int(rng.integers(1, 100)),
                   "truncated": bool(rng.random() < 0.3),
                   "seconds": float(rng.random())} for (p, s, m, b, _) in wanted[:-1]])  # one sample missing
    summary = ev.summarize(cfg, store, wanted)
    assert not summary["complete"] and summary["missing_samples"] == 1
    variants = [(r["method"], r["budget"]) for r in summary["results"]]
    assert variants == [("full", None), ("rkv", 256), ("rkv", 512)]
    for row in summary["results"]:
        recs = [store.records[k] for k in wanted if k[2:4] == (row["method"], row["budget"]) and k in store]
        per_problem = {}
        for r in recs:
            per_problem.setdefault(r["problem_id"], []).append(r["correct"])
        acc = np.array([np.mean(v) for v in per_problem.values()])
        assert row["pass_at_1"] == pytest.approx(acc.mean())
        assert row["se"] == pytest.approx(np.std(acc, ddof=1) / np.sqrt(len(acc)))
        assert row["truncation_rate"] == pytest.approx(np.mean([r["truncated"] for r in recs]))
        tps = sum(r["tokens"] for r in recs) / sum(r["seconds"] for r in recs)
        assert row["tokens_per_s"] == pytest.approx(tps)
    md = ev.markdown(summary)
    assert "Incomplete: 1 samples missing" in md
    assert f"{100 * summary['results'][1]['pass_at_1']:.2f}" in md


def test_plan_covers_every_sample_once_with_fixed_batch_shape():
    from vase_jax import evaluation as ev

    cfg, problems = ev.resolve(model="random:tiny", task="aime25", limit=2, samples=5, batch_size=2,
                               methods=("full", "vase_dkv"), budgets=(512, 1024))
    chunks = ev.plan(cfg, problems)
    seen = [(c.problem.id, s, c.method, c.budget, c.kv_bits) for c in chunks for s in c.samples]
    assert sorted(seen, key=str) == sorted(ev.wanted_keys(cfg, problems), key=str)
    assert len(seen) == len(set(seen)) == 2 * 5 * 3  # full once, vase_dkv per budget
    assert [len(c.samples) for c in chunks[:3]] == [2, 2, 1] and cfg.rows == 2  # last chunk padded to 2 rows
    assert ev.resolve(model="random:tiny", task="aime25", limit=1, samples=4, batch_size=16)[0].rows == 4


def test_token_limits_cover_the_exact_cap_with_one_program_per_bucket():
    from vase_jax import evaluation as ev
    from vase_jax.generate import GenerateConfig

    for total in (4096, 32768):
        cfg, _ = ev.resolve(model="random:tiny", task="gsm8k", limit=1, max_total_tokens=total)
        by_bucket: dict[int, set] = {}
        exact_max: dict[int, int] = {}
        for n in range(1, 34000, 7):
            gen, exact = cfg.token_limits(n)
            assert exact == max(1, total - n)
            bucket = GenerateConfig().bucket(n)
            by_bucket.setdefault(bucket, set()).add(gen)
            exact_max[bucket] = max(exact_max.get(bucket, 0), exact)
            assert gen >= exact
        assert all(len(v) == 1 for v in by_bucket.values())  # max_new_tokens depends on the bucket only
        for bucket, (gen,) in by_bucket.items():  # and is tight: the largest exact cap in the bucket (+ <7)
            assert exact_max[bucket] <= gen < exact_max[bucket] + 7 or gen == 1
    fixed, _ = ev.resolve(model="random:tiny", task="gsm8k", limit=1, max_new_tokens=100)
    assert fixed.token_limits(10) == fixed.token_limits(3000) == (100, 100)


def test_problem_keys_are_stable_and_distinct():
    import jax

    from vase_jax import evaluation as ev

    digest = hashlib.sha256(b"gsm8k/17").digest()
    assert ev.stable_id("gsm8k", "17") == int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
    want = jax.random.key_data(jax.random.fold_in(jax.random.key(3), ev.stable_id("gsm8k", "17")))
    assert np.array_equal(jax.random.key_data(ev.problem_key(3, "gsm8k", "17")), want)
    datas = {tuple(np.asarray(jax.random.key_data(ev.problem_key(s, t, p))).tolist())
             for s in (0, 1) for t in ("gsm8k", "math500") for p in ("0", "1", "17")}
    assert len(datas) == 12


@pytest.mark.slow
def test_static_and_continuous_records_identical_in_bfloat16(work):
    """A batch-invariance failure reproduced, on a bf16 model with the Qwen3 tokenizer: the static scheduler (a
    problem's samples per generate call: batches of 2) and the continuous engine on 3 rows write the same tokens and
    text for every sample, with and without eviction
    (float32: `test_same_records_under_both_schedulers_and_any_batch_size`)."""
    runs = {}
    for scheduler, rows in (("static", "2"), ("continuous", "3")):
        out = work["root"] / f"bf16_{scheduler}"
        args = ["--random-model", "tiny", "--task", "gsm8k", "--data", work["data"], "--methods", "full,vase_attnv",
                "--budgets", "32", "--buffer", "8", "--samples", str(SAMPLES), "--batch-size", rows,
                "--max-total-tokens", "120", "--dtype", "bfloat16", "--save-text", "--scheduler", scheduler,
                "--out", str(out)]
        res = _run(work, args)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[scheduler] = _by_key(_records(out))
    assert set(runs["static"]) == set(runs["continuous"])
    assert len(runs["static"]) == len(PROBLEMS) * SAMPLES * len(VARIANTS)
    fields = ("tokens", "text", "finished", "evictions")
    for key, rec in runs["static"].items():
        assert {f: rec[f] for f in fields} == {f: runs["continuous"][key][f] for f in fields}, key
    assert any(r["evictions"] > 0 for r in runs["static"].values())
