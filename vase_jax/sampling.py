"""Token sampling in float32: greedy, temperature, top-k, top-p (nucleus), one random stream per row."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """`temperature=0` is greedy. `top_k=0` and `top_p=1` are off. Applied in HF's order: temperature, top-k, top-p."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0

    def validate(self) -> SamplingConfig:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 means off)")
        return self


def _inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Index drawn from unnormalized probs [batch, n] with uniforms u [batch]: the first i with cdf_i > u * total."""
    cdf = jnp.cumsum(probs, axis=-1)
    idx = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1)
    return jnp.minimum(idx, probs.shape[-1] - 1)


def _nucleus_sorted(sorted_probs: jax.Array, top_p: float) -> jax.Array:
    """Zero the tokens outside the nucleus; sorted_probs [batch, n] in descending order."""
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    return jnp.where(mass_before < top_p, sorted_probs, 0.0)


def _nucleus_unsorted(probs: jax.Array, top_p: float) -> jax.Array:
    """The same nucleus without sorting the vocabulary: probs [batch, vocab] (summing to 1).

    The nucleus is {i : p_i >= t} for t* = the largest t with mass(p >= t) >= top_p. Non-negative float32 values
    order like their int32 bit patterns, so 31 bisection steps over the bit patterns find t* exactly.
    """
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)  # [batch, vocab]
    lo = jnp.zeros(probs.shape[:1], jnp.int32)  # mass(p >= 0) = 1 >= top_p
    hi = bits.max(axis=-1) + 1  # mass(p >= hi) = 0 < top_p

    def bisect(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = jnp.sum(jnp.where(bits >= mid[:, None], probs, 0.0), axis=-1) >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 31, bisect, (lo, hi))
    return jnp.where(bits >= lo[:, None], probs, 0.0)


def filtered_distribution(logits: jax.Array, cfg: SamplingConfig) -> tuple[jax.Array, jax.Array | None]:
    """Temperature, then top-k, then top-p on logits [batch, vocab] (HF's order), in float32.

    Returns (probs [batch, n], ids): unnormalized probabilities, 0 outside the kept set; `ids` [batch, n] are the
    vocabulary ids of the n columns (the top-k candidates, best first), or None when the columns are the whole
    vocabulary. top-p keeps token i iff the mass of the tokens ranked strictly before it is < top_p (HF
    `TopPLogitsWarper`), so the most likely token always survives. Nothing sorts the vocabulary: top-k works on the
    `lax.top_k` candidates (exactly k, where HF also keeps ties of the k-th logit), top-p alone finds its threshold
    by bisection (`_nucleus_unsorted`).
    """
    logits = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k > 0:
        cand_logits, cand_ids = jax.lax.top_k(logits, min(cfg.top_k, logits.shape[-1]))  # [batch, k], descending
        cand_probs = jax.nn.softmax(cand_logits, axis=-1)  # top-k renormalizes before top-p, as HF does
        if cfg.top_p < 1.0:
            cand_probs = _nucleus_sorted(cand_probs, cfg.top_p)
        return cand_probs, cand_ids
    probs = jax.nn.softmax(logits, axis=-1)  # [batch, vocab]
    if cfg.top_p < 1.0:
        probs = _nucleus_unsorted(probs, cfg.top_p)
    return probs, None


def typed_key(key: jax.Array) -> jax.Array:
    """A typed PRNG key array (`jax.random.key`) from a typed or a raw uint32 key (array)."""
    return key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)


def fold_rows(key: jax.Array, data: jax.Array) -> jax.Array:
    """fold_in(key[b], data[b]) for every row: [batch] typed keys. `key` is one key (shared by the rows) or one
    per row ([batch]), typed or raw; data [batch] int32. A shared key gives bit-for-bit the keys of that key
    broadcast to every row, so a row's stream depends only on its own key and data."""
    key = typed_key(key)
    if key.ndim == 0:
        return jax.vmap(lambda d: jax.random.fold_in(key, d))(data)
    return jax.vmap(jax.random.fold_in)(key, data)


def _draw(logits: jax.Array, u: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Tokens [batch] int32 from logits [batch, vocab] and uniforms u [batch] (`sample`)."""
    probs, ids = filtered_distribution(logits, cfg)
    idx = _inverse_cdf(probs, u)  # [batch]
    if ids is not None:
        idx = jnp.take_along_axis(ids, idx[:, None], axis=-1)[:, 0]
    return idx.astype(jnp.int32)


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig, row_ids: jax.Array,
           rowwise: bool = False) -> jax.Array:
    """logits: [batch, vocab] -> tokens [batch] int32, drawn from `filtered_distribution` (argmax if greedy).

    Row r draws one uniform from `fold_in(key, row_ids[r])` (`key`: one key, or one per row [batch]) and inverts
    the CDF of its filtered distribution, so a row's sample does not depend on the other rows of the batch.
    `rowwise`: draw one row at a time (`lax.map`), the same program for every batch size. XLA:CPU sums a
    [batch, vocab] array's rows in an order that depends on the number of rows (from 4 rows on it reduces
    several rows at once), so a row's softmax could differ in its last bit, and its token near a CDF boundary,
    between batches of 2 and 4 rows (`Target.rowwise_sampling`).
    """
    if cfg.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    u = jax.vmap(jax.random.uniform)(fold_rows(key, row_ids))  # [batch]
    if rowwise:
        return jax.lax.map(lambda row: _draw(row[0][None], row[1][None], cfg)[0], (logits, u))
    return _draw(logits, u, cfg)
