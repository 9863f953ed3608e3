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


def filter_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Temperature, then top-k, then top-p on float32 logits [batch, vocab]; removed tokens get -inf.

    top-k keeps every token whose logit reaches the k-th largest (ties kept, as HF does). top-p keeps the smallest
    prefix of the tokens sorted by probability whose mass reaches `top_p`: token i survives iff the mass of the
    tokens ranked strictly before it is < top_p (HF `TopPLogitsWarper`), so the most likely token always survives.
    """
    logits = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k > 0:
        kth = jax.lax.top_k(logits, cfg.top_k)[0][:, -1:]  # [batch, 1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)  # [batch, vocab], most likely first
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # [batch, vocab]
        keep_sorted = mass_before < cfg.top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig, row_ids: jax.Array) -> jax.Array:
    """logits: [batch, vocab] -> tokens [batch] int32.

    Row r draws with `fold_in(key, row_ids[r])`, so a row's sample does not depend on the other rows of the batch.
    """
    if cfg.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, cfg)
    draw = jax.vmap(lambda row, lg: jax.random.categorical(jax.random.fold_in(key, row), lg))
    return draw(row_ids, filtered).astype(jnp.int32)
