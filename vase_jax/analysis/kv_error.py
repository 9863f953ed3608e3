"""Attention-output error of a quantized KV cache against the 16-bit cache, per layer, with and without protection.

For one sequence (a prompt and its generated text) the model runs one prefill over all its tokens, one layer at a
time (`kv_error`). At each layer l, `vase_jax.model.project` on the layer's input gives the model's own post-RoPE
queries q, keys k and values v in the model's dtype (exactly what the prefill writes into the cache); the layer
itself (`vase_jax.model.decoder_layer`) then gives the next layer's input. From these, the attention output of
the evaluated queries over their causal prefix is computed in float32 in three forms (`attention_forms`):

    reference     o   = softmax(q K^T / sqrt(d)) V                       K, V the 16-bit cache (cast to float32)
    unprotected   o_u = softmax(q K_hat^T / sqrt(d)) V_hat               every token quantized
    protected     o_p = softmax(q K_p^T / sqrt(d)) V_p                   K_p, V_p: 16-bit where protected, else hat

where x_hat = dequantize(quantize(x)) (`vase_jax.kvquant`, per token and kv head in groups of channels, at the
setting's bits; a 16-bit side is not quantized). So the forms differ only by the quantization.

Protection, for the query at position t (prefix length t + 1), per kv head:

    sinks      positions j < sinks (4)
    recent     positions t - buffer < j <= t (the `buffer` most recent tokens, the query's own included)
    top Range  among the other prefix positions, the floor(protected * (t + 1)) with the largest
               Range(v_j) = max_c v_j,c - min_c v_j,c (from the 16-bit value; ties: the earlier position)

are kept in 16 bits (as VaSE keeps Nv = N / 4 of a budget of N; here the budget is the whole prefix); every other
token of the prefix is quantized. With protected = 1 every token is in 16 bits and o_p = o exactly.

Queries: the last `queries` positions of the sequence (default 256: the latest decode steps, each over the
longest prefixes), each over its own causal prefix; `queries=None` evaluates every position.

Metric per layer, over the evaluated queries, every query head and channel (pooled over sequences by summing):

    relative error = ||o_hat - o||_F / ||o||_F = sqrt(sum (o_hat - o)^2 / sum o^2)
    cosine         = mean over (query, head) of <o_hat, o> / (|o_hat| |o|)

and the share of the prefix kept in 16 bits by protection (mean over queries and kv heads).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from vase_jax import kvquant
from vase_jax.analysis.quant import token_range
from vase_jax.config import Qwen3Config
from vase_jax.kvquant import KVBits
from vase_jax.model import decoder_layer, project, rms_norm
from vase_jax.target import Target

FORMS = ("unprotected", "protected")
PROTECTED = 0.25  # the paper's Nv = N / 4
SINKS = 4
BUFFER = 64
QUERIES = 256
BLOCK = 128  # queries per block of the attention (bounds the [kv_heads, group, block, tokens] logits)
PAD_TO = 256  # sequences are padded at the end to a multiple of this: one compile per length bucket


def parse_settings(text: str, head_dim: int | None = None) -> tuple[KVBits, ...]:
    """"K8V8,K8V4,K4V4g32" -> validated `KVBits` settings; ValueError naming the bad item."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError("empty list of settings")
    out = []
    for item in items:
        try:
            bits = KVBits.parse(item).validate(head_dim)
        except ValueError as e:
            raise ValueError(f"{item!r}: {e}") from None
        if not bits.quantizes:
            raise ValueError(f"{item!r}: quantizes nothing (the reference is the 16-bit cache)")
        out.append(bits)
    names = [b.name for b in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"repeated setting {', '.join(dup)}")
    return tuple(out)


def dequantized(x: jax.Array, bits: int, group: int | None, refine: bool = False) -> jax.Array:
    """x [..., D] -> dequantize(quantize(x)) in float32 (`scale` and `low` stored in x's dtype, as the cache stores
    them); at 16 bits x itself in float32."""
    if bits == 16:
        return x.astype(jnp.float32)
    return kvquant.dequantize(kvquant.quantize(x, bits, group, refine=refine), jnp.float32)


