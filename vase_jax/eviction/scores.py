"""Shared, pure scoring and selection helpers of the eviction policies (spec sections 3.0-3.5 and 4.2).

Every function works on one layer's candidates, `[batch, kv_heads, L, ...]`, with a validity mask
`valid [batch, kv_heads, L]` (False for empty or padding slots). All scores are computed in float32 whatever
the cache dtype. Invalid candidates never influence a valid candidate's score, so an array with an invalid
(padded) prefix scores its valid part exactly like the unpadded array; invalid candidates score 0 (or are
masked out of top-k) themselves.

Selection helpers return indices into the candidate axis, `[batch, kv_heads, k]` int32, best (or first drawn)
first, always distinct. Three tiers order the candidates: *eligible* ones by their score, then *allowed* but
not eligible ones (typically invalid slots, only used when too few eligible ones exist, in slot order), never
the *excluded* ones (not allowed) unless k exceeds the allowed count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from vase_jax.eviction.window_score import window_score
from vase_jax.sampling import fold_rows
from vase_jax.sharding import local_kv_heads

MAGNITUDES = ("range", "l2", "var")

_F32 = jnp.float32
_SCORE_FLOOR = -1e30  # eligible scores are clamped above this, so they always beat the fallback tier
_FALLBACK = float(jnp.finfo(_F32).min)  # allowed-but-not-eligible tier
# eligible zero-weight entries get gumbel - 1e4: below every log(w) + gumbel with w > 0 (fp32 log w >= -104)
_ZERO_WEIGHT_OFFSET = -1e4


# ---- pooling -----------------------------------------------------------------------------------------------
def avg_pool(x: jax.Array, kernel: int = 5) -> jax.Array:
    """Average pool over the last axis, stride 1, zero padding kernel // 2 each side, always / `kernel`.

    out[j] = (1/kernel) * sum_{o=-p}^{p} x[j + o], with x[j + o] = 0 outside the array (torch `avg_pool1d`
    with `count_include_pad=True`). `kernel` must be odd so the output length equals the input length.
    """
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"avg_pool kernel={kernel}; allowed: a positive odd number")
    p = kernel // 2
    n = x.shape[-1]
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(p, p)])
    return sum(xp[..., o : o + n] for o in range(kernel)) / kernel


def max_pool(x: jax.Array, kernel: int) -> jax.Array:
    """Max pool over the last axis, stride 1, -inf padding kernel // 2 (torch `max_pool1d`); `kernel` odd."""
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"max_pool kernel={kernel}; allowed: a positive odd number")
    p = kernel // 2
    n = x.shape[-1]
    xp = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(p, p)], constant_values=-jnp.inf)
    out = xp[..., 0:n]
    for o in range(1, kernel):
        out = jnp.maximum(out, xp[..., o : o + n])
    return out


# ---- attention scores --------------------------------------------------------------------------------------
def _masked_softmax(logits: jax.Array, valid: jax.Array) -> jax.Array:
    """softmax over the last axis restricted to `valid` entries; invalid entries (all-invalid rows) give 0."""
    a = jax.nn.softmax(jnp.where(valid, logits, -jnp.inf), axis=-1)
    return jnp.where(valid, a, 0.0)


def window_logits(queries: jax.Array, keys: jax.Array, temperature: float = 1.0) -> jax.Array:
    """logits[b, h, g, t, j] = q[b, h, g, t] . k[b, h, j] / (sqrt(D) * temperature), in float32."""
    d = keys.shape[-1]
    lg = jnp.einsum("bhgwd,bhld->bhgwl", queries.astype(_F32), keys.astype(_F32))  # [b, h, g, W, L]
    return lg / (jnp.sqrt(jnp.asarray(d, _F32)) * temperature)


# The VaSE window-attention score s (spec 3.0): its equation, reference and kernel dispatch live in
# `vase_jax.eviction.window_score`; `impl` picks the kernel as for decode attention.
window_attention_score = window_score


