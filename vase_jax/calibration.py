"""TriAttention's calibration: the statistics of a model's pre-RoPE queries over calibration text.

For every layer l, query head h and RoPE frequency f < D/2, over the real tokens t of the calibration sequences,
with q_t the query after q_proj and q_norm and before RoPE (the vector that RoPE rotates, then attends), in the
rotate-half layout q_{t,f} = q_t[f] + i q_t[f + D/2]:

    q_mean[l, h, f]     = (1/T) sum_t q_{t,f}        (complex)
    q_abs_mean[l, h, f] = (1/T) sum_t |q_{t,f}|

The authors' calibration script hooks q_proj and leaves out Qwen3's q_norm; we take the normed query, which is
what attends (`vase_jax.eviction.triattention` documents the scoring). Sums are float32 per batch on the device,
then float64 on the host in batch order: the same sequences give the same file.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vase_jax.eviction.triattention import Calibration
from vase_jax.model import Qwen3, decoder_layer, linear, prompt_positions, rms_norm
from vase_jax.target import Target


@functools.partial(jax.jit, static_argnums=0)
def _query_sums(graphdef, state, tokens: jax.Array, mask: jax.Array):
    """Over the real tokens of a left-padded batch tokens/mask [batch, seq]: per (layer, head, f) the sums of
    q_f's real and imaginary parts and of |q_f| (float32 [layers, heads, F] each), and the token count."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    target = Target.of(model.embedding[...])
    b, t = tokens.shape
    d, f = cfg.head_dim, cfg.head_dim // 2
    positions = prompt_positions(mask)
    attend = jnp.tril(jnp.ones((t, t), bool))[None] & mask.astype(bool)[:, None, :]  # [batch, tq, tk]
    real = mask.astype(jnp.float32)[:, :, None, None]  # [batch, seq, 1, 1]
    x = model.embed(tokens, target)  # [batch, seq, embed]
    sums = []
    for i, w in enumerate(model.layer_weights()):
        h = rms_norm(x, w["input_norm"], cfg.rms_norm_eps).reshape(b * t, -1)
        q = linear(h, w["q_proj"].reshape(cfg.num_heads * d, -1), target).reshape(b, t, cfg.num_heads, d)
        q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps).astype(jnp.float32)  # [batch, seq, heads, head_dim]
        q_re, q_im = q[..., :f] * real, q[..., f:] * real
        sums.append(jnp.stack([q_re.sum((0, 1)), q_im.sum((0, 1)), jnp.sqrt(q_re**2 + q_im**2).sum((0, 1))]))
        x, _ = decoder_layer(cfg, w, x, positions, attend, None, i, target=target)
    return jnp.stack(sums), mask.sum()  # [layers, 3, heads, F], count


def query_statistics(model: Qwen3, sequences: list[list[int]], *, batch: int = 8, pad_id: int = 0,
                     source: str = "") -> Calibration:
    """The `Calibration` of `model` over `sequences` (token ids, each run as one causal sequence from position 0),
    `batch` sequences per call, left-padded to a multiple of 64 tokens with `pad_id` (masked)."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("calibration needs at least one non-empty token sequence")
    graphdef, state = nnx.split(model)
    total = np.zeros((model.cfg.num_layers, 3, model.cfg.num_heads, model.cfg.head_dim // 2), np.float64)
    count = 0
    for start in range(0, len(sequences), batch):
        chunk = sequences[start:start + batch]
        width = -(-max(len(s) for s in chunk) // 64) * 64
        tokens = np.full((batch, width), pad_id, np.int32)
        mask = np.zeros((batch, width), np.int32)
        for r, seq in enumerate(chunk):
            tokens[r, width - len(seq):] = seq
            mask[r, width - len(seq):] = 1
        # rows past the end of a short last batch hold no real token: they add nothing to the sums
        sums, n = _query_sums(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask))
        total += np.asarray(sums, np.float64)
        count += int(n)
    mean = total / count
    cfg = model.cfg
    meta = {"num_layers": cfg.num_layers, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "rope_theta": float(cfg.rope_theta), "query": "post-q_norm, pre-RoPE",
            "tokens": count, "sequences": len(sequences), "source": source}
    return Calibration(q_mean=(mean[:, 0] + 1j * mean[:, 1]).astype(np.complex64),
                       q_abs_mean=mean[:, 2].astype(np.float32), meta=meta)



def random_statistics(cfg, seed: int = 0) -> Calibration:
    """Statistics of random numbers for a model of `cfg`'s shape: for speed measurements and tests of the code
    paths on random models (they say nothing of a trained model's queries)."""
    rng = np.random.default_rng([seed, cfg.num_layers, cfg.num_heads, cfg.head_dim])
    shape = (cfg.num_layers, cfg.num_heads, cfg.head_dim // 2)
    q_mean = rng.normal(size=shape) + 1j * rng.normal(size=shape)
    q_abs = np.abs(q_mean) + rng.uniform(0.0, 1.0, size=shape)
    meta = {"num_layers": cfg.num_layers, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "rope_theta": float(cfg.rope_theta), "source": f"random numbers (seed {seed})"}
    return Calibration(q_mean.astype(np.complex64), q_abs.astype(np.float32), meta)
