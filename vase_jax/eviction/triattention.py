"""TriAttention (Mao et al., arXiv 2604.04921): keys scored against offline statistics of the model's queries.

Calibration (`vase_jax.calibration`, `scripts/calibrate.py`) stores, for every layer l and query head h, the mean
of the pre-RoPE query as F = D/2 complex numbers in the rotate-half layout, q_f = q[f] + i q[f + F], and the
mean of their moduli:

    qbar[l, h, f] = E_t q_{t,f}            qabs[l, h, f] = E_t |q_{t,f}|

At an eviction, with t0 the position of the row's next token, a key k (post-RoPE, as cached; k_f its complex
pairs) is scored as the expected RoPE logit of a "mean query" placed at the future distances o in
O = {1, 2, 4, ..., offset_max}, plus a norm term:

    S_o(k) = sum_f Re(qbar_f * conj(k_f) * e^{i (t0 + o) w_f}) + sum_f (qabs_f - |qbar_f|) |k_f|
    score  = mean_o S_o   ("mean", the reference's default: e^{i t0 w_f} times the constant mean_o e^{i o w_f})
           | max_o S_o    ("max")

w_f = theta^(-2f/D), the model's RoPE frequencies. This is the reference's formula (which un-rotates the keys and
uses the distance t0 - p + o) with the rotation folded in: conj(k_f) = conj(kpre_f) e^{-i p w_f}.

Then, as the authors' HF code does (its experiment harness defaults are our defaults):
- only the decode slots (position >= the row's prompt length P) are scored; every prompt slot is kept and
  counts against the budget (the prompt is never evicted; if P >= N the first N prompt slots are kept);
- `normalize`: each (layer, query head) row of scores is z-normalised over the row's scored slots (population
  standard deviation, at least 1e-6);
- `mode` says how the query heads and layers agree on one kept set:
    "per_head"           (harness default) per kv head g: mean over layers of the max over g's query heads;
                         one kept set per kv head, shared by every layer
    "union"              the max over every layer and query head; one kept set shared by every kv head and
                         layer, stored in slot order
    "per_layer_perhead"  each (layer, kv head) on its own: the max (or mean, `head_aggregation`) over g's heads
- no recent window: the newest B tokens compete with the rest (`keep_recent=True` keeps them, as the vLLM port's
  window of 128 does); the trigger is the framework's (every B decoded tokens once the cache holds N + B: the
  reference's slack trigger with divide_length = B).
- ties go to the lower slot (the reference adds 1e-6 uniform noise from a torch generator, which cannot be
  reproduced; TensorRT-LLM breaks ties by the lower index too). The method is deterministic.

The authors' defaults (Qwen3-8B, AIME): `EvictionConfig("triattention", budget=2048, buffer=128,
calibration=...)`, i.e. mode "per_head", normalize, offsets to 65536, mean, no recent window.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from vase_jax.eviction import scores
from vase_jax.eviction.registry import EvictionInputs, register
from vase_jax.sharding import across_model, local_kv_heads

FORMAT = "vase-jax-triattention"
FORMAT_VERSION = 1
STATS_FILE = "triattention_stats.npz"  # the calibration's file name inside a model folder
MODES = ("per_head", "union", "per_layer_perhead")
OFFSET_AGGREGATIONS = ("mean", "max")
HEAD_AGGREGATIONS = ("max", "mean")


def calibrate_command(model: str = "MODEL") -> str:
    return f"python scripts/calibrate.py --model {model}"


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Per-(layer, query head) query statistics: `q_mean` complex64 [layers, heads, F], `q_abs_mean` float32
    [layers, heads, F] (F = head_dim / 2), and what they were computed from (`meta`: the model's sizes and RoPE
    theta, the tokens and sequences seen, the source)."""

    q_mean: np.ndarray
    q_abs_mean: np.ndarray
    meta: dict

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.q_abs_mean.shape)


def save_calibration(path: str, calibration: Calibration) -> str:
    """Write `calibration` to `path` (a .npz; a folder gets `STATS_FILE` inside it). Returns the file's path."""
    path = stats_path(path)
    meta = {"format": FORMAT, "version": FORMAT_VERSION} | calibration.meta
    tmp = path + ".tmp.npz"
    np.savez(tmp, q_mean_real=calibration.q_mean.real.astype(np.float32),
             q_mean_imag=calibration.q_mean.imag.astype(np.float32),
             q_abs_mean=calibration.q_abs_mean.astype(np.float32), meta=np.array(json.dumps(meta, sort_keys=True)))
    os.replace(tmp, path)
    return path


def stats_path(location: str) -> str:
    """The statistics file of `location`: the file itself, or `STATS_FILE` in a folder (a model's)."""
    location = os.path.abspath(os.path.expanduser(location))
    return os.path.join(location, STATS_FILE) if os.path.isdir(location) else location


