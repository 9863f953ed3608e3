"""benchmarks.kernels on CPU: the decode sweep's code path (Triton kernel in interpret mode, a tiny shape), its
table-row fitting on made-up timings, and the benchmark table's JSON (what benchmarks.device_check reads). No timing
assertions."""

from __future__ import annotations

import json

import pytest

from benchmarks import kernels
from pallas_kernels import decode_tuning
from pallas_kernels.decode_tuning import DecodeParams, DecodeTuning

TINY = (2, 1, 2, 16, 64, "float32")  # batch, kv_heads, group, head_dim, slots, dtype


def _rows(text: str) -> dict:
    """`table_text` read back as the Python it is meant to be pasted as."""
    return eval("{\n" + text + "\n}", {"DecodeTuning": DecodeTuning})  # noqa: S307 (our own output)


def test_sweep_runs_the_kernel_and_fits_a_row():
    candidates = [DecodeParams(16, 2, 4, 2), DecodeParams(32, 1, 4, 3)]
    out = kernels.sweep_decode([TINY], candidates, 60.0, read_bandwidth_bytes_s=1e10, log=lambda _: None)
    json.dumps(out)  # JSON-able
    assert out["interpret"] and out["device_kind"] == decode_tuning.DEFAULT_DEVICE_KIND
    (shape,) = out["shapes"]
    assert shape["shape"]["batch"] == 2 and shape["table"]["num_splits"] >= 1
    sources = [r["source"] for r in shape["results"]]
    assert sources == ["table", "given", "given"]
    assert all(r["ms"] > 0 and r["bytes"] > 0 and 0 < r["fraction_of_read_bw"] for r in shape["results"])
    assert shape["best"] in shape["results"] and shape["best_vs_table"] >= 1.0
    s = kernels.DecodeShape.of(TINY)
    base = decode_tuning.lookup(decode_tuning.DEFAULT_DEVICE_KIND, s.head_dim, s.group, s.dtype)
    assert shape["table_measured"] == (base.measured or "no (a reasoned guess)")
    rows = _rows(out["table_text"])
    assert list(rows) == [("NVIDIA H200", 16, 2, "float32")]
    best = DecodeParams(**shape["best"]["params"])
    row = rows[("NVIDIA H200", 16, 2, "float32")]
    assert (row.block_size, row.num_warps, row.num_stages) == (best.block_size, best.num_warps, best.num_stages)


def test_sweep_stops_at_its_budget():
    out = kernels.sweep_decode([TINY, TINY], None, 0.0, read_bandwidth_bytes_s=1e10, log=lambda _: None)
    assert [s.get("skipped") for s in out["shapes"]] == ["budget", "budget"]
    assert out["entries"] == [] and out["table_text"] == ""


def test_rows_are_fitted_from_the_timings():
    """Two shapes of one key: launch (64, 4, 3) wins on both; the best split counts (8 at batch 16, 1 at batch 128)
    both follow from about 8 programs per SM on 132 SMs."""

    def result(block, splits, stages, ms):
        return dict(params=DecodeParams(block, splits, 4, stages).as_dict(), source="x", ms=ms)

    recs = []
    for batch, best_splits in ((16, 8), (128, 1)):
        results = [result(64, s, 3, 1.0 + abs(s - best_splits) / 10) for s in (1, 2, 4, 8, 16)]
        results += [result(128, best_splits, 3, 1.3), result(64, best_splits, 2, 1.6)]
        recs.append(dict(shape=dict(batch=batch, kv_heads=8, group=5, head_dim=128, slots=4096), results=results,
                         best=min(results, key=lambda r: r["ms"]), best_vs_table=1.2))
    (entry,) = kernels.fit_entries(recs, "NVIDIA H200", 132)
    assert entry["key"] == ["NVIDIA H200", 128, 5, "bfloat16"]
    tuned = DecodeTuning(**entry["entry"])
    assert (tuned.block_size, tuned.num_warps, tuned.num_stages) == (64, 4, 3)
    assert tuned.splits_for(16, 8, 4096, 132) == 8 and tuned.splits_for(128, 8, 4096, 132) == 1
    assert _rows(entry["text"])[("NVIDIA H200", 128, 5, "bfloat16")] == tuned
    assert tuned.measured.startswith("swept on NVIDIA H200, jax ")  # a fitted row says it was measured, and where


def test_every_table_row_says_whether_it_was_measured():
    """A row is a reasoned guess (`measured` empty) or names the sweep that measured it; the sweep's record says
    which of the two the row it compared against is."""
    for key, entry in decode_tuning.TABLE.items():
        assert isinstance(entry.measured, str), key
        assert entry.measured == "" or entry.measured.startswith("swept on "), (key, entry.measured)
    row = decode_tuning.entry_text(("X", 128, None, "bfloat16"), decode_tuning.DecodeTuning(measured="swept on X"))
    assert "measured='swept on X'" in row


def test_shapes_are_checked():
    assert kernels.DecodeShape.of(dict(batch=1, kv_heads=2, group=3, head_dim=16, slots=8)).dtype == "bfloat16"
    with pytest.raises(ValueError, match="slots=0"):
        kernels.DecodeShape.of((1, 1, 1, 16, 0))
    with pytest.raises(ValueError, match="capacity=4"):
        kernels.DecodeShape.of((1, 1, 1, 16, 8, "float32", 4))


def test_benchmark_table_json(tmp_path):
    path = tmp_path / "kernels.json"
    rows = kernels.main(["--which", "decode", "--batches", "1", "--lengths", "32", "--kv-heads", "2",
                               "--head-dim", "16", "--repeats", "3", "--copy-mib", "8", "--json", str(path)])
    out = json.loads(path.read_text())
    for key in ("copy_bandwidth_gb_per_s", "read_bandwidth_gb_per_s", "dtype", "kv_heads", "group", "head_dim",
                "window"):
        assert key in out["meta"]
    assert out["results"] == rows and [r["impl"] for r in rows] == ["xla"]
    for key in ("op", "impl", "batch", "length", "ms", "gb_per_s", "fraction_of_copy_bw", "fraction_of_read_bw"):
        assert key in rows[0]
