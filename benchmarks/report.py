"""How the benchmarks write their figures: numbers, the names of a method's row, markdown tables, JSON files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def num(x: float | None, spec: str = ".1f", scale: float = 1.0, suffix: str = "") -> str:
    """`x * scale` in format `spec`, then `suffix`; "-" for a figure not measured (None)."""
    return "-" if x is None else f"{x * scale:{spec}}{suffix}"


def spread(stat: dict | None, scale: float = 1.0, spec: str = ".1f") -> str:
    """A `timing.Stat` dict as "median [min-max]" (times `scale`); "-" for None."""
    return "-" if stat is None else "{} [{}-{}]".format(*(num(stat[k], spec, scale) for k in ("median", "min", "max")))


def names(ev) -> dict:
    """What names a method's row (an `EvictionConfig`'s): its label ("full", "vase_dkv@2048"), method, and budget and
    buffer (None for full)."""
    return {"label": ev.label, "method": ev.method, "budget": ev.budget if ev.evicts else None,
            "buffer": ev.buffer if ev.evicts else None}


def table(rows, columns: dict[str, Callable[[dict], object]]) -> list[str]:
    """A markdown table: `columns`' names as the header, one line per row of `str(column(row))`."""
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(str(f(r)) for f in columns.values()) + " |" for r in rows])


def write_json(path: str | Path, obj) -> None:
    """`obj` as indented JSON (arrays as lists, anything else unknown as its text), the folder created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x)))


def write_results(out_dir: str | None, result: dict, text: str) -> None:
    """results.json and results.md in `out_dir` (created), when one is given."""
    if out_dir:
        write_json(Path(out_dir) / "results.json", result)
        (Path(out_dir) / "results.md").write_text(text)
