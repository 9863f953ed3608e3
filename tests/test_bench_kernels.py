"""benchmarks.kernels on CPU: the decode sweep (the Triton kernel in interpret mode on a tiny shape), its budget, the
table rows it prints, the benchmark table's JSON (what benchmarks.device_check reads) and the CLI's checks. No
timing assertions beyond "a time was measured"."""

from __future__ import annotations

import json
import time

import jax
import pytest

from benchmarks import kernels
from pallas_kernels import decode_tuning
from pallas_kernels.decode_tuning import DecodeParams, DecodeTuning

TINY = (2, 1, 2, 16, 64, "float32")  # batch, kv_heads, group, head_dim, slots, dtype
CLI_TINY = ["--batches", "2", "--lengths", "64", "--kv-heads", "1", "--group", "2", "--repeats", "3", "--copy-mib", "8"]


def _rows(text: str) -> dict:
    """`table_text` read back as the Python it is meant to be pasted as."""
    return eval("{\n" + text + "\n}", {"DecodeTuning": DecodeTuning})  # noqa: S307 (our own output)


def test_sweep_times_the_candidates_and_prints_the_best_row():
    seen = []
    out = kernels.sweep_decode([TINY], 300.0, candidates=[(16, 4, 2, 8.0), (32, 4, 3, 2.0)], read_bw=1e10,
                               log=lambda _: None, on_result=seen.append)
    json.dumps(out)  # JSON-able
    assert out["interpret"] and not out["stopped"]
    (shape,) = out["shapes"]
    timings = shape["timings"]
    # the table's own row first (GENERIC here: 64-slot blocks, 2 stages), then the two candidates; one split each
    # (64 slots hold too few blocks for more)
    assert [(t["params"]["block_size"], t["params"]["num_stages"], t["params"]["num_splits"]) for t in timings] == [
        (64, 2, 1), (16, 2, 1), (32, 3, 1)]
    assert all(t["ms"] > 0 and t["gb_per_s"] > 0 and t["fraction_of_read_bw"] > 0 for t in timings)
    assert len(seen) == 3 and seen[-1]["shapes"][0]["timings"] == timings  # a result after each timing
    assert shape["table"] == timings[0] and shape["best"] == min(timings, key=lambda t: t["ms"])

    (group,) = out["groups"]
    key = (decode_tuning.DEFAULT_DEVICE_KIND, 16, 2, "float32")
    assert tuple(group["key"]) == key and group["table_ms"] == timings[0]["ms"]
    assert group["best_ms"] == shape["best"]["ms"]  # one shape: the group's best row is the shape's best launch
    row = _rows(out["table_text"])[key]
    best = DecodeParams(**shape["best"]["params"])
    assert (row.block_size, row.num_warps, row.num_stages) == (best.block_size, best.num_warps, best.num_stages)
    assert row.measured.startswith(f"swept on {jax.devices()[0].device_kind}, jax {jax.__version__}, ")
    assert {**group["best"], "measured": row.measured} == {f: getattr(row, f) for f in group["best"]}


def test_sweep_stops_at_its_budget():
    other = (2, 1, 4, 16, 64, "float32")  # another group: the budget is shared
    out = kernels.sweep_decode([TINY, other], 0.0, read_bw=1e10, log=lambda _: None)
    assert out["stopped"] and [s["timings"] for s in out["shapes"]] == [[], []]
    assert [(s["table"], s["best"]) for s in out["shapes"]] == [(None, None)] * 2
    assert [g["text"] for g in out["groups"]] == ["", ""] and out["table_text"] == ""
    # 1 s: the table's row is timed, then (the result written slowly) the budget is spent and the sweep stops
    out = kernels.sweep_decode([TINY], 1.0, read_bw=1e10, log=lambda _: None, on_result=lambda _: time.sleep(1.1))
    (shape,) = out["shapes"]
    assert out["stopped"] and shape["timings"] == [shape["table"]] and shape["table"]["ms"] > 0
    assert _rows(out["table_text"])[(decode_tuning.DEFAULT_DEVICE_KIND, 16, 2, "float32")].block_size == 64


def test_sweep_cli_writes_its_results(tmp_path):
    """The CLI's sweep, its budget spent by the bandwidth probe: nothing timed, and that written down."""
    out = kernels.main(["--sweep-seconds", "0.001", *CLI_TINY, "--out", str(tmp_path)])
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps(out))
    assert out["stopped"] and out["shapes"][0]["shape"]["head_dim"] == kernels.HEAD_DIM
    assert out["shapes"][0]["timings"] == [] and out["table_text"] == ""
    assert "(none: no row was timed" in (tmp_path / "results.md").read_text()


def test_every_table_row_says_whether_it_was_measured():
    """A row is a reasoned guess (`measured` empty) or names the sweep that measured it."""
    for key, entry in decode_tuning.TABLE.items():
        assert isinstance(entry.measured, str), key
        assert entry.measured == "" or entry.measured.startswith("swept on "), (key, entry.measured)
    row = decode_tuning.entry_text(("X", 128, None, "bfloat16"), decode_tuning.DecodeTuning(measured="swept on X"))
    assert "measured='swept on X'" in row


@pytest.mark.parametrize("argv", [["--repeats", "2"], ["--batches", "0"], ["--kv-heads", "0"], ["--group", "0"],
                                  ["--lengths", "x"], ["--lengths", "8,0"], ["--sweep-seconds", "-1"],
                                  ["--sweep-seconds", "5"]])  # the last: CPU, no shapes
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        kernels.main(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


def test_benchmark_table_json(tmp_path):
    out = kernels.main(["--batches", "1", "--lengths", "32", "--kv-heads", "2", "--repeats", "3", "--copy-mib", "8",
                        "--interpret", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "results.json").read_text())
    assert written == json.loads(json.dumps(out))
    for key in ("copy_bandwidth_gb_per_s", "read_bandwidth_gb_per_s", "dtype", "kv_heads", "group", "head_dim",
                "window", "interpret"):
        assert key in written["meta"]
    rows = written["results"]
    assert [(r["op"], r["impl"]) for r in rows] == [(op, impl) for op in ("decode", "scores")
                                                    for impl in ("xla", "pallas_gpu", "pallas_tpu")]
    for r in rows:
        assert r["ms"] > 0 and r["fraction_of_copy_bw"] > 0 and r["fraction_of_read_bw"] > 0
        assert ("tflop_per_s" in r) == (r["op"] == "scores") and r.get("tflop_per_s", 1) > 0
    assert len((tmp_path / "results.md").read_text().splitlines()) == 2 + len(rows)
