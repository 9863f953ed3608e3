"""Summaries of a run's records: `summary.json`, `summary.md` and two plots.

Per (method, budget), over the records the run asked for:

    pass@1 = mean_i a_i, SE = std(a, ddof=1) / sqrt(n), a_i = mean_j correct_ij   (`vase_jax.tasks.pass_at_1`)
    mean output tokens = mean over samples of the recorded tokens (cut at the cap, end token included)
    truncation rate    = share of samples with no end token within the cap
    tokens/s           = sum(tokens) / sum(seconds)   (a sample's seconds: its share of its batch's wall time,
                                                       compile time of a batch's first call included)
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path

from vase_jax.evaluation.config import EvalConfig
from vase_jax.evaluation.records import Key, RecordStore
from vase_jax.kvquant import BF16
from vase_jax.tasks import pass_at_1


def method_label(method: str, kv_bits: str) -> str:
    """A summary row's method column: the method, with its cache setting when it is not the 16-bit cache."""
    return method if kv_bits == BF16 else f"{method} {kv_bits}"


def summarize(cfg: EvalConfig, store: RecordStore, wanted: list[Key]) -> dict:
    """The summary dict of the records in `wanted` (keys missing from `store` are counted, not invented)."""
    groups: dict[tuple[str, int | None, str], list[dict]] = defaultdict(list)
    missing = 0
    for key in wanted:
        rec = store.records.get(key)
        if rec is None:
            missing += 1
        else:
            groups[key[2:]].append(rec)
    rows = []
    for method, budget, kv in cfg.variants:
        recs = groups.get((method, budget, kv), [])
        row = {"method": method, "budget": budget, "kv_bits": kv, "samples": len(recs)}
        if recs:
            by_problem: dict[str, list[bool]] = defaultdict(list)
            for r in recs:
                by_problem[r["problem_id"]].append(bool(r["correct"]))
            acc, se = pass_at_1(by_problem)
            seconds = sum(r["seconds"] for r in recs)
            tokens = sum(r["tokens"] for r in recs)
            row |= {
                "problems": len(by_problem), "pass_at_1": acc, "se": None if math.isnan(se) else se,
                "mean_tokens": tokens / len(recs),
                "truncation_rate": sum(r["truncated"] for r in recs) / len(recs),
                "tokens_per_s": tokens / seconds if seconds > 0 else None,
            }
        rows.append(row)
    return {"task": cfg.task, "model": cfg.model, "complete": missing == 0, "missing_samples": missing,
            "results": rows, "config": cfg.to_json()}


def _label(row: dict) -> str:
    return method_label(row["method"], row.get("kv_bits", BF16))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def markdown(summary: dict) -> str:
    """A method x budget pass@1 table, then one detail row per (method, budget)."""
    cfg = summary["config"]
    cap = (f"{cfg['max_new_tokens']} new tokens" if cfg["max_new_tokens"]
           else f"{cfg['max_total_tokens']} total tokens")
    lines = [
        f"# {summary['task']}: {summary['model']}",
        "",
        f"R = {cfg['samples']} samples per problem, {cap}, temperature {cfg['temperature']}, "
        f"top-p {cfg['top_p']}, top-k {cfg['top_k'] or 'off'}, buffer {cfg['buffer']}, value slots "
        f"{'N/4' if cfg['value_slots'] is None else cfg['value_slots']}, seed {cfg['seed']}, {cfg['dtype']}."
        + ("" if summary["complete"] else f" **Incomplete: {summary['missing_samples']} samples missing.**"),
        "",
    ]
    rows = summary["results"]
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    methods = list(dict.fromkeys(_label(r) for r in rows))
    by = {(_label(r), r["budget"]): r for r in rows}

    def cell(r: dict | None) -> str:
        if r is None or "pass_at_1" not in r:
            return ""
        se = "" if r["se"] is None else f" ± {_pct(r['se'])}"
        return f"{_pct(r['pass_at_1'])}{se}"

    unevicted = any(r["budget"] is None for r in rows)
    lines += ["pass@1 (%) ± SE by KV budget N (`full`: no eviction; K<bits>V<bits>: a mixed-precision cache, "
              f"{'the default' if cfg.get('kv_protected') is None else cfg['kv_protected']} 16-bit slots):", ""]
    lines += ["| method | " + " | ".join(["full"] * unevicted + [f"N={b}" for b in budgets]) + " |"]
    lines += ["|---" * (1 + unevicted + len(budgets)) + "|"]
    for m in methods:
        cells = [cell(by.get((m, None)))] if unevicted else []
        cells += [cell(by.get((m, b))) for b in budgets]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "| method | budget | pass@1 (%) | SE | problems | samples | mean output tokens "
              "| truncated (%) | tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "pass_at_1" not in r:
            lines.append(f"| {_label(r)} | {r['budget'] or '-'} | - | - | 0 | 0 | - | - | - |")
            continue
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}"
        lines.append(f"| {_label(r)} | {r['budget'] or '-'} | {_pct(r['pass_at_1'])} | {_pct(r['se'])} | "
                     f"{r['problems']} | {r['samples']} | {r['mean_tokens']:.1f} | "
                     f"{_pct(r['truncation_rate'])} | {tps} |")
    lines += ["", "tokens/s includes compile time; output tokens are cut at the cap and include the end "
              "token.", ""]
    return "\n".join(lines)


