"""scripts/device_check.py: a clear refusal without an accelerator, and its decode benchmark and report on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "device_check.py")


@pytest.fixture(scope="module")
def device_check():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(jax.default_backend() in ("gpu", "tpu"), reason="an accelerator is present: the check would run")
def test_exits_2_without_an_accelerator(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr
    assert "no accelerator" in proc.stderr and "Nothing was run" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.slow
def test_decode_benchmark_and_report_on_cpu(device_check, tmp_path):
    # the decode phase's code path, tiny: no eviction and an attention-scored method (its query ring, its eviction)
    path = tmp_path / "decode.json"
    result = device_check.decode_benchmark(model="tiny", dtype="float32", batch=2, prompt_len=8, lengths=(64,),
                                           methods=("full", "vase_attnv"), other_loop=("vase_attnv", "vase_dkv"),
                                           budget=32, buffer=16, micro_steps=2,
                                           repeats=3, json_path=str(path), bandwidth_mib=16)
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    rows = {r["method"]: r for r in result["rows"]}
    # vase_dkv: not among the methods; CPU's layer loop is the switched one, the other is unrolled
    assert result["meta"]["layer_loop"] == "switch"
    assert set(rows) == {"full", "vase_attnv@32", "vase_attnv@32 (unroll)"}
    for r in rows.values():
        assert r["tokens"] == 64 and r["tokens_per_s"] > 0 and r["bound_tokens_per_s"] > 0 and r["step_ms"] > 0
    assert rows["vase_attnv@32"]["evict_ms"] > 0
    assert rows["full"]["live_slots"] > rows["vase_attnv@32"]["live_slots"]

    kernels = dict(meta=dict(copy_bandwidth_gb_per_s=100.0, dtype="bfloat16", kv_heads=8, group=4, head_dim=128,
                             window=64),
                   results=[dict(op="decode", impl="triton", batch=16, length=n, ms=1.0, gb_per_s=80.0,
                                 fraction_of_copy_bw=0.8, bytes=1) for n in (4096, 16384)])
    # pretend these were the real lengths and methods
    result["rows"] = [dict(r, tokens=16384, method=r["method"].replace("attnv", "dkv")) for r in result["rows"]]
    memory = device_check.memory_peak(model="tiny", dtype="float32", batch=2, prompt_len=8, budget=32, buffer=16,
                                      new_tokens=64)
    assert memory["evictions"] >= 1 and memory["peak"] is None  # CPU devices report no memory statistics
    assert memory["bound"] == memory["weights"] + memory["cache"] + (2 << 30)
    memory.update(peak=memory["weights"] + memory["cache"], within=True)  # as a device would report it
    lowering = device_check.compare_lowerings("a\nb\nc", "a\nB\nc")
    assert not lowering["identical"] and lowering["differing_lines"] == 2 and lowering["first"] == ["-B", "+b"]
    report = dict(started="now", seconds=1.0, environment=dict(backend="gpu", device_kind="test", jax="0", python="3"),
                  phases=dict(tests=dict(status="passed", seconds=1, summary="1 passed"),
                              lowering=dict(status="done", seconds=1, comparison=lowering),
                              memory=dict(status="done", seconds=1, results=memory),
                              kernels=dict(status="done", seconds=1, results=kernels),
                              decode=dict(status="done", seconds=1, results=result)))
    report["targets"] = device_check.targets(report)
    assert report["targets"]["decode kernel >= 70% of copy bandwidth (batch 16, 4k-16k slots)"].startswith("met")
    assert "vase_dkv vs full tokens/s at 16k >= 2.3x" in report["targets"]
    assert report["targets"]["device peak <= weights + cache + 2 GiB"].startswith("met")
    assert report["targets"]["the device's lowering equals the CPU host's"] == "not met: 2 lines differ"
    table = device_check.markdown(report)
    assert "| vase_dkv@32 | 16384 |" in table and "## Targets" in table and "DIFFERENT" in table


@pytest.mark.slow
def test_lowering_phase_on_this_host(device_check):
    """The lowering phase's code on CPU: a lowering for cuda from this (CPU-only) process is deterministic (the
    device's is compared against it), and differs from the CPU program."""
    small = dict(layers=1, batch=2, prompt_len=16, budget=128, buffer=64, max_new_tokens=256)
    cuda = device_check.lowered_text("cuda", **small)
    assert device_check.compare_lowerings(cuda, device_check.lowered_text("cuda", **small))["identical"]
    assert not device_check.compare_lowerings(cuda, device_check.lowered_text(None, **small))["identical"]
