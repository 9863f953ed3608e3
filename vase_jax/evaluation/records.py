"""`RecordStore`: the append-only JSONL file of graded samples that makes a run resumable.

One JSON object per line, one line per generated sample. A batch's lines go out in one `write`, then `flush`
and `fsync`, so that a killed run loses at most the batch in flight. On open, an incomplete or unparsable
last line (a write cut short by a kill) is cut off with a warning and its samples are redone; a bad line
anywhere else is an error, never skipped.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

KEY_FIELDS = ("problem_id", "sample", "method", "budget")
Key = tuple[str, int, str, int | None]  # (problem id, sample index, method, budget or None for full)


def record_key(rec: dict) -> Key:
    return (str(rec["problem_id"]), int(rec["sample"]), str(rec["method"]), rec["budget"])


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


class RecordStore:
    """The records of one output folder: `done` maps each `Key` to its record (first occurrence)."""

    def __init__(self, path: str | os.PathLike, warn: Callable[[str], None] = _warn):
        self.path = Path(path)
        self.warn = warn
        self.records: dict[Key, dict] = {}
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        raw = self.path.read_bytes()
        lines = raw.split(b"\n")
        tail = lines.pop()  # bytes after the last newline: b"" when the file ends cleanly
        good_end = len(raw) - len(tail)
        parsed: list[tuple[int, dict]] = []
        bad: list[int] = []
        for i, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            rec = _parse(line)
            if rec is None:
                bad.append(i)
            else:
                parsed.append((i, rec))
        if bad and bad[-1] == len(lines) and not tail:  # a complete but garbled last line: also a cut write
            good_end -= len(lines[-1]) + 1
            tail, bad = lines[-1], bad[:-1]
        if bad:
            raise ValueError(
                f"{self.path}:{bad[0]}: corrupt record (not the last line, so not a cut write); "
                "delete that line to redo its sample, or use a new --out"
            )
        if tail:
            self.warn(f"{self.path}: dropping an incomplete last line ({len(tail)} bytes, a write cut short "
                      "by a kill?); its samples will be generated again")
            os.truncate(self.path, good_end)
        for lineno, rec in parsed:
            key = record_key(rec)
            if key in self.records:
                self.warn(f"{self.path}:{lineno}: duplicate record {key}; keeping the first")
                continue
            self.records[key] = rec

    def __contains__(self, key: Key) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def append(self, records: Iterable[dict]) -> None:
        """Write `records` as JSON lines in one write, then flush and fsync."""
        records = list(records)
        if not records:
            return
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        with open(self.path, "ab") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        for rec in records:
            self.records.setdefault(record_key(rec), rec)


def _parse(line: bytes) -> dict | None:
    """The record on `line`, or None if it is not a JSON object with the key fields."""
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict) or any(f not in rec for f in KEY_FIELDS):
        return None
    try:
        record_key(rec)
    except (TypeError, ValueError):
        return None
    return rec
