"""benchmarks.device_check: a clear refusal without an accelerator, its phases' code on CPU at tiny shapes (the
decode phase's benchmark, the workload's plan on the device it runs on, lowering, invariance) and its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def device_check():
    from benchmarks import device_check

    return device_check


@pytest.mark.skipif(jax.default_backend() in ("gpu", "tpu"), reason="an accelerator is present: the check would run")
def test_exits_2_without_an_accelerator(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--out", str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr
    assert "no accelerator" in proc.stderr and "Nothing was run" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.slow
def test_decode_phase_and_report_on_cpu(device_check, tmp_path):
    """The decode phase's benchmark (`bench --micro` with the phase's flags), tiny: no eviction and an
    attention-scored method (its query ring, its eviction), full's step on a K4V4 cache; then the report's targets
    from it and from the other phases' results."""
    from benchmarks import bench

    tiny = {"--model": "tiny-1k", "--dtype": "float32", "--batch": "2", "--prompt-len": "8", "--output-lens": "64",
            "--methods": "full,vase_attnv", "--budgets": "32", "--buffer": "16", "--micro-steps": "2",
            "--bandwidth-mib": "16", "--out": str(tmp_path / "decode")}
    assert bench.main(device_check.flags(device_check.DECODE | tiny)) == 0
    result = json.loads((tmp_path / "decode" / "results.json").read_text())
    rows = {bench.label(r): r for r in result["runs"]}
    assert set(rows) == {"full", "vase_attnv@32"}
    for r in rows.values():
        roof = r["roofline"]
        assert r["output_len"] == 64 and r["tok_s_end"] > 0 and roof["bound_tok_s_end"] > 0 and r["step_ms_end"]
        assert "total_s" not in r and "step_ms_start" not in r  # no generate run, no first-step figure
    assert rows["vase_attnv@32"]["evict_ms"]["median"] > 0 and rows["vase_attnv@32"]["eviction_share"] > 0
    assert rows["full"]["live_slots_end"] > rows["vase_attnv@32"]["live_slots_end"]
    # the mixed-precision step: the same live tokens, a quarter of the capacity in 16 bits, the rest quantized, so
    # fewer bytes per step than the 16-bit cache's
    (k4,) = rows["full"]["kv"]
    assert k4["kv_bits"] == "K4V4" and k4["quantized_slots"] > 0 and k4["x_bf16_step"] > 0
    assert k4["bytes_per_step"] < rows["full"]["roofline"]["bytes_step_end"]

    kernels = dict(meta=dict(copy_bandwidth_gb_per_s=100.0), results=[
        dict(op="decode", impl="triton", batch=16, length=n, ms=1.0, gb_per_s=80.0, fraction_of_copy_bw=0.8)
        for n in (4096, 16384)])
    table = (tmp_path / "decode" / "results.md").read_text()
    # pretend these were the real lengths and methods
    result["runs"] = [dict(r, output_len=16384, method=r["method"].replace("attnv", "dkv")) for r in result["runs"]]
    memory = device_check.memory_peak(model="tiny-1k", dtype="float32", batch=2, prompt_len=8, budget=32, buffer=16,
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
                              decode=dict(status="done", seconds=1, results=result, table=table)))
    t = report["targets"] = device_check.targets(report)
    assert t["decode kernel >= 70% of copy bandwidth (batch 16, 4k-16k slots)"].startswith("met")
    assert "vase_dkv vs full tokens/s at 16k >= 2.3x" in t
    assert "vase_dkv@2048 decode step at 16k >= 0.75 of its bytes bound" in t
    assert "full K4V4 decode step at 16k <= 0.6x the 16-bit cache's" in t
    assert t["device peak <= weights + cache + 2 GiB"].startswith("met")
    assert t["the device's lowering equals the CPU host's"] == "not met: 2 lines differ"
    text = device_check.markdown(report)
    assert "## decode" in text and "| vase_attnv@32 | 64 |" in text and "## Targets" in text


@pytest.mark.slow
def test_lowering_phase_on_this_host(device_check):
    """The lowering phase's code on CPU: a lowering for cuda from this (CPU-only) process is deterministic (the
    device's is compared against it), and differs from the CPU program."""
    small = dict(layers=1, batch=2, prompt_len=16, budget=128, buffer=64, max_new_tokens=256)
    cuda = device_check.lowered_text("cuda", **small)
    assert device_check.compare_lowerings(cuda, device_check.lowered_text("cuda", **small))["identical"]
    assert not device_check.compare_lowerings(cuda, device_check.lowered_text(None, **small))["identical"]