def plot(summary: dict, store: RecordStore, wanted: list[Key], out_dir: Path) -> list[Path]:
    """accuracy_vs_budget.png (pass@1 ± SE per method; `full` as a line) and output_lengths.png."""
    import matplotlib  # noqa: PLC0415 (the `eval` extra; only plots need it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in summary["results"] if "pass_at_1" in r]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        if r["budget"] is None:
            ax.axhline(100 * r["pass_at_1"], color="black", ls="--", lw=1.5, clip_on=False, label=_label(r))
    for m in dict.fromkeys(_label(r) for r in rows if r["budget"] is not None):
        pts = sorted((r["budget"], 100 * r["pass_at_1"], 100 * (r["se"] or 0.0)) for r in rows
                     if _label(r) == m and r["budget"] is not None)
        xs, ys, es = zip(*pts, strict=True)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=m)
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    if budgets:
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
    ax.set_xlabel("KV budget N (tokens)")
    ax.set_ylabel("pass@1 (%)")
    ax.set_ylim(0, 100)  # an error bar past 0 or 100 is cut, not the axis stretched
    ax.set_title(f"{summary['task']}: accuracy vs KV budget")
    if rows:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    paths = [out_dir / "accuracy_vs_budget.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    lengths: dict[str, dict[int | None, list[int]]] = defaultdict(lambda: defaultdict(list))
    for key in wanted:
        rec = store.records.get(key)
        if rec is not None:
            lengths[method_label(key[2], key[4])][key[3]].append(rec["tokens"])
    methods = list(lengths)
    cols = min(4, max(1, len(methods)))
    grid = max(1, -(-len(methods) // cols))
    fig, axes = plt.subplots(grid, cols, figsize=(4 * cols, 3.2 * grid), squeeze=False)
    for ax in axes.flat[len(methods):]:
        ax.set_visible(False)
    for ax, m in zip(axes.flat, methods, strict=False):
        for budget, vals in sorted(lengths[m].items(), key=lambda kv: kv[0] or 0):
            ax.hist(vals, bins=20, histtype="step", label="full" if budget is None else f"N={budget}")
        ax.set_title(m)
        ax.set_xlabel("output tokens")
        ax.legend(fontsize=7)  # every method here has at least one record
    for row in axes:
        row[0].set_ylabel("samples")
    fig.tight_layout()
    paths.append(out_dir / "output_lengths.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def write_summary(cfg: EvalConfig, store: RecordStore, wanted: list[Key], out_dir: Path,
                  plots: bool = True) -> dict:
    """Write summary.json, summary.md and (with `plots`) the two PNGs; return the summary."""
    summary = summarize(cfg, store, wanted)
    texts = {"summary.json": json.dumps(summary, indent=2) + "\n", "summary.md": markdown(summary)}
    for name, text in texts.items():
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out_dir / name)
    if plots:
        plot(summary, store, wanted, out_dir)
    return summary