def protection(ranges: jax.Array, qpos: jax.Array, protected, sinks: int, buffer: int) -> jax.Array:
    """Which prefix tokens each query keeps in 16 bits (module docstring): ranges [kv_heads, T] (Range(v) per
    token), qpos [Tq] (query positions, >= 0) -> bool [kv_heads, Tq, T] (False outside the causal prefix)."""
    t = ranges.shape[-1]
    j = jnp.arange(t)
    causal = j[None, :] <= qpos[:, None]  # [Tq, T]
    always = causal & ((j[None, :] < sinks) | (j[None, :] > qpos[:, None] - buffer))  # sinks and recent
    cand = causal & ~always  # [Tq, T]
    count = jnp.floor(protected * (qpos + 1).astype(jnp.float32)).astype(jnp.int32)  # [Tq]
    score = jnp.where(cand[None], ranges.astype(jnp.float32)[:, None, :], -jnp.inf)  # [kv_heads, Tq, T]
    order = jnp.argsort(-score, axis=-1, stable=True)  # largest Range first; ties: the earlier position
    top = jnp.broadcast_to(j[None, None, :] < count[None, :, None], order.shape)  # [kv_heads, Tq, T], sorted order
    chosen = jnp.put_along_axis(jnp.zeros(order.shape, bool), order, top, axis=-1, inplace=False)
    return always[None] | (cand[None] & chosen)


def attention_forms(q: jax.Array, k: jax.Array, v: jax.Array, hats: tuple[tuple[jax.Array, jax.Array], ...],
                    qpos: jax.Array, protected, sinks: int = SINKS, buffer: int = BUFFER):
    """The three attention outputs of the module docstring, in float32.

    q [kv_heads, group, Tq, D]: the queries at positions qpos [Tq] (each >= 0); k, v [kv_heads, T, D]: the 16-bit
    cache; hats: per setting (k_hat, v_hat), each [kv_heads, T, D] float32 (`dequantized`).
    Returns (o [kv_heads, group, Tq, D], o_hat [settings, 2 (unprotected, protected), kv_heads, group, Tq, D],
    kept [kv_heads, Tq]: tokens of each query's prefix kept in 16 bits by protection).

    With m the protection mask, the protected form's logits are those of K where m, of K_hat elsewhere, and with p
    its probabilities o_p = (p * m) V + (p * (1 - m)) V_hat: where every token is protected, p and o_p are
    computed exactly as o is (o_p = o bit for bit).
    """
    scale = q.shape[-1] ** -0.5
    q32, k32, v32 = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
    causal = jnp.arange(k.shape[1])[None, :] <= qpos[:, None]  # [Tq, T]
    prot = protection(token_range(v), qpos, protected, sinks, buffer)  # [kv_heads, Tq, T]

    def logits(keys):  # [kv_heads, T, D] -> masked [kv_heads, group, Tq, T]
        s = jnp.einsum("hgqd,hkd->hgqk", q32, keys, preferred_element_type=jnp.float32) * scale
        return jnp.where(causal, s, -jnp.inf)

    def weighted(p, values):  # [kv_heads, group, Tq, T] x [kv_heads, T, D] -> [kv_heads, group, Tq, D]
        return jnp.einsum("hgqk,hkd->hgqd", p, values, preferred_element_type=jnp.float32)

    ref_logits = logits(k32)
    o = weighted(jax.nn.softmax(ref_logits, axis=-1), v32)
    outs = []
    for k_hat, v_hat in hats:
        hat_logits = logits(k_hat)
        o_u = weighted(jax.nn.softmax(hat_logits, axis=-1), v_hat)
        p = jax.nn.softmax(jnp.where(prot[:, None], ref_logits, hat_logits), axis=-1)
        o_p = weighted(jnp.where(prot[:, None], p, 0.0), v32) + weighted(jnp.where(prot[:, None], 0.0, p), v_hat)
        outs.append(jnp.stack([o_u, o_p]))
    return o, jnp.stack(outs), prot.sum(-1)