def load_calibration(location: str) -> Calibration:
    """Read a statistics file (or a model folder's); ValueError naming the file and the command that makes one."""
    path = stats_path(location)
    if not os.path.isfile(path):
        model = os.path.dirname(path) if path.endswith(STATS_FILE) else "MODEL"
        raise ValueError(f"EvictionConfig.calibration={location!r}: no TriAttention calibration at {path}; make "
                         f"one with `{calibrate_command(model)}` (--out FILE to write it elsewhere)")
    stat = os.stat(path)
    return _load(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int, size: int) -> Calibration:  # keyed by the file's identity: a rewrite reloads
    del mtime_ns, size
    try:
        with np.load(path) as data:
            meta = json.loads(str(data["meta"]))
            q_mean = (data["q_mean_real"] + 1j * data["q_mean_imag"]).astype(np.complex64)
            q_abs_mean = data["q_abs_mean"].astype(np.float32)
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"TriAttention calibration {path}: unreadable ({e}); remake it with "
                         f"`{calibrate_command()}`") from None
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"TriAttention calibration {path}: format {meta.get('format')!r} version "
                         f"{meta.get('version')!r}; this library reads {FORMAT!r} version {FORMAT_VERSION}: remake "
                         f"it with `{calibrate_command()}`")
    if q_mean.shape != q_abs_mean.shape or q_mean.ndim != 3:
        raise ValueError(f"TriAttention calibration {path}: arrays of shapes {q_mean.shape} and {q_abs_mean.shape}; "
                         "expected two equal [layers, heads, head_dim / 2]")
    return Calibration(q_mean, q_abs_mean, meta)


@dataclasses.dataclass(frozen=True)
class TriAttentionOptions:
    calibration: str | None = None  # a statistics file, or the model folder that holds `STATS_FILE`
    mode: str = "per_head"  # per_head | union | per_layer_perhead
    keep_recent: bool = False  # True: the newest B tokens are kept unscored (the vLLM port's window)
    normalize: bool = True  # z-score each (layer, query head) row over the scored slots
    offset_max: int = 65536  # future offsets 1, 2, 4, ..., <= offset_max
    offset_aggregation: str = "mean"  # mean | max over the offsets
    head_aggregation: str = "max"  # per_layer_perhead: max | mean over a kv head's query heads

    def validate(self, config) -> None:
        if self.calibration is None:
            raise ValueError(f"EvictionConfig(method='triattention') needs calibration=<statistics file or model "
                             f"folder>; make the statistics with `{calibrate_command()}`")
        for name, value, allowed in (("mode", self.mode, MODES),
                                     ("offset_aggregation", self.offset_aggregation, OFFSET_AGGREGATIONS),
                                     ("head_aggregation", self.head_aggregation, HEAD_AGGREGATIONS)):
            if value not in allowed:
                raise ValueError(f"EvictionConfig.{name}={value!r}; allowed: {', '.join(allowed)}")
        if isinstance(self.offset_max, bool) or not isinstance(self.offset_max, int) or self.offset_max < 1:
            raise ValueError(f"EvictionConfig.offset_max={self.offset_max!r} must be an integer >= 1")
        for name in ("keep_recent", "normalize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EvictionConfig.{name}={getattr(self, name)!r} must be True or False")
        load_calibration(self.calibration)

    def recent_slots(self, config) -> int:
        """The newest slots kept unscored (`EvictionConfig.recent`): B with `keep_recent`, else none."""
        return config.buffer if self.keep_recent else 0

    def check_model(self, cfg) -> None:
        """The statistics must be of this model's shape and RoPE (ValueError before anything compiles)."""
        cal = load_calibration(self.calibration)
        want = (cfg.num_layers, cfg.num_heads, cfg.head_dim // 2)
        if cal.shape != want or float(cal.meta.get("rope_theta", cfg.rope_theta)) != float(cfg.rope_theta):
            raise ValueError(f"EvictionConfig.calibration={self.calibration!r}: statistics of shape {cal.shape} "
                             f"(rope_theta {cal.meta.get('rope_theta')}) for a model of [layers, heads, "
                             f"head_dim / 2] = {want} (rope_theta {cfg.rope_theta}); make them for this model "
                             f"with `{calibrate_command()}`")


def offsets(offset_max: int) -> np.ndarray:
    """The future distances 1, 2, 4, ..., <= offset_max (float64)."""
    return 2.0 ** np.arange(int(np.log2(offset_max)) + 1)


def frequencies(head_dim: int, theta: float) -> np.ndarray:
    """RoPE's w_f = theta^(-2f / D), f < D / 2, in float32 as the model has them."""
    return (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))).astype(np.float32)