# ---- value magnitude ---------------------------------------------------------------------------------------
def value_magnitude(values: jax.Array, kind: str) -> jax.Array:
    """Per-slot magnitude of the value vector over head_dim, float32 `[batch, kv_heads, L]`.

    range: max_c v[c] - min_c v[c];  l2: ||v||_2;
    var: sum_c (v[c] - mean v)^2 / (D - 1) (unbiased, the torch default).
    """
    v = values.astype(_F32)  # [b, h, L, D]
    if kind == "range":
        return v.max(-1) - v.min(-1)
    if kind == "l2":
        return jnp.sqrt(jnp.sum(v * v, axis=-1))
    if kind == "var":
        return jnp.var(v, axis=-1, ddof=1)
    raise ValueError(f"magnitude={kind!r}; allowed: {', '.join(MAGNITUDES)}")


# ---- R-KV redundancy ---------------------------------------------------------------------------------------
def _unit_keys(keys: jax.Array, valid: jax.Array) -> jax.Array:
    """kn_j = k_j / (||k_j|| + 1e-8) in float32, 0 on invalid slots.  [b, h, L, D]"""
    k = jnp.where(valid[..., None], keys.astype(_F32), 0.0)
    return k / (jnp.sqrt(jnp.sum(k * k, axis=-1, keepdims=True)) + 1e-8)


def rkv_redundancy(keys: jax.Array, valid: jax.Array) -> jax.Array:
    """VaSE's R-KV redundancy (spec 3.2a), closed form, float32 `[batch, kv_heads, L]`.

    C_ij = kn_i . kn_j (C_jj = 0),  red_j = softmax_{j valid}( (1/n) sum_{i valid} C_ij ),  n = #valid
         = softmax_j( (kn_j . sum_i kn_i - kn_j . kn_j) / n )            -- O(L D) instead of O(L^2 D)
    """
    kn = _unit_keys(keys, valid)  # [b, h, L, D]
    n = jnp.maximum(valid.sum(-1, keepdims=True).astype(_F32), 1.0)  # [b, h, 1]
    total = kn.sum(axis=2)  # [b, h, D]
    col_mean = (jnp.einsum("bhld,bhd->bhl", kn, total) - jnp.sum(kn * kn, axis=-1)) / n  # [b, h, L]
    return _masked_softmax(col_mean, valid)


def rkv_official_redundancy(keys: jax.Array, valid: jax.Array, threshold: float = 0.5) -> jax.Array:
    """Official R-KV redundancy (`cal_similarity`, retain_direction="last"; spec 3.2b), `[b, kv_heads, L]`.

        C = kn kn^T, C_ii = 0 (valid pairs only)
        last(i) = max{ j : C_ij > threshold }, or the first valid slot if there is none
                  (the original uses slot 0 there; on a padded prefix the first valid slot is its slot 0)
        C[i, last(i)] := 0
        R_j = softmax_{j valid}( (1/n) sum_{i valid} C_ij )

    O(L^2) per (row, kv head): computed one (row, kv head) at a time to bound memory.
    """
    b, h, length, d = keys.shape
    kn = _unit_keys(keys, valid).reshape(b * h, length, d)  # [b*h, L, D]
    vf = valid.reshape(b * h, length)  # [b*h, L]
    idx = jnp.arange(length)

    def one(args):
        k, v = args  # [L, D], [L]
        pair = v[:, None] & v[None, :] & (idx[:, None] != idx[None, :])  # [L, L]
        c = jnp.where(pair, k @ k.T, 0.0)  # [L, L]
        last = jnp.max(jnp.where(pair & (c > threshold), idx[None, :], -1), axis=-1)  # [L]
        last = jnp.where(last >= 0, last, jnp.argmax(v))
        removed = jnp.take_along_axis(c, last[:, None], axis=1)[:, 0]  # [L]  C[i, last(i)]
        col = c.sum(0) - jnp.zeros((length,), _F32).at[last].add(removed)  # [L]
        n = jnp.maximum(v.sum().astype(_F32), 1.0)
        return _masked_softmax(col / n, v)

    return lax.map(one, (kn, vf)).reshape(b, h, length)


def last_valid_queries(query_valid: jax.Array, window: int) -> jax.Array:
    """Mask [b, W] of the last `window` valid queries (by window order, oldest first) of each row."""
    qv = query_valid.astype(jnp.int32)
    from_end = jnp.cumsum(qv[:, ::-1], axis=-1)[:, ::-1]  # [b, W] valid queries at or after t
    return query_valid & (from_end <= window)