def layer_errors(q: jax.Array, k: jax.Array, v: jax.Array, qidx: jax.Array, valid: jax.Array,
                 settings: tuple[KVBits, ...], protected, sinks: int = SINKS, buffer: int = BUFFER,
                 block: int = BLOCK) -> dict[str, jax.Array]:
    """Sums of one layer over the evaluated queries (module docstring).

    q [kv_heads, group, T, D], k, v [kv_heads, T, D]: the layer's queries, keys and values of every position;
    qidx [Tq] (Tq a multiple of `block`): the evaluated positions, valid [Tq]: which of them count.
    Returns err2 [S, 2] = sum (o_hat - o)^2, ref2 = sum o^2, cos [S, 2] = sum of per-(query, head) cosines,
    count = evaluated (query, query head) pairs, kept = sum over (query, kv head) of the 16-bit share of the prefix.
    """
    hats = tuple((dequantized(k, s.key_bits, s.group("key"), s.refine),
                  dequantized(v, s.value_bits, s.group("value"), s.refine)) for s in settings)
    qpos = jnp.clip(qidx, 0, k.shape[1] - 1)
    blocks = qpos.reshape(-1, block), valid.reshape(-1, block)  # [blocks, block] each

    def one(args):
        pos, ok = args
        qb = jnp.take(q, pos, axis=2)  # [kv_heads, group, block, D]
        o, o_hat, kept = attention_forms(qb, k, v, hats, pos, protected, sinks, buffer)
        w = ok.astype(jnp.float32)[:, None]  # [block, 1] against [..., Tq, D]
        diff = o_hat - o  # [S, 2, kv_heads, group, block, D]
        dot = jnp.sum(o_hat * o, -1)  # [S, 2, kv_heads, group, block]
        norms = jnp.linalg.norm(o_hat, axis=-1) * jnp.linalg.norm(o, axis=-1)
        cos = dot / jnp.maximum(norms, jnp.finfo(jnp.float32).tiny)
        share = kept / (pos + 1).astype(jnp.float32)  # [kv_heads, block]
        return {"err2": jnp.sum(diff * diff * w, axis=(2, 3, 4, 5)), "ref2": jnp.sum(o * o * w),
                "cos": jnp.sum(cos * w[:, 0], axis=(2, 3, 4)), "count": jnp.sum(ok) * q.shape[0] * q.shape[1],
                "kept": jnp.sum(share * w[:, 0])}

    per_block = jax.lax.map(one, blocks)
    return {name: x.sum(0) for name, x in per_block.items()}


def layer_qkv(cfg: Qwen3Config, w: dict[str, jax.Array], x: jax.Array, positions: jax.Array,
              target: Target | None = None):
    """The hook into one layer of a causal prefill over one unpadded sequence: its input x [1, T, embed] ->
    (q [1, kv_heads, group, T, D], k and v [1, kv_heads, T, D], the next layer's input [1, T, embed]).

    q, k, v are `vase_jax.model.project` of the layer's normed input (post-RoPE, the model's dtype: what the
    prefill writes into the cache); the next input is `vase_jax.model.decoder_layer` itself.
    """
    q, k, v = project(cfg, w, rms_norm(x, w["input_norm"], cfg.rms_norm_eps), positions, target)
    t = x.shape[1]
    mask = jnp.tril(jnp.ones((t, t), bool))[None]  # [1, T, T] causal
    x_next, _ = decoder_layer(cfg, w, x, positions, mask, None, 0, "auto", target)
    return q, k, v, x_next