def head_scores(inputs: EvictionInputs, options: TriAttentionOptions) -> jax.Array:
    """S [batch, kv_heads, group, L] float32 of every candidate for every query head of `inputs.layer`."""
    cal = load_calibration(options.calibration)
    b, local, _, d = inputs.keys.shape
    f = d // 2
    heads, kv_heads = local_kv_heads(local)  # under a mesh, this device's kv heads (global indices)
    group = cal.shape[1] // kv_heads

    def per_head(x: np.ndarray) -> jax.Array:  # [layers, q_heads, F] -> this layer's [local kv heads, group, F]
        x = jax.lax.dynamic_index_in_dim(jnp.asarray(x, jnp.float32), inputs.layer, axis=0, keepdims=False)
        return jnp.take(x.reshape(kv_heads, group, f), heads, axis=0)

    qbar_re, qbar_im = per_head(cal.q_mean.real), per_head(cal.q_mean.imag)
    mlr = per_head(cal.q_abs_mean - np.abs(cal.q_mean))

    keys = inputs.keys.astype(jnp.float32)
    k_re, k_im = keys[..., :f], keys[..., f:]  # [batch, kv_heads, L, F]
    norm_term = jnp.einsum("hgf,bhlf->bhgl", mlr, jnp.sqrt(k_re * k_re + k_im * k_im))

    theta = float(cal.meta["rope_theta"])
    w = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [F], as `vase_jax.model.rope` has them
    now = inputs.next_position.astype(jnp.float32)[:, None] * w  # [batch, F]: the model's RoPE angle of t0
    ahead = offsets(options.offset_max)[:, None] * frequencies(d, theta).astype(np.float64)  # [offsets, F]
    if options.offset_aggregation == "mean":
        ahead = np.exp(1j * ahead).mean(axis=0)[None]  # [1, F]: mean_o e^{i o w_f}, exact in float64
    else:
        ahead = np.exp(1j * ahead)  # [offsets, F]
    # M[b, o, f] = e^{i t0 w_f} * ahead[o, f]
    c, s = jnp.cos(now)[:, None], jnp.sin(now)[:, None]  # [batch, 1, F]
    a_re, a_im = jnp.asarray(ahead.real, jnp.float32), jnp.asarray(ahead.imag, jnp.float32)
    m_re, m_im = c * a_re - s * a_im, c * a_im + s * a_re  # [batch, offsets | 1, F]
    # a = qbar * M;  Re(a * conj(k)) = a_re k_re + a_im k_im
    p_re = qbar_re[None, None] * m_re[:, :, None, None] - qbar_im[None, None] * m_im[:, :, None, None]
    p_im = qbar_re[None, None] * m_im[:, :, None, None] + qbar_im[None, None] * m_re[:, :, None, None]
    trig = (jnp.einsum("bohgf,bhlf->bhgol", p_re, k_re) + jnp.einsum("bohgf,bhlf->bhgol", p_im, k_im))
    per_offset = trig + norm_term[:, :, :, None]  # [batch, kv_heads, group, offsets | 1, L]
    return per_offset.max(axis=3) if options.offset_aggregation == "max" else per_offset[:, :, :, 0]


def scored_slots(inputs: EvictionInputs) -> jax.Array:
    """[batch, kv_heads, L] bool: the candidates the reference scores, its decode slots (position >= P)."""
    return inputs.valid & (inputs.pos >= inputs.prompt_length[:, None, None])


def normalized_scores(inputs: EvictionInputs, options: TriAttentionOptions) -> jax.Array:
    """`head_scores`, z-normalised per (row, query head) over `scored_slots` with `normalize`; 0 elsewhere."""
    raw = head_scores(inputs, options)  # [batch, kv_heads, group, L]
    scored = scored_slots(inputs)[:, :, None]  # [batch, kv_heads, 1, L]
    if not options.normalize:
        return jnp.where(scored, raw, 0.0)
    count = jnp.maximum(scored.sum(axis=-1, keepdims=True), 1)
    mean = jnp.where(scored, raw, 0.0).sum(axis=-1, keepdims=True) / count
    var = jnp.where(scored, (raw - mean) ** 2, 0.0).sum(axis=-1, keepdims=True) / count
    return jnp.where(scored, (raw - mean) / jnp.maximum(jnp.sqrt(var), 1e-6), 0.0)


def layer_score(inputs: EvictionInputs, config) -> jax.Array:
    """The per-layer score that `across_layers` combines: per_head, the max over each kv head's query heads
    [batch, kv_heads, L]; union, the max over every query head (the same for every kv head)."""
    z = normalized_scores(inputs, config.options)  # [batch, kv_heads, group, L]
    if config.options.mode == "union":  # every head, those of the other devices too under a mesh
        return jnp.broadcast_to(across_model(z.max(axis=(1, 2)), jax.lax.pmax)[:, None], z.shape[:2] + z.shape[3:])
    return z.max(axis=2)


def across_layers(config) -> str:
    return {"per_head": "mean", "union": "max"}.get(config.options.mode, "")


@register("triattention", options=TriAttentionOptions, layer_score=layer_score, across_layers=across_layers,
          mixed_precision=False)
def triattention(inputs: EvictionInputs, config, key: jax.Array) -> jax.Array:
    """TriAttention: calibrated query statistics score the keys (RoPE as a trigonometric series); prompt kept."""
    del key
    options = config.options
    if inputs.shared_score is not None:
        score = inputs.shared_score
    else:  # per_layer_perhead
        z = normalized_scores(inputs, options)
        score = z.mean(axis=2) if options.head_aggregation == "mean" else z.max(axis=2)
    prompt = inputs.valid & ~scored_slots(inputs)
    kept = scores.masked_top_k(jnp.where(prompt, jnp.inf, score), inputs.valid, config.kept)
    return jnp.sort(kept, axis=2) if options.mode == "union" else kept
