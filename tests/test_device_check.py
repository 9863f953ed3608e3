"""benchmarks.device_check: a clear refusal without an accelerator, its phases' commands, their code on CPU at tiny
shapes (the decode phase's benchmark, the workload's plan on the device it runs on, invariance, memory) and its
report's targets."""

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


def test_bad_flags_exit_2_and_phase_commands(device_check, tmp_path, capsys):
    """A phase name --skip does not know: a one-line error, exit 2, nothing run. The sweep is `benchmarks.kernels`
    up to 20 s before its cap, and GPU only; the benchmarks' phases stop new work by a deadline; the workload is a
    process per method; the second lease (events, memory, decode) fits the default budget."""
    with pytest.raises(SystemExit) as e:
        device_check.main(["--skip", "tests,lowering", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "--skip: lowering unknown" in err[-1] and not (tmp_path / "out").exists()
    assert device_check.PHASES == ("tests", "invariance", "sweep", "workload", "events", "memory", "decode")
    cmd = device_check.phase_command("sweep", "f", 60, "gpu")
    assert cmd[1:] == ["-m", "benchmarks.kernels", "--sweep-seconds", "40", "--out", "f"]
    assert device_check.phase_command("sweep", "f", 60, "tpu") is None
    for name, module in (("decode", "bench"), ("events", "bench"), ("memory", "device_check"),
                         ("invariance", "device_check"), ("workload full", "bench")):
        cmd = device_check.phase_command(name, "f", 200, "gpu")
        assert cmd[2] == f"benchmarks.{module}" and cmd[cmd.index("--out") + 1] == "f"
        assert time.time() + 170 < float(cmd[cmd.index("--deadline") + 1]) <= time.time() + 200
    workload = device_check.phase_command("workload vase_dkv@2048", "f", 264, "gpu")
    assert workload[3:] == ["--workload", "aime25", "--scale", "protocol", "--methods", "vase_dkv", "--budgets",
                            "2048", "--seconds", "84", "--deadline", workload[-3], "--out", "f"]
    assert "--kv-bits" in device_check.phase_command("decode", "f", 60, "gpu")
    assert sum(device_check.CAPS[n] for n in ("events", "memory", "decode")) <= 470


@pytest.mark.slow
def test_decode_phase_and_report_on_cpu(device_check, tmp_path):
    """The decode phase's benchmark (`bench --micro` with the phase's flags), tiny: no eviction and an
    attention-scored method (its query ring, its eviction), full's step on a K4V4 cache; then the report's targets
    from it and from the other phases' results."""
    from benchmarks import bench
    from vase_jax.random_model import named_configs

    tiny = {"--model": "tiny-1k", "--dtype": "float32", "--batch": "2", "--prompt-len": "8", "--output-lens": "64",
            "--methods": "full,vase_attnv", "--budgets": "32", "--buffer": "16", "--micro-steps": "2",
            "--bandwidth-mib": "16", "--out": str(tmp_path / "decode")}
    assert bench.main(device_check.flags(device_check.DECODE | tiny)) == 0
    result = json.loads((tmp_path / "decode" / "results.json").read_text())
    rows = {r["label"]: r for r in result["runs"]}
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

    table = (tmp_path / "decode" / "results.md").read_text()
    # pretend these were the real lengths and methods
    result["runs"] = [dict(r, output_len=16384, method=r["method"].replace("attnv", "dkv")) for r in result["runs"]]
    memory = device_check.memory_peak(model="tiny-1k", dtype="float32", batch=2, prompt_len=8, budget=32, buffer=16,
                                      new_tokens=64)
    assert memory["evictions"] >= 1 and memory["peak"] is None  # CPU devices report no memory statistics
    assert memory["bound"] == memory["weights"] + memory["cache"] + (2 << 30)
    # the cache's bytes: at least (budget + buffer) slots of K and V (float32) and an int32 position, per layer and
    # row (2 rows)
    cfg = named_configs()["tiny-1k"]
    assert memory["cache"] >= 2 * cfg.num_layers * cfg.num_kv_heads * 48 * (2 * cfg.head_dim * 4 + 4)
    memory.update(peak=memory["weights"] + memory["cache"], within=True)  # as a device would report it
    report = dict(started="now", seconds=1.0, environment=dict(backend="gpu", device_kind="test", jax="0", python="3"),
                  phases=dict(tests=dict(status="done", seconds=1, tail=["....", "1 passed in 2.00s"]),
                              memory=dict(status="done", seconds=1, results=memory),
                              decode=dict(status="done", seconds=1, results=result, table=table)))
    t = report["targets"] = device_check.targets(report)
    assert "vase_dkv vs full tokens/s at 16k >= 2.3x" in t
    assert "vase_dkv@2048 decode step at 16k >= 0.75 of its bytes bound" in t
    assert "full K4V4 decode step at 16k <= 0.6x the 16-bit cache's" in t
    assert t["device peak <= weights + cache + 2 GiB"].startswith("met")
    assert len(t) == 4  # no sweep, events or workload results: no targets of theirs
    text = device_check.markdown(report)
    assert "## decode" in text and "| vase_attnv@32 | 64 |" in text and "## Targets" in text
    assert "Tests: `1 passed in 2.00s`" in text and "- full at 64 tokens on K4V4 (P = " in text


def test_sweep_workload_and_events_in_the_report(device_check):
    """The sweep, workload and events phases' targets, from results shaped as their producers write them
    (`benchmarks.kernels --sweep-seconds`, bench --workload aime25, bench --micro's eviction_share), and their tables
    in the report."""

    def shape(batch, slots, table_share, best_share):
        timing = [None if s is None else dict(ms=1.0, fraction_of_read_bw=s, params={"block_size": 64})
                  for s in (table_share, best_share)]
        return dict(shape=dict(batch=batch, kv_heads=8, group=5, slots=slots, dtype="bfloat16"), table=timing[0],
                    best=timing[1])

    sweep = dict(shapes=[shape(16, 4096, 0.72, 0.8), shape(16, 16384, 0.75, None), shape(128, 2048, 0.6, 0.71),
                         shape(64, 2080, None, None)], table_text="TABLE = {}\n")

    def workload(label, rows, seconds):
        return {"methods": [dict(label=label, rows=rows, peak_bytes=100 * 2**30, plan=dict(total=98 * 2**30),
                                 protocol=dict(seconds=seconds, tok_s=3600.0, step_ms=30.0, utilization=0.6))]}

    events = dict(runs=[dict(method="vase_dkv", budget=2048, eviction_share=0.02),
                        dict(method="vase_attnv", budget=2048, eviction_share=0.04)])
    report = dict(started="now", seconds=1.0, environment=dict(backend="gpu", device_kind="H200", jax="0", python="3"),
                  phases={"sweep": dict(status="done", seconds=80, results=sweep, table="| sweep's table |\n"),
                          "workload vase_dkv@2048": dict(status="done", seconds=200,
                                                         results=workload("vase_dkv@2048", 260, 1700.0)),
                          "workload full": dict(status="skipped", seconds=0, tail=["time budget"]),
                          "events": dict(status="done", seconds=60, results=events)})
    t = device_check.targets(report)
    # a shape the sweep's best did not time: the table's figure alone
    assert t["decode kernel >= 70% of the read bandwidth (batch 16, 4k-16k slots)"] == "met with the table: lowest 72%"
    assert t["decode kernel >= 70% of the read bandwidth (batch 128, 2k slots)"] == (
        "not met with the table: lowest 60%; the sweep's best: lowest 71%")
    assert t["vase_dkv@2048 eviction events <= 3% of the decode time between them"] == "met: 2.0%"
    assert t["vase_attnv@2048 eviction events <= 3% of the decode time between them"] == "not met: 4.0%"
    assert t["the AIME25 protocol's projected wall time, vase_dkv@2048, <= 30 min"] == "met: 28.3 min at 260 rows"
    assert len(t) == 5
    report["phases"]["workload full"] = dict(status="done", seconds=200, results=workload("full", 20, 9000.0))
    assert device_check.targets(report)["the AIME25 protocol's projected wall time, vase_dkv@2048, <= 30 min"] == (
        "met: 28.3 min at 260 rows (full: 150.0 min at 20 rows)")
    # a sweep whose table rows were not timed (stopped for time): no target from them
    sweep["shapes"][2]["table"] = None
    assert "decode kernel >= 70% of the read bandwidth (batch 128, 2k slots)" not in device_check.targets(report)
    report["phases"]["workload full"] = dict(status="skipped", seconds=0, tail=["time budget"])
    report["targets"] = t
    text = device_check.markdown(report)
    assert "## sweep\n\n| sweep's table |" in text and "| workload full | skipped | 0 |" in text
    assert text.index("## sweep") < text.index("## Targets") and "- vase_attnv@2048 eviction events" in text


@pytest.mark.slow
def test_workload_phase_plans_its_rows_on_its_device(device_check, tmp_path):
    """The workload phase's child, at the tiny scale on this CPU (memory given, as a device's allocator limit
    would be): no rows given, so it plans them (`planner.largest_batch`, compiled here) and runs at the plan's
    rows; the report's planned GiB is the plan's total."""
    cmd = device_check.workload_command("vase_dkv@32", 1, str(tmp_path / "w"), scale="tiny")  # a deadline past
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
                  phases={"workload vase_dkv@32": dict(status="done", seconds=1, results=res,
                                                       table=(tmp_path / "w" / "results.md").read_text())})
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