@functools.partial(jax.jit, static_argnames=("cfg", "settings", "sinks", "buffer", "block", "target"))
def _layer_step(cfg, w, x, positions, qidx, valid, protected, settings, sinks, buffer, block, target):
    """One layer: its input x [1, T, embed] -> (the next layer's input, `layer_errors` of this layer)."""
    q, k, v, x_next = layer_qkv(cfg, w, x, positions, target)
    stats = layer_errors(q[0], k[0], v[0], qidx, valid, settings, protected, sinks, buffer, block)
    return x_next, stats


@dataclasses.dataclass
class KVErrorStats:
    """Per-layer sums over sequences (`layer_errors`), float64; `summary()` turns them into the metrics."""

    settings: tuple[KVBits, ...]
    num_layers: int
    protected: float = PROTECTED
    sinks: int = SINKS
    buffer: int = BUFFER
    queries: int | None = QUERIES
    sequences: int = 0
    err2: np.ndarray = None  # [L, S, 2]
    ref2: np.ndarray = None  # [L]
    cos: np.ndarray = None  # [L, S, 2]
    count: np.ndarray = None  # [L] (query, query head) pairs
    kept: np.ndarray = None  # [L] sum of 16-bit shares over (query, kv head)
    kept_count: np.ndarray = None  # [L] (query, kv head) pairs

    def __post_init__(self):
        s, n = len(self.settings), self.num_layers
        for name, shape in (("err2", (n, s, 2)), ("ref2", (n,)), ("cos", (n, s, 2)), ("count", (n,)),
                            ("kept", (n,)), ("kept_count", (n,))):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(shape, np.float64))

    def add(self, layer: int, stats: dict, kv_heads: int, group: int) -> None:
        stats = {k: np.asarray(v, np.float64) for k, v in jax.device_get(stats).items()}
        self.err2[layer] += stats["err2"]
        self.ref2[layer] += stats["ref2"]
        self.cos[layer] += stats["cos"]
        self.count[layer] += stats["count"]
        self.kept[layer] += stats["kept"]
        self.kept_count[layer] += stats["count"] / group

    def summary(self) -> dict:
        """{"settings", "forms", "layers": [{"layer", "queries", "rel_error": {setting: {form: x}}, "cosine": ...,
        "kept_16bit": share}], "mean": {"rel_error": ..., "cosine": ...}, protection parameters}."""
        names = [s.name for s in self.settings]
        layers = []
        for layer in range(self.num_layers):
            n = self.count[layer]
            rel = {name: {f: _num(math.sqrt(self.err2[layer, si, fi] / self.ref2[layer]) if self.ref2[layer] > 0
                                  else math.nan) for fi, f in enumerate(FORMS)} for si, name in enumerate(names)}
            cos = {name: {f: _num(self.cos[layer, si, fi] / n if n else math.nan) for fi, f in enumerate(FORMS)}
                   for si, name in enumerate(names)}
            kc = self.kept_count[layer]
            layers.append({"layer": layer, "pairs": int(n), "rel_error": rel, "cosine": cos,
                           "kept_16bit": _num(self.kept[layer] / kc if kc else math.nan)})

        def mean(key):
            return {name: {f: _num(np.nanmean([np.nan if row[key][name][f] is None else row[key][name][f]
                                               for row in layers])) for f in FORMS} for name in names}

        return {"settings": names, "forms": list(FORMS), "protected": self.protected, "sinks": self.sinks,
                "buffer": self.buffer, "queries": self.queries, "sequences": self.sequences, "layers": layers,
                "mean": {"rel_error": mean("rel_error"), "cosine": mean("cosine")}}


def _num(x) -> float | None:
    x = float(x)
    return None if math.isnan(x) else x


