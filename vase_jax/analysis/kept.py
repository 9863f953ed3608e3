"""Large-Range value tokens and what each eviction method keeps (`scripts/analyze.py --kept-methods`).

On the full cache's greedy traces of a set of prompts: every cached token's Range(v) = max_c v - min_c v per
(layer, kv head); per layer the tokens above the layer's `quantile` of Range are the "large-Range" ones (VaSE's
protected few). Where they are: their share by token kind (the tokenizer's text of the token) and among the first
`sinks` positions. What each method keeps: each method replays the same traces (`vase_jax.replay`, so its kept
sets are those it keeps on exactly these tokens) and its cache at the end of each trace is compared with the full
one: the share of large-Range tokens it kept, beside the share of all tokens it kept (the same number of slots
per head for every method: a method that ignored Range would keep both shares equal, on average).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import numpy as np

import vase_jax as vj
from vase_jax.replay import replay


def _token_kind(text: str) -> str:
    text = text.strip()
    if text.isdigit():
        return "digit"
    if text[:1].isalpha() and text[1:].isdigit():
        return "name"
    return text or "(space)"


def kept_vs_range(model, batch: vj.PromptBatch, tokenizer, methods: tuple[str, ...], budget: int, buffer: int,
                  config: vj.GenerateConfig, quantile: float = 99.0, sinks: int = 4, seed: int = 0) -> dict:
    """The report described in the module docstring, as a dict (JSON-ready). `config`: the traces' length and
    end tokens (they are decoded greedily whatever its sampling settings)."""
    config = dataclasses.replace(config, temperature=0.0, return_cache=True)
    full = vj.generate(model, batch.input_ids, batch.attention_mask, key=jax.random.key(seed), config=config)
    tokens, lengths = np.asarray(full.tokens), np.asarray(full.num_tokens)
    v = np.asarray(full.cache.v, np.float32)  # [layers, batch, kv_heads, capacity, head_dim]
    pos = np.asarray(full.cache.pos)  # [layers, batch, kv_heads, capacity]
    ranges = np.where(pos >= 0, v.max(-1) - v.min(-1), np.nan)  # [layers, batch, kv_heads, capacity]
    layers = ranges.shape[0]
    thresholds = np.nanpercentile(ranges.reshape(layers, -1), quantile, axis=1)  # [layers]
    large = ranges > thresholds[:, None, None, None]  # NaN compares False

    # the text of every cached token: the real prompt tokens then the generated ones, by RoPE position
    texts = []
    for r in range(tokens.shape[0]):
        ids = batch.input_ids[r][batch.attention_mask[r].astype(bool)].tolist() + tokens[r, :lengths[r]].tolist()
        texts.append([tokenizer.decode([i]) for i in ids])
    kinds = Counter()
    prompt_share = sink_share = 0
    prompt_lengths = batch.attention_mask.sum(1)
    for layer, r, h, s in zip(*np.nonzero(large), strict=True):
        p = int(pos[layer, r, h, s])
        kinds[_token_kind(texts[r][p]) if p < len(texts[r]) else "?"] += 1
        prompt_share += p < prompt_lengths[r]
        sink_share += p < sinks
    count = int(large.sum())
    where = {"large_tokens": count, "by_kind": {k: n / count for k, n in kinds.most_common()},
             "in_prompt": prompt_share / count, "in_first_sinks": sink_share / count, "sinks": sinks,
             "all_by_kind": _kinds_of_all(texts)}

    valid = pos >= 0
    kept_rows = []
    for method in methods:
        eviction = vj.EvictionConfig(method, budget=budget, buffer=buffer)
        out = replay(model, batch.input_ids, batch.attention_mask, tokens, lengths, key=jax.random.key(seed),
                     eviction=eviction, config=config, return_cache=True)
        held = np.asarray(out.cache.pos)  # [layers, batch, kv_heads, evicting capacity], -1 = empty
        # a full-cache entry is kept when its position is among the evicting cache's (same layer, row and head)
        kept = valid & (pos[..., :, None] == np.where(held >= 0, held, -2)[..., None, :]).any(-1)
        kept_rows.append({"method": method, "budget": budget, "kept_share_all": _share(kept, valid),
                          "kept_share_large": _share(kept & large, large),
                          "kept_share_large_per_layer": [_share(kept[i] & large[i], large[i]) for i in range(layers)]})
    return {"quantile": quantile, "thresholds": thresholds.tolist(), "where": where, "kept": kept_rows,
            "traces": int(tokens.shape[0]), "mean_trace_tokens": float(lengths.mean())}


def _share(part: np.ndarray, whole: np.ndarray) -> float | None:
    """part.sum() / whole.sum() as a float; None when `whole` is empty."""
    return float(part.sum() / whole.sum()) if whole.any() else None


def _kinds_of_all(texts: list[list[str]]) -> dict[str, float]:
    kinds = Counter(_token_kind(t) for row in texts for t in row)
    total = sum(kinds.values())
    return {k: n / total for k, n in kinds.most_common()}


def markdown(report: dict) -> str:
    """The report as markdown: where the large-Range tokens are, then the kept shares per method."""
    w = report["where"]
    lines = [f"## Large-Range value tokens (above each layer's p{report['quantile']:g} of Range(v)) and what each "
             "method keeps", "",
             f"{report['traces']} full-cache greedy traces (mean {report['mean_trace_tokens']:.0f} tokens); "
             f"{w['large_tokens']} large-Range (layer, kv head, token) entries; thresholds per layer: "
             + ", ".join(f"{t:.2f}" for t in report["thresholds"]) + ".", "",
             f"In the prompt: {100 * w['in_prompt']:.1f}%; among the first {w['sinks']} positions: "
             f"{100 * w['in_first_sinks']:.1f}%.", "",
             "| token kind | share of large-Range | share of all tokens |", "|---|---|---|"]
    for kind, share in w["by_kind"].items():
        lines.append(f"| {kind} | {100 * share:.1f}% | {100 * w['all_by_kind'].get(kind, 0.0):.1f}% |")
    lines += ["", "| method | budget | kept: all tokens | kept: large-Range tokens | per layer |",
              "|---|---|---|---|---|"]
    for r in report["kept"]:
        per = ", ".join("-" if x is None else f"{100 * x:.0f}%" for x in r["kept_share_large_per_layer"])
        large = "-" if r["kept_share_large"] is None else f"{100 * r['kept_share_large']:.1f}%"
        lines.append(f"| {r['method']} | {r['budget']} | {100 * r['kept_share_all']:.1f}% | {large} | {per} |")
    return "\n".join(lines)