def rkv_official_importance(
    queries: jax.Array,
    query_valid: jax.Array,
    keys: jax.Array,
    valid: jax.Array,
    *,
    pool: int = 7,
    temperature: float = 1.0,
) -> jax.Array:
    """Official R-KV attention importance (spec 3.2b), float32 `[batch, kv_heads, L]`.

        logits[b,h,t,j] = max_g q[b,h,g,t] . k[b,h,j] / (sqrt(D) T)       (GQA max BEFORE the softmax)
        I_j = MaxPool_pool( mean_{t : query_valid} softmax_{j valid}(logits[t, j]) )   (-inf padding)

    Invalid candidates are -inf inside the pool (so an invalid prefix acts like the -inf padding), 0 after it.
    The caller chooses which queries count by `query_valid` (R-KV: the last `rkv_window` ones).
    """
    lg = window_logits(queries, keys, temperature).max(axis=2)  # [b, h, W, L]
    a = _masked_softmax(lg, valid[:, :, None, :])  # [b, h, W, L]
    qv = query_valid[:, None, :, None]  # [b, 1, W, 1]
    n_q = jnp.maximum(query_valid.sum(-1).astype(_F32), 1.0)[:, None, None]  # [b, 1, 1]
    p = jnp.where(qv, a, 0.0).sum(axis=2) / n_q  # [b, h, L]
    p = max_pool(jnp.where(valid, p, -jnp.inf), pool)
    return jnp.where(valid, p, 0.0)


# ---- CUR leverage ------------------------------------------------------------------------------------------
def gaussian_projection(key: jax.Array, row_ids: jax.Array, head_dim: int, rank: int) -> jax.Array:
    """G[b] ~ N(0, 1)/sqrt(rank): [batch, head_dim, rank] float32, row b from fold_in(key, row_ids[b]) (`key`: one
    key or one per row, `row_keys`)."""

    def one(k):
        return jax.random.normal(k, (head_dim, rank), _F32)

    return jax.vmap(one)(row_keys(key, row_ids)) / jnp.sqrt(jnp.asarray(rank, _F32))


def cur_leverage(keys: jax.Array, values: jax.Array, projection: jax.Array, valid: jax.Array) -> jax.Array:
    """CurDKV "kv_product" leverage (spec 3.3), float32 `[batch, kv_heads, L]`.

        sc_j = ||k_j G||^2 ||v_j G||^2 / sum_{j' valid} ||k_j' G||^2 ||v_j' G||^2        (0 on invalid)

    projection G: [batch, head_dim, rank], shared by the kv heads of a row.
    """
    g = projection.astype(_F32)
    k2 = jnp.sum(jnp.einsum("bhld,bdr->bhlr", keys.astype(_F32), g) ** 2, axis=-1)  # [b, h, L]
    v2 = jnp.sum(jnp.einsum("bhld,bdr->bhlr", values.astype(_F32), g) ** 2, axis=-1)  # [b, h, L]
    prod = jnp.where(valid, k2 * v2, 0.0)
    total = jnp.maximum(prod.sum(-1, keepdims=True), jnp.finfo(_F32).tiny)  # [b, h, 1]
    return prod / total


# ---- selection ---------------------------------------------------------------------------------------------
def _tiered(key: jax.Array, eligible: jax.Array, allowed: jax.Array | None) -> jax.Array:
    allowed = jnp.ones_like(eligible) if allowed is None else allowed
    return jnp.where(eligible, jnp.maximum(key, _SCORE_FLOOR), jnp.where(allowed, _FALLBACK, -jnp.inf))


def masked_top_k(
    score: jax.Array, eligible: jax.Array, k: int, allowed: jax.Array | None = None
) -> jax.Array:
    """Indices [b, h, k] of the k largest `score` among `eligible`, descending (ties: lower slot first).

    If fewer than k are eligible, the rest are allowed-but-not-eligible slots (lowest slot first); slots
    outside `allowed` (default: all) come only after those. score, eligible, allowed: [b, h, L].
    """
    if k == 0:
        return jnp.zeros(score.shape[:-1] + (0,), jnp.int32)
    return lax.top_k(_tiered(score.astype(_F32), eligible, allowed), k)[1].astype(jnp.int32)