def test_sweep_workload_and_events_in_the_report(device_check):
    """The sweep, workload and events phases' targets, from results shaped as their producers write them
    (`kernel_sweep`, bench --workload aime25, bench --micro's eviction_share), and the sweep's table."""

    def shape(batch, slots, table_share, best_share):
        return dict(shape=dict(batch=batch, kv_heads=8, group=5, head_dim=128, slots=slots, dtype="bfloat16"),
                    results=[dict(source="table", params={}, ms=1.0, fraction_of_read_bw=table_share),
                             dict(source="launch", params={}, ms=0.8, fraction_of_read_bw=best_share)],
                    best=dict(source="launch", params={"block_size": 128}, ms=0.8, fraction_of_read_bw=best_share))

    sweep = dict(device_kind="NVIDIA H200", sm_count=132, read_bandwidth_gb_s=4190, seconds=80,
                 shapes=[shape(16, 4096, 0.72, 0.8), shape(16, 16384, 0.75, 0.8), shape(128, 2048, 0.6, 0.71)],
                 table_text="TABLE = {}\n")

    def workload(label, rows, seconds):
        return {"methods": [dict(label=label, rows=rows, peak_bytes=100 * 2**30, plan=dict(total=98 * 2**30),
                                 protocol=dict(seconds=seconds, tok_s=3600.0, step_ms=30.0, utilization=0.6))]}

    events = dict(runs=[dict(method="vase_dkv", budget=2048, eviction_share=0.02),
                        dict(method="vase_attnv", budget=2048, eviction_share=0.04)])
    report = dict(started="now", seconds=1.0, environment=dict(backend="gpu", device_kind="H200", jax="0", python="3"),
                  phases=dict(sweep=dict(status="done", seconds=80, results=sweep,
                                         table=device_check.sweep_markdown(sweep)),
                              workload=dict(status="done", seconds=200, results={
                                  "vase_dkv@2048": workload("vase_dkv@2048", 260, 1700.0),
                                  "full": workload("full", 20, 9000.0),
                                  "vase_attnv@2048": dict(skipped="time budget")}),
                              events=dict(status="done", seconds=60, results=events)))
    t = device_check.targets(report)
    assert t["decode kernel >= 70% of the read bandwidth (batch 16, 4k-16k slots)"].startswith("met with the table")
    assert t["decode kernel >= 70% of the read bandwidth (batch 128, 2k slots)"] == (
        "not met with the table: lowest 60%; the sweep's best: lowest 71%")
    assert t["vase_dkv@2048 eviction events <= 3% of the decode time between them"] == "met: 2.0%"
    assert t["vase_attnv@2048 eviction events <= 3% of the decode time between them"] == "not met: 4.0%"
    assert t["the AIME25 protocol's projected wall time, vase_dkv@2048, <= 30 min"] == (
        "met: 28.3 min at 260 rows (full: 150.0 min at 20 rows)")
    report["targets"] = t
    table = device_check.markdown(report)
    assert "| 128 | 8 | 5 | 2048 | 1.000 | 60% | 0.800 | 71% |" in table and "TABLE = {}" in table
    assert "- workload vase_attnv@2048: time budget" in table
    assert set(device_check.WORKLOAD_DEFAULT) <= set(device_check.WORKLOAD_SHARE)


@pytest.mark.slow
def test_workload_phase_plans_its_rows_on_its_device(device_check, tmp_path):
    """The workload phase's child, at the tiny scale on this CPU (memory given, as a device's allocator limit
    would be): no rows given, so it plans them (`planner.largest_batch`, compiled here) and runs at the plan's
    rows; the report's planned GiB is the plan's total."""
    cmd = device_check.workload_command("vase_dkv@32", 1, time.time() - 100, str(tmp_path / "w"), scale="tiny")
    assert "--batch" not in cmd
    device_gb = 0.012
    proc = subprocess.run(cmd + ["--device-gb", str(device_gb)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "w" / "results.json").read_text())
    (rec,) = res["methods"]
    usable = int(device_gb * 1e9 * 0.95)  # less the default headroom
    assert rec["rows"] == rec["batch_plan"]["rows"] == rec["plan"]["rows"] >= 1
    assert rec["plan"]["total"] <= usable and rec["rows_reason"].startswith(("limited by memory", "capped at"))
    assert rec["schedules_match_engine"] and rec["protocol"]["tok_s"] > 0
    report = dict(started="now", seconds=1.0, environment=dict(backend="cpu", device_kind="cpu", jax="0", python="3"),
                  phases=dict(workload=dict(status="done", seconds=1, results={"vase_dkv@32": res},
                                            table=(tmp_path / "w" / "results.md").read_text())))
    text = device_check.markdown(report)
    assert f"| vase_dkv@32 | {rec['rows']} |" in text and f"| {rec['plan']['total'] / 2**30:.2f} |" in text


def test_invariance_phase_on_cpu(device_check, tmp_path):
    """The invariance phase's code path, tiny: the probe's rule, row 0's tokens alone and in batches of
    2 and 3 (identical here), a call's time at 1 and 3 rows with invariance on and off, and its table."""
    result = device_check.invariance_check(probe_model="tiny-1k", model="tiny-1k", layers=1, batches=(1, 2, 3),
                                           new_tokens=16, out=str(tmp_path))
    assert json.loads((tmp_path / "results.json").read_text()) == result
    assert result["probe"]["invariant"] and result["probe"]["min_rows"] >= 2  # CPU: a lone row runs beside a copy
    assert set(result["rows"]) == {f"{m}@{b}" for m in ("full", "vase_dkv") for b in (1, 2, 3)}
    assert all(row["identical"] for row in result["rows"].values()), result["rows"]
    assert set(result["seconds"]) == {"1 on", "1 off", "3 on", "3 off"}
    table = (tmp_path / "results.md").read_text()
    assert table.startswith("Batch invariance: ") and "| vase_dkv@3 | none |" in table
    assert "3 rows x 16 tokens:" in table
