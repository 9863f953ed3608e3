"""`RecordStore`, the append-only JSONL file of graded samples that makes a run resumable, and what makes a
record: its problem's key (`problem_key`) and the record of a generated sample (`make_record`), the same under
every scheduler.

One JSON object per line, one line per generated sample. A batch's lines go out in one `write`, then `flush`
and `fsync`, so that a killed run loses at most the batch in flight. On open, an incomplete or unparsable
last line (a write cut short by a kill) is cut off with a warning and its samples are redone; a bad line
anywhere else is an error, never skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import jax
import numpy as np

from vase_jax.evaluation.config import EvalConfig
from vase_jax.kvquant import BF16
from vase_jax.tasks import Problem, extract_answer, get_task, grade, livecodebench

KEY_FIELDS = ("problem_id", "sample", "method", "budget")  # and "kv_bits" (absent in older records)
# (problem id, sample index, method, budget or None for full, cache setting: `BF16`, "K16V16", for the 16-bit cache)
Key = tuple[str, int, str, int | None, str]


def record_key(rec: dict) -> Key:
    """A record's key; records written before cache settings existed are the 16-bit cache's."""
    return (str(rec["problem_id"]), int(rec["sample"]), str(rec["method"]), rec["budget"],
            str(rec.get("kv_bits", BF16)))


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


def stable_id(task: str, problem_id: str) -> int:
    """A 31-bit integer of (task, problem id) that is the same on every machine and Python run."""
    digest = hashlib.sha256(f"{task}/{problem_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def problem_key(seed: int, task: str, problem_id: str) -> jax.Array:
    """The PRNG key of one problem; its samples are the row streams 0..R-1 of `generate`."""
    return jax.random.fold_in(jax.random.key(seed), stable_id(task, problem_id))




def make_record(tokenizer, cfg: EvalConfig, problem: Problem, sample: int, method: str, budget: int | None,
                prompt_len: int, tokens: np.ndarray, ended_by_token: bool, evictions: int, seconds: float,
                kv_bits: str = BF16) -> dict:
    """Cut a sample's tokens at its exact cap, grade them: its record (the same under every scheduler)."""
    task = get_task(cfg.task)
    cap = cfg.token_limits(prompt_len)[1]
    n = len(tokens)
    done = ended_by_token and n <= cap  # an end token beyond the exact cap does not count
    n = min(n, cap)
    text = tokenizer.decode(np.asarray(tokens[:n]).tolist(), skip_special_tokens=True)
    if task.grader == "code":  # run the code on the tests in the sandbox; keep the verdict's reason
        verdict = livecodebench.grade(problem, text)
        correct, why = verdict.passed, {"reason": verdict.reason}
    else:
        correct, why = bool(grade(text, problem)), {}
    rec = {
        "task": cfg.task, "problem_id": problem.id, "sample": sample, "method": method,
        "budget": budget, "kv_bits": kv_bits, "seed": cfg.seed, "prompt_tokens": prompt_len, "tokens": n,
        "max_tokens": cap, "finished": done, "truncated": not done, "answer": extract_answer(text, task),
        "gold": problem.answer, "correct": correct, **why,
        "evictions": evictions, "seconds": round(seconds, 4),
    }
    if cfg.save_text:
        rec["text"] = text
    return rec