def gumbel_top_k(
    weights: jax.Array, gumbel: jax.Array, eligible: jax.Array, k: int, allowed: jax.Array | None = None
) -> jax.Array:
    """k draws without replacement with probability proportional to `weights`, in draw order: [b, h, k].

    top-k of log(w_j) + g_j with g_j ~ Gumbel(0, 1) i.i.d. is distributed exactly like successive sampling
    (torch.multinomial(w, k, replacement=False)), including the order of the draws (Gumbel-top-k trick).
    Eligible entries with zero weight come after every positive one, in uniformly random order (torch would
    raise there instead); non-eligible entries follow the tiers of `masked_top_k`.
    weights, gumbel: [b, h, L] float; eligible, allowed: [b, h, L] bool.
    """
    if k == 0:
        return jnp.zeros(weights.shape[:-1] + (0,), jnp.int32)
    w = weights.astype(_F32)
    g = gumbel.astype(_F32)
    key = jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1.0)) + g, g + _ZERO_WEIGHT_OFFSET)
    return lax.top_k(_tiered(key, eligible, allowed), k)[1].astype(jnp.int32)


def scatter_mask(ids: jax.Array, length: int) -> jax.Array:
    """ids [b, h, n] -> bool [b, h, length], True at the given slots."""
    b, h, _ = ids.shape
    bi = jnp.arange(b)[:, None, None]
    hi = jnp.arange(h)[None, :, None]
    return jnp.zeros((b, h, length), bool).at[bi, hi, ids].set(True)


def sink_mask(pos: jax.Array, sink_slots: int) -> jax.Array:
    """bool [b, h, L]: the valid candidates with the `sink_slots` smallest positions of their (row, kv head).

    The reference forces the first `sink_slots` slots; those hold positions 0..3 whenever the cache has no
    padding (and forever after, since sink modes keep them first), so this equals the reference there and is
    invariant to an invalid prefix.
    """
    valid = pos >= 0
    if sink_slots == 0:
        return jnp.zeros_like(valid)
    neg = jnp.where(valid, -pos, jnp.iinfo(jnp.int32).min)  # [b, h, L]
    ids = lax.top_k(neg, min(sink_slots, pos.shape[-1]))[1]  # [b, h, n]
    return scatter_mask(ids, pos.shape[-1]) & valid


# ---- randomness --------------------------------------------------------------------------------------------
def row_keys(key: jax.Array, row_ids: jax.Array) -> jax.Array:
    """One PRNG key per row: fold_in(key, row_ids[b]), or fold_in(key[b], row_ids[b]) when the framework passes
    one key per row (rows of different samples). [b] keys."""
    return fold_rows(key, row_ids)


def position_gumbel(key: jax.Array, row_ids: jax.Array, pos: jax.Array) -> jax.Array:
    """Gumbel(0, 1) noise [b, h, L] float32 keyed by (row id, absolute position, kv head), not by slot.

    noise[b, h, j] = gumbel(fold_in(fold_in(key, row_ids[b]), pos[b, h, j]), (kv_heads,))[h], so the same
    token draws the same noise whatever its slot, the padding, the other rows of the batch and the mesh (per
    device, h is the global number of kv heads and hh the global index: `sharding.local_kv_heads`). Invalid slots
    (pos < 0) get the noise of position 0: they must be masked out by the caller.
    """
    b, h, length = pos.shape
    heads, num_heads = local_kv_heads(h)  # under a mesh, per device: the global index of each local head
    rk = jnp.broadcast_to(row_keys(key, row_ids)[:, None], (b, h * length)).reshape(-1)  # [b*h*L] keys
    token_keys = jax.vmap(jax.random.fold_in)(rk, jnp.maximum(pos, 0).reshape(-1))  # [b*h*L]
    g = jax.vmap(lambda k: jax.random.gumbel(k, (num_heads,), _F32))(token_keys).reshape(b, h, length, num_heads)
    return jnp.take_along_axis(g, heads[None, :, None, None], axis=3)[..., 0]  # head hh: component hh


def check_candidates(num_candidates: int, kept: int, method: str) -> None:
    """Raise ValueError unless there are at least `kept` candidate slots (a static shape check)."""
    if num_candidates < kept:
        raise ValueError(
            f"eviction method {method!r}: {num_candidates} candidate slots cannot yield "
            f"budget - buffer = {kept} kept slots; allowed: at least {kept} candidates"
        )
