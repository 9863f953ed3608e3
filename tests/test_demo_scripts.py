"""scripts/demo.py (one question) and scripts/compare_methods.py (the methods side by side), run in-process."""

from __future__ import annotations

import json
import re

import pytest
from conftest import load_script


def test_demo_answers_a_fresh_problem_with_the_packaged_model(capsys, monkeypatch):
    """No --model: the packaged model answers a fresh varchain problem greedily, stops at its own end token (not
    Qwen3's), and the last lines grade the answer against the task's gold."""
    from vase_jax.tasks import varchain

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_script("demo").main(["--seed", "0"]) == 0
    out = capsys.readouterr().out
    chain = varchain.problem(0, split="fresh")
    assert out.startswith(chain.question + "\n")
    assert f"gold {chain.answer}: right]" in out  # greedy, full cache: the trained model solves it
    assert "finished=True" in out and "0 evictions" in out


def test_demo_with_a_checkpoint_folder_and_eviction(capsys, tiny_untied):
    folder, _ = tiny_untied
    demo = load_script("demo")
    assert demo.main(["--model", str(folder), "--question", "Why?", "--method", "vase_attnv", "--budget", "16",
                      "--buffer", "8", "--max-new-tokens", "40", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Why?\n") and "[40 tokens in" in out and "gold" not in out
    assert int(re.search(r"(\d+) evictions", out).group(1)) > 0  # prompt + 40 tokens pass N = 16 several times


@pytest.mark.parametrize("argv, message", [
    (["--method", "nope"], "method='nope' is not a known method"),
    (["--method", "snapkv", "--budget", "0"], "budget"),
])
def test_demo_bad_input_exits_2_before_loading(capsys, argv, message):
    assert load_script("demo").main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("demo.py: error:") and message in err


def test_compare_methods_on_the_tiny_model(tmp_path, capsys):
    """Two methods on the tiny random model: SnapKV's overlap with itself is 1, the other's is a fraction; both
    rows carry positive timings; the table and the JSON agree."""
    cm = load_script("compare_methods")
    out = tmp_path / "m"
    assert cm.main(["--config", "tiny", "--layers", "2", "--methods", "snapkv,vase_attnv", "--budget", "32",
                    "--buffer", "8", "--batch", "1", "--new-tokens", "16", "--prompt-len", "48", "--repeats", "1",
                    "--out", str(out)]) == 0
    rows = json.loads((out / "methods.json").read_text())["rows"]
    by = {r["method"]: r for r in rows}
    assert set(by) == {"snapkv", "vase_attnv"}
    assert by["snapkv"]["overlap_with_snapkv"] == 1.0
    assert 0.0 <= by["vase_attnv"]["overlap_with_snapkv"] < 1.0
    assert all(r["evict_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert "| vase_attnv |" in (out / "methods.md").read_text()


def test_compare_methods_bad_input_exits_2(capsys):
    cm = load_script("compare_methods")
    assert cm.main(["--config", "nope"]) == 2
    assert "--config 'nope'; allowed: tiny, tiny-1k, small" in capsys.readouterr().err
    assert cm.main(["--methods", "triattention"]) == 2
    assert "needs calibration" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["bench", "device_check"])
def test_the_measurement_scripts_run_the_benchmarks_entry_points(name):
    """`python scripts/bench.py` and `scripts/device_check.py` (the commands the developers' guide names) run
    `python -m benchmarks.<name>` from any working directory: a bad flag gets that module's error."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, os.path.join(root, "scripts", f"{name}.py"), "--no-such-flag"],
                         capture_output=True, text=True, cwd="/", timeout=120)
    assert res.returncode == 2 and "--no-such-flag" in res.stderr, res.stderr[-2000:]