def _padded(n: int, pad_to: int) -> int:
    return max(pad_to, -(-n // pad_to) * pad_to)


def kv_error(model, tokens, settings: tuple[KVBits, ...], *, protected: float = PROTECTED, sinks: int = SINKS,
             buffer: int = BUFFER, queries: int | None = QUERIES, stats: KVErrorStats | None = None,
             block: int = BLOCK, pad_to: int = PAD_TO) -> KVErrorStats:
    """Add one sequence's per-layer attention-output errors (module docstring) to `stats` (a new one if None).

    model: a `vase_jax.Qwen3`; tokens [T] int: one sequence, prompt and generated text, no padding; settings:
    validated `KVBits` (each quantizing something). The sequence is padded at its end to a multiple of `pad_to`
    (causal: its positions are unaffected) so that one compiled layer step serves a bucket of lengths.
    """
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    n = tokens.size
    if n == 0:
        raise ValueError("kv_error: empty sequence")
    if not 0.0 <= protected <= 1.0:
        raise ValueError(f"protected={protected!r} must be in [0, 1]")
    if sinks < 0 or buffer < 0:
        raise ValueError(f"sinks={sinks}, buffer={buffer} must be >= 0")
    if queries is not None and queries < 1:
        raise ValueError(f"queries={queries!r} must be >= 1 (None: every position)")
    cfg = model.cfg
    settings = tuple(s.validate(cfg.head_dim) for s in settings)
    if stats is None:
        stats = KVErrorStats(settings, cfg.num_layers, protected, sinks, buffer, queries)
    elif stats.settings != settings or stats.num_layers != cfg.num_layers:
        raise ValueError("kv_error: stats were made for other settings or another model")
    t = _padded(n, pad_to)
    count = min(queries, t) if queries is not None else t
    blk = min(block, count)
    tq = -(-count // blk) * blk
    qidx = n - count + np.arange(tq, dtype=np.int32)  # [Tq] the last `count` positions (and some past the end)
    valid = (qidx >= 0) & (qidx < n)
    ids = np.zeros((1, t), np.int32)
    ids[0, :n] = tokens
    positions = jnp.arange(t, dtype=jnp.int32)[None]  # [1, T]
    target = Target.of(model.embedding[...])
    x = model.embed(jnp.asarray(ids), target)  # [1, T, embed]
    for layer, w in enumerate(model.layer_weights()):
        x, layer_stats = _layer_step(cfg, w, x, positions, jnp.asarray(qidx), jnp.asarray(valid),
                                     jnp.float32(protected), settings, sinks, buffer, blk, target)
        stats.add(layer, layer_stats, cfg.num_kv_heads, cfg.group)
    stats.sequences += 1
    return stats


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def markdown(summary: dict) -> str:
    """The per-layer table: relative error ||o_hat - o||_F / ||o||_F per setting, unprotected and protected."""
    names = summary["settings"]
    cols = [f"{n} {'unprot' if f == 'unprotected' else 'prot'}" for n in names for f in FORMS]
    q = summary["queries"]
    lines = ["## Attention-output error of the quantized KV cache against the 16-bit cache", "",
             f"{summary['sequences']} sequences, {'every position' if q is None else f'the last {q} positions'} "
             "as queries, each over its causal prefix; relative error ||o_hat - o||_F / ||o||_F per layer (attention "
             "in float32, the model's own Q/K/V). prot: the top "
             f"{summary['protected']:g} of each prefix by Range(v), the first {summary['sinks']} sink tokens and the "
             f"{summary['buffer']} most recent tokens kept in 16 bits; unprot: every token quantized. "
             "16-bit share: the part of a prefix kept in 16 bits by protection.", "",
             "| layer | " + " | ".join(cols) + " | 16-bit share |", "|---|" + "---|" * (len(cols) + 1)]
    for row in summary["layers"]:
        lines.append(f"| {row['layer']} | " + " | ".join(_fmt(row["rel_error"][n][f]) for n in names for f in FORMS)
                     + f" | {_fmt(row['kept_16bit'])} |")
    mean = summary["mean"]["rel_error"]
    lines.append("| mean | " + " | ".join(_fmt(mean[n][f]) for n in names for f in FORMS) + " | |")
    return "\n".join(lines) + "\n"
