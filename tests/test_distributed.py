"""scripts/eval.py on a mesh and over two processes (2 x 2 or 2 x 1 CPU devices, gloo on 127.0.0.1): the same
records and summary as one process on one device; a killed multi-process run resumes with nothing lost or
duplicated; bad mesh / process flags fail with one clear line before anything is loaded. One method, vase_attnv
(evicting: the harder path; `full` on meshes is compared in tests/test_sharding.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_eval import _load_script  # scripts/eval.py as a module

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "eval.py"
PROBLEMS = [  # gsm8k format, one prompt bucket
    {"question": "What is 3 + 4?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "Tom has 5 apples and eats 2 of them. How many apples are left?", "answer": "#### 3"},
]
SAMPLES = 8  # rows per call, split over the data axis of every mesh here
VOLATILE = ("seconds",)  # wall-clock


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return {"root": root, "data": str(data)}


def _args(work, out, *extra: str) -> list[str]:
    return ["--random-model", "tiny", "--task", "gsm8k", "--data", work["data"], "--methods", "vase_attnv",
            "--budgets", "32", "--buffer", "8", "--samples", str(SAMPLES), "--batch-size", str(SAMPLES),
            "--max-total-tokens", "56", "--dtype", "float32", "--save-text", "--out", str(out), *extra]


def _env(work, devices: int) -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"  # the last count wins
    return dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=str(ROOT),
                JAX_COMPILATION_CACHE_DIR=str(work["root"] / f"jax_cache_{devices}"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two(work, out, *extra: str, devices: int = 2) -> list[subprocess.Popen]:
    port = _free_port()
    return [subprocess.Popen([sys.executable, str(SCRIPT), *_args(
        work, out, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
        "--process-id", str(i), *extra)], env=_env(work, devices), cwd=work["root"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for i in range(2)]


def _finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]


def _records(out: Path) -> dict:
    recs = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    by_key = {(r["problem_id"], r["sample"], r["method"], r["budget"]): r for r in recs}
    assert len(by_key) == len(recs), "duplicate records"
    return {k: {f: v for f, v in r.items() if f not in VOLATILE} for k, r in by_key.items()}


def _results(out: Path) -> list[dict]:
    summary = json.loads((out / "summary.json").read_text())
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in summary["results"]]


@pytest.fixture(scope="module")
def single(work):
    """The reference: one process, one device."""
    out = work["root"] / "single"
    res = subprocess.run([sys.executable, str(SCRIPT), *_args(work, out)], env=_env(work, 1), cwd=work["root"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    evictions = [r["evictions"] for r in _records(out).values() if r["method"] == "vase_attnv"]
    assert min(evictions) >= 2  # every compared run evicts, more than once
    return out


@pytest.mark.slow
def test_two_processes_data_and_tensor_parallel_match_one_process(work, single):
    """Rows over the two processes and kv heads over the two devices of each (2 devices per process, not 4: with
    8 virtual devices on 2 cores every call ran 3x slower), over gloo: the same records and summary as one
    device. (Sampling once took ~7 s per step here: the sampler's cumsum over a vocabulary split across devices;
    `generate.whole_vocab` gathers it.)"""
    out = work["root"] / "two_data=2,model=2"
    _finish(_start_two(work, out, "--mesh", "data=2,model=2", devices=2))
    assert _records(out) == _records(single) and len(_records(out)) == len(PROBLEMS) * SAMPLES
    assert _results(out) == _results(single)


@pytest.mark.slow
def test_heads_over_two_processes_match_one_process_and_resume_after_a_kill(work, single):
    """Two processes of one device each, the kv heads split over them (`--mesh data=1,model=2`: every layer's
    attention and matmuls cross the processes), killed once the first records are on disk (process 1 first, then
    the writer) and both restarted: the records and summary of one process. (The records written before the kill
    and those written after are both compared, so an uninterrupted run adds nothing.)"""
    total = len(PROBLEMS) * SAMPLES
    out = work["root"] / "killed"
    records = out / "records.jsonl"
    procs = _start_two(work, out, "--mesh", "data=1,model=2", devices=1)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and procs[0].poll() is None:
        if records.exists() and records.read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.01)
    for p in reversed(procs):
        p.send_signal(signal.SIGKILL)
        p.communicate()
    assert procs[0].returncode == -signal.SIGKILL  # it was still running
    before = records.read_bytes().count(b"\n")
    assert 1 <= before < total
    _finish(_start_two(work, out, "--mesh", "data=1,model=2", devices=1))
    assert _records(out) == _records(single)  # nothing lost, nothing twice, the same samples
    assert _results(out) == _results(single)


@pytest.mark.parametrize("extra, message", [
    (["--mesh", "pipe=2"], "'pipe=2' is not AXIS=SIZE"),
    (["--mesh", "data=3"], "has 3 devices; this run has 1"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"], "--process-id=2 is out of range"),
    (["--coordinator", "127.0.0.1:1"], "without --num-processes, --process-id"),
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "must be HOST:PORT"),
])
def test_bad_mesh_or_process_flags_one_line_error(work, extra, message, capsys):
    rc = _load_script().main(_args(work, work["root"] / "bad", *extra))
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert not (work["root"] / "bad").exists()  # nothing written, nothing loaded


@pytest.mark.slow
def test_mesh_not_dividing_heads_or_rows(work):
    for extra, message in [(["--mesh", "data=2,model=4"], "model=4 does not divide kv_heads=2"),
                           (["--mesh", "data=8,model=1", "--batch-size", "4"],
                            "data=8 does not divide the 4 rows per call")]:
        res = subprocess.run([sys.executable, str(SCRIPT), *_args(work, work["root"] / "bad8", *extra)],
                             env=_env(work, 8), cwd=work["root"], capture_output=True, text=True, timeout=300)
        assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr
