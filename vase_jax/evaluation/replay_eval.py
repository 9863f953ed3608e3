"""`scripts/eval.py --replay`: the teacher-forced replay (`vase_jax.replay`) of every (method, budget) of a run.

The reference continuations are the full cache's own greedy traces of the run's problems (one `generate` call
per chunk of `rows` problems, the task's output cap); each evicting variant then replays them in one batched
program per chunk. Per variant: mean KL(full || evicted), top-1 agreement, NLL of the reference tokens under
the evicting cache (and under the full one), overall and per position bucket. Results are appended to
DIR/replay.jsonl as each variant finishes (a rerun skips the variants it holds) and summarized in
DIR/replay.md and DIR/replay.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import numpy as np

import vase_jax as vj
from vase_jax.evaluation.config import BF16, EvalConfig
from vase_jax.replay import ReplayOutput, replay, summarize
from vase_jax.tasks import Problem, get_task

FIELDS = ("kl", "agree", "nll", "nll_full", "valid", "row_evictions")
BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _chunks(problems: list[Problem], rows: int) -> list[list[int]]:
    return [list(range(i, min(i + rows, len(problems)))) for i in range(0, len(problems), rows)]


def references(model, tokenizer, cfg: EvalConfig, problems: list[Problem]) -> list[tuple]:
    """Per chunk: (prompt batch, reference tokens [rows, T], lengths [rows], problem indices), the full cache's
    greedy traces. A short last chunk is padded with copies of its last problem (not counted)."""
    task = get_task(cfg.task)
    out = []
    for idx in _chunks(problems, cfg.rows):
        padded = idx + [idx[-1]] * (cfg.rows - len(idx))
        batch = vj.encode_prompts(tokenizer, [task.build_prompt(problems[i].question) for i in padded])
        gen_tokens, _ = cfg.token_limits(int(batch.lengths.max()))
        config = dataclasses.replace(cfg.generate_config(gen_tokens), temperature=0.0)  # greedy references
        result = vj.generate(model, batch.input_ids, batch.attention_mask, key=jax.random.key(cfg.seed),
                             config=config, row_ids=np.asarray(padded, np.int32))
        out.append((batch, np.asarray(result.tokens), np.asarray(result.num_tokens), idx))
    return out


def run_replay(model, tokenizer, cfg: EvalConfig, problems: list[Problem], out_dir: Path,
               progress=None) -> list[dict]:
    """Replay every evicting 16-bit variant of `cfg` (module docstring); returns the rows of DIR/replay.jsonl."""
    path = out_dir / "replay.jsonl"
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
            done[(row["method"], row["budget"])] = row
    variants = [(m, b) for m, b, kv in cfg.variants if kv == BF16 and m != "full"]
    todo = [v for v in variants if v not in done]
    if todo:
        refs = references(model, tokenizer, cfg, problems)
        config = cfg.generate_config(1)  # the model's end tokens (pad id); replay sets the length itself
        for method, budget in todo:
            parts = []
            for batch, tokens, lengths, idx in refs:
                out = replay(model, batch.input_ids, batch.attention_mask, tokens, lengths,
                             key=jax.random.key(cfg.seed), eviction=cfg.eviction(method, budget), config=config,
                             row_ids=np.arange(len(lengths), dtype=np.int32) + idx[0])
                count = len(idx)
                parts.append({f: np.asarray(getattr(out, f))[:count] for f in FIELDS})
            merged = ReplayOutput(**{f: np.concatenate([p[f] for p in parts]) for f in FIELDS})
            row = {"method": method, "budget": budget, "problems": len(problems),
                   "mean_reference_tokens": float(np.asarray(merged.valid).sum(1).mean()),
                   "evictions_per_row": float(np.asarray(merged.row_evictions).mean()),
                   **summarize(merged, BUCKETS)}
            with path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            done[(method, budget)] = row
            if progress is not None:
                progress(row)
    rows = [done[v] for v in variants if v in done]
    (out_dir / "replay.json").write_text(json.dumps({"task": cfg.task, "model": cfg.model, "rows": rows},
                                                    indent=2) + "\n")
    (out_dir / "replay.md").write_text(markdown(rows, cfg) + "\n")
    return rows


def markdown(rows: list[dict], cfg: EvalConfig) -> str:
    """One row per (method, budget): KL, top-1 agreement, NLL; then KL by position bucket."""
    lines = [f"## Teacher-forced replay: {cfg.task}, {len(rows[0]['by_position']) if rows else 0} position buckets",
             "", f"References: the full cache's greedy traces of {rows[0]['problems'] if rows else 0} problems "
             f"(mean {rows[0]['mean_reference_tokens']:.0f} tokens). KL(full || evicted) in nats per token."
             if rows else "", "",
             "| method | budget | KL | top-1 agreement | NLL (evicted) | NLL (full) | evictions/row |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['budget']} | {r['kl']:.4f} | {100 * r['agree']:.2f}% | {r['nll']:.4f} "
                     f"| {r['nll_full']:.4f} | {r['evictions_per_row']:.1f} |")
    if rows:
        spans = [(b["from"], b["to"]) for b in rows[0]["by_position"]]
        head = [f"{lo}-{hi if hi is not None else 'end'}" for lo, hi in spans]
        lines += ["", "KL by position of the continuation:", "",
                  "| method | budget | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(head)]
        for r in rows:
            cells = {(b["from"], b["to"]): b["kl"] for b in r["by_position"]}
            lines.append(f"| {r['method']} | {r['budget']} | " + " | ".join(
                "-" if cells.get(s) is None or math.isnan(cells[s]) else f"{cells[s]:.4f}" for s in spans) + " |")
    return "\n".join(lines)
