"""How the benchmarks write their figures: numbers in tables, method labels, comma lists, JSON files."""

from __future__ import annotations

import json
from pathlib import Path


def num(x: float | None, spec: str = ".1f", scale: float = 1.0, suffix: str = "") -> str:
    """`x * scale` in format `spec`, then `suffix`; "-" for a figure not measured (None)."""
    return "-" if x is None else f"{x * scale:{spec}}{suffix}"


def method_label(method: str, budget: int | None = None) -> str:
    """"full" (no budget), or "method@budget"."""
    return f"{method}@{budget}" if budget else method


def ints(text: str) -> list[int]:
    """A comma list of integers (an argparse `type`: a ValueError is its one-line error)."""
    return [int(x) for x in text.split(",") if x.strip()]


def write_json(path: str | Path, obj) -> None:
    """`obj` as indented JSON (arrays as lists, anything else unknown as its text), the folder created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x)))
