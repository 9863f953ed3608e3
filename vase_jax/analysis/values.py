"""Value caches -> per-layer statistics of quantization error against Range(v) (spec section 5), and the report.

For each generated sample and layer l, the value cache `v [Hkv, S, D]` is taken with its valid slots (position
>= 0, within the sample's output cap) minus the `sinks` smallest positions of each head (the attention sinks;
4 in the paper), flattened to `[Hkv * S, D]` rows (invalid rows masked, never counted), and quantized per
token in groups (`quant.hqq_quantize`, `quant.rtn_quantize`) for each `QuantConfig`, one call per (sample,
layer) as the reference quantizes each cache. Per token: MSE = mean_c (v - v_hat)^2 and Range = max_c v -
min_c v. Over all samples, tokens and heads of a layer, the Pearson correlation r(MSE, Range) is accumulated
exactly (in float64, merging per-sample centred sums with Chan's formula):

    n = n1 + n2, d_a = mean_a2 - mean_a1, d_b = mean_b2 - mean_b1
    C = C1 + C2 + d_a d_b n1 n2 / n,   M2_a = M2_a1 + M2_a2 + d_a^2 n1 n2 / n,   r = C / sqrt(M2_a M2_b).

The Range values themselves are kept per layer for their distribution (quantiles, maximum; the few very large
values are what VaSE protects).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from vase_jax.analysis.quant import QuantConfig, hqq_quantize, rtn_quantize, token_mse, token_range

METHODS = ("hqq", "rtn")
QUANTILES = (50.0, 90.0, 99.0, 99.9)


def value_rows(v: np.ndarray, pos: np.ndarray, max_pos: int | None = None, sinks: int = 4):
    """One layer and row of a cache: v [Hkv, S, D], pos [Hkv, S] -> (rows [Hkv * S, D], valid [Hkv * S]).

    Valid: pos >= 0, pos < max_pos (if given), and not one of the `sinks` smallest valid positions of its head.
    """
    v, pos = np.asarray(v), np.asarray(pos)
    if v.ndim != 3 or pos.shape != v.shape[:2]:
        raise ValueError(f"expected v [kv_heads, slots, head_dim] and pos [kv_heads, slots], got {v.shape}, "
                         f"{pos.shape}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks={sinks!r} must be an integer >= 0")
    valid = pos >= 0
    if max_pos is not None:
        valid &= pos < max_pos
    if sinks:
        key = np.where(valid, pos.astype(np.int64), np.iinfo(np.int64).max)
        rank = np.argsort(np.argsort(key, axis=1, kind="stable"), axis=1, kind="stable")
        valid &= rank >= sinks
    return v.reshape(-1, v.shape[-1]), valid.reshape(-1)


@functools.partial(jax.jit, static_argnames=("configs",))
def layer_stats(rows: jax.Array, valid: jax.Array, configs: tuple[QuantConfig, ...]):
    """rows [L, N, D], valid [L, N] -> (range [L, N], mse [L, len(configs), 2 (hqq, rtn), N]); one quantization
    call per layer (`lax.map`, so one layer's intermediates at a time)."""

    def one(args):
        x, ok = args
        mses = []
        for c in configs:
            hq = hqq_quantize(x, c.bits, c.group_size, True, ok, c.iters, c.lp_norm, c.beta)
            rt = rtn_quantize(x, c.bits, c.group_size)
            mses.append(jnp.stack([token_mse(x, hq), token_mse(x, rt)]))
        return token_range(x), jnp.stack(mses)

    return jax.lax.map(one, (rows, valid))


@dataclasses.dataclass
class Moments:
    """Running n, means, centred second moments and co-moment of pairs (a, b), merged exactly (Chan)."""

    n: float = 0.0
    mean_a: float = 0.0
    mean_b: float = 0.0
    m2_a: float = 0.0
    m2_b: float = 0.0
    c: float = 0.0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
        n2 = a.size
        if n2 == 0:
            return
        ma, mb = a.mean(), b.mean()
        da_, db_ = a - ma, b - mb
        m2a, m2b, c2 = float(da_ @ da_), float(db_ @ db_), float(da_ @ db_)
        n1, n = self.n, self.n + n2
        da, db = ma - self.mean_a, mb - self.mean_b
        self.mean_a += da * n2 / n
        self.mean_b += db * n2 / n
        self.m2_a += m2a + da * da * n1 * n2 / n
        self.m2_b += m2b + db * db * n1 * n2 / n
        self.c += c2 + da * db * n1 * n2 / n
        self.n = n

    @property
    def pearson(self) -> float:
        den = math.sqrt(self.m2_a * self.m2_b)
        return self.c / den if den > 0 else math.nan


class Accumulator:
    """Per-layer statistics over all samples (see the module docstring)."""

    def __init__(self, num_layers: int, configs: tuple[QuantConfig, ...], scatter_per_sample: int = 500,
                 seed: int = 0):
        self.configs = configs
        self.num_layers = num_layers
        self.moments = [[[Moments() for _ in METHODS] for _ in configs] for _ in range(num_layers)]
        self.ranges: list[list[np.ndarray]] = [[] for _ in range(num_layers)]
        self.scatter: list[list[np.ndarray]] = [[] for _ in range(num_layers)]  # (range, mse of configs[0] hqq)
        self.scatter_per_sample = scatter_per_sample
        self.rng = np.random.default_rng(seed)
        self.samples = 0

    def add(self, ranges: np.ndarray, mse: np.ndarray, valid: np.ndarray) -> None:
        """One sample: ranges [L, N], mse [L, C, 2, N], valid [L, N]."""
        ranges, mse, valid = np.asarray(ranges), np.asarray(mse), np.asarray(valid, bool)
        for layer in range(self.num_layers):
            ok = valid[layer]
            r = ranges[layer][ok]
            self.ranges[layer].append(r.astype(np.float32))
            for ci in range(len(self.configs)):
                for mi in range(len(METHODS)):
                    self.moments[layer][ci][mi].add(mse[layer, ci, mi][ok], r)
            take = self.rng.permutation(r.size)[: self.scatter_per_sample]
            self.scatter[layer].append(np.stack([r[take], mse[layer, 0, 0][ok][take]], axis=1))
        self.samples += 1

    def summary(self) -> dict:
        layers = []
        for layer in range(self.num_layers):
            r = np.concatenate(self.ranges[layer]) if self.ranges[layer] else np.zeros(0, np.float32)
            row = {"layer": layer, "tokens": int(r.size), "pearson": {}, "mean_mse": {}}
            for ci, c in enumerate(self.configs):
                for mi, m in enumerate(METHODS):
                    mom = self.moments[layer][ci][mi]
                    row["pearson"][f"{c.name}_{m}"] = _num(mom.pearson)
                    row["mean_mse"][f"{c.name}_{m}"] = _num(mom.mean_a if mom.n else math.nan)
            if r.size:
                qs = np.percentile(r.astype(np.float64), QUANTILES)
                row["range"] = {"mean": float(r.mean()), **{f"p{q:g}": float(v) for q, v in zip(QUANTILES, qs,
                                                                                                  strict=True)},
                                "max": float(r.max())}
                row["range"]["max_over_p50"] = _num(row["range"]["max"] / row["range"]["p50"]
                                                    if row["range"]["p50"] > 0 else math.nan)
            else:
                row["range"] = None
            layers.append(row)
        keys = [f"{c.name}_{m}" for c in self.configs for m in METHODS]
        mean_r = {k: _num(np.nanmean([row["pearson"][k] if row["pearson"][k] is not None else np.nan
                                      for row in layers])) for k in keys}
        return {"samples": self.samples, "configs": [c.name for c in self.configs], "methods": list(METHODS),
                "layers": layers, "mean_pearson": mean_r}


def _num(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def _fmt(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(summary: dict, header: str = "") -> str:
    """Tables: Pearson r(MSE, Range) per layer and config (HQQ and RTN), mean MSE, Range(v) distribution."""
    keys = [f"{c}_{m}" for c in summary["configs"] for m in summary["methods"]]
    cols = [f"{c} {m.upper()}" for c in summary["configs"] for m in summary["methods"]]
    lines = [header, ""] if header else []
    lines += ["## Pearson correlation of per-token quantization MSE with Range(v)", "",
              "| layer | tokens | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for row in summary["layers"]:
        lines.append(f"| {row['layer']} | {row['tokens']} | "
                     + " | ".join(_fmt(row["pearson"][k]) for k in keys) + " |")
    lines.append("| mean | | " + " | ".join(_fmt(summary["mean_pearson"][k]) for k in keys) + " |")
    lines += ["", "## Mean per-token MSE", "", "| layer | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for row in summary["layers"]:
        lines.append(f"| {row['layer']} | " + " | ".join(
            "-" if row["mean_mse"][k] is None else f"{row['mean_mse'][k]:.3e}" for k in keys) + " |")
    qcols = ["mean", *(f"p{q:g}" for q in QUANTILES), "max", "max_over_p50"]
    lines += ["", "## Range(v) = max_c v - min_c v per token (sinks dropped)", "",
              "| layer | " + " | ".join(qcols) + " |", "|---|" + "---|" * len(qcols)]
    for row in summary["layers"]:
        rng = row["range"] or {}
        lines.append(f"| {row['layer']} | " + " | ".join(_fmt(rng.get(q)) for q in qcols) + " |")
    return "\n".join(lines) + "\n"


def write_report(acc: Accumulator, out: Path, meta: dict) -> dict:
    """Write out/summary.json, out/summary.md and three plots; returns the summary dict."""
    out.mkdir(parents=True, exist_ok=True)
    summary = acc.summary() | {"meta": meta}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    header = (f"# Value quantization vs Range(v): {meta.get('model')} on {meta.get('task')}\n\n"
              f"{summary['samples']} samples (one per question), full KV cache, {meta.get('sinks')} sink tokens "
              "dropped; HQQ = min-max quantization with the half-quadratic zero-point refinement, RTN = without it.")
    (out / "summary.md").write_text(markdown(summary, header))
    _plots(acc, summary, out)
    return summary


def _plots(acc: Accumulator, summary: dict, out: Path) -> None:
    import matplotlib  # noqa: PLC0415 (the `eval` extra; only plots need it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    layers = [row["layer"] for row in summary["layers"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for ci, c in enumerate(summary["configs"]):
        for m, style in zip(METHODS, ("-", "--"), strict=True):
            ys = [np.nan if row["pearson"][f"{c}_{m}"] is None else row["pearson"][f"{c}_{m}"]
                  for row in summary["layers"]]
            ax.plot(layers, ys, style, marker="o", ms=3, color=f"C{ci}", label=f"{c} {m.upper()}")
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("Pearson r(MSE, Range)")
    ax.set_title("Per-token quantization error vs Range(v)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "pearson_per_layer.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, key in enumerate(["p50", "p90", "p99", "p99.9", "max"]):
        ys = [np.nan if row["range"] is None else row["range"][key] for row in summary["layers"]]
        ax.plot(layers, ys, marker="o", ms=3, color=f"C{i}", label=key)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("Range(v)")
    ax.set_title("Distribution of per-token Range(v)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "range_per_layer.png", dpi=120)
    plt.close(fig)

    picks = sorted({0, len(layers) // 3, 2 * len(layers) // 3, len(layers) - 1})
    fig, axes = plt.subplots(1, len(picks), figsize=(3.2 * len(picks), 3.2), squeeze=False)
    for ax, layer in zip(axes[0], picks, strict=True):
        pts = np.concatenate(acc.scatter[layer]) if acc.scatter[layer] else np.zeros((0, 2))
        ax.scatter(pts[:, 0], pts[:, 1], s=2, alpha=0.4)
        r = summary["layers"][layer]["pearson"][f"{summary['configs'][0]}_hqq"]
        ax.set_title(f"layer {layer}: r = {_fmt(r, 2)}", fontsize=9)
        ax.set_xlabel("Range(v)")
        if pts.size and (pts > 0).all():
            ax.set_xscale("log")
            ax.set_yscale("log")
    axes[0][0].set_ylabel(f"MSE ({summary['configs'][0]} HQQ)")
    fig.tight_layout()
    fig.savefig(out / "mse_vs_range.png", dpi=120)
    plt.close(fig)
