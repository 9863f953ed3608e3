"""Qwen3 (dense) in Flax NNX, following the numerics of Hugging Face `transformers`.

Order of operations (HF `modeling_qwen3`): RMSNorm in float32, cast back to the input dtype, then times the weight;
q_norm / k_norm act per head on head_dim before RoPE; RoPE is rotate-half with angles computed in float32;
attention scale head_dim ** -0.5 with the softmax in float32; SwiGLU MLP; residual adds in the model dtype.

Three entry points share the same layers:
- `model(input_ids, attention_mask=None)`: a plain forward pass, float32 logits `[batch, seq, vocab]`.
- `model.prefill(...)`: the forward pass over a left-padded prompt that also returns every layer's keys, values
  and post-RoPE queries (the generate loop writes them into its cache).
- `model.decode_step(...)`: one token per row against the KV cache (see `vase_jax.cache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from vase_jax.config import Qwen3Config

# Logical axis names of every parameter, by parameter name: sharding over a `("data", "model")` mesh is a table
# from these names to mesh axes (DESIGN.md, "Scaling out").
LOGICAL_AXES = {
    "embedding": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "q_proj": ("embed", "q_heads", "head_dim"),
    "k_proj": ("embed", "kv_heads", "head_dim"),
    "v_proj": ("embed", "kv_heads", "head_dim"),
    "o_proj": ("q_heads", "head_dim", "embed"),
    "gate_proj": ("embed", "mlp"),
    "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"),
    "norm": ("embed",),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
}
CACHE_AXES = ("batch", "kv_heads", "slots", "head_dim")


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


class RMSNorm(nnx.Module):
    """y = w * cast(x / sqrt(mean(x^2) + eps)), the mean and rsqrt in float32."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE. x: [batch, heads, seq, head_dim]; positions: [batch, seq] int32.

    angle[p, i] = p * theta^(-2i / head_dim) in float32; x' = x * cos + rotate_half(x) * sin in x's dtype.
    """
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [head_dim/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, seq, head_dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, None]  # [batch, 1, seq, head_dim]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)  # [batch, heads, seq, head_dim]
    return x * cos + rotated * sin


class Attention(nnx.Module):
    def __init__(self, cfg: Qwen3Config, dtype, rngs: nnx.Rngs):
        e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = _param(rngs, (e, hq, d), dtype)
        self.k_proj = _param(rngs, (e, hkv, d), dtype)
        self.v_proj = _param(rngs, (e, hkv, d), dtype)
        self.o_proj = _param(rngs, (hq, d, e), dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.cfg = cfg

    def project(self, x: jax.Array, positions: jax.Array):
        """x: [batch, seq, embed] -> post-RoPE q [batch, kv_heads, group, seq, head_dim], k and v [b, kv_heads, seq, d].

        Projections are plain 2-D matmuls against `[embed, heads * head_dim]` views of the weights, so no weight is
        transposed (copied) inside the decode loop.
        """
        cfg = self.cfg
        b, t, e = x.shape

        def heads(w: jax.Array, n: int) -> jax.Array:  # [batch, seq, embed] @ [embed, n * d] -> [batch, n, seq, d]
            y = x.reshape(b * t, e) @ w.reshape(e, n * cfg.head_dim)
            return y.reshape(b, t, n, cfg.head_dim).transpose(0, 2, 1, 3)

        q = heads(self.q_proj[...], cfg.num_heads)  # [batch, q_heads, seq, head_dim]
        k = heads(self.k_proj[...], cfg.num_kv_heads)  # [batch, kv_heads, seq, head_dim]
        v = heads(self.v_proj[...], cfg.num_kv_heads)  # [batch, kv_heads, seq, head_dim]
        q = rope(self.q_norm(q), positions, cfg.rope_theta)
        k = rope(self.k_norm(k), positions, cfg.rope_theta)
        q = q.reshape(b, cfg.num_kv_heads, cfg.group, t, cfg.head_dim)  # [batch, kv_heads, group, seq, head_dim]
        return q, k, v

    def output(self, attn: jax.Array) -> jax.Array:
        """attn: [batch, kv_heads, group, seq, head_dim] -> [batch, seq, embed]."""
        b, _, _, t, d = attn.shape
        hd = self.cfg.num_heads * d
        attn = attn.reshape(b, self.cfg.num_heads, t, d).transpose(0, 2, 1, 3).reshape(b * t, hd)
        return (attn @ self.o_proj[...].reshape(hd, -1)).reshape(b, t, -1)  # [batch, seq, embed]


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention over a short key axis (prefill, plain forward).

    q: [batch, kv_heads, group, tq, head_dim]; k, v: [batch, kv_heads, tk, head_dim]; mask: [batch, tq, tk] bool.
    Logits and softmax in float32; probabilities cast to v's dtype before the weighted sum (as HF does).
    """
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("bhgqd,bhkd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)  # [batch, kv_heads, group, tq, tk]
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask[:, None, None].any(-1, keepdims=True), probs, 0.0)  # fully masked rows (padding) -> 0
    return jnp.einsum("bhgqk,bhkd->bhgqd", probs.astype(v.dtype), v)


class MLP(nnx.Module):
    def __init__(self, cfg: Qwen3Config, dtype, rngs: nnx.Rngs):
        self.gate_proj = _param(rngs, (cfg.hidden_size, cfg.intermediate_size), dtype)
        self.up_proj = _param(rngs, (cfg.hidden_size, cfg.intermediate_size), dtype)
        self.down_proj = _param(rngs, (cfg.intermediate_size, cfg.hidden_size), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jax.nn.silu(x @ self.gate_proj[...])  # [batch, seq, mlp]
        return (gate * (x @ self.up_proj[...])) @ self.down_proj[...]  # [batch, seq, embed]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def mlp_block(self, x: jax.Array) -> jax.Array:
        with jax.named_scope("mlp"):
            return x + self.mlp(self.post_attn_norm(x))


class Qwen3(nnx.Module):
    """A dense Qwen3 causal LM. Parameters are `nnx.Param`s in `dtype`; the module is a pytree."""

    def __init__(self, cfg: Qwen3Config, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = dtype
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _param(rngs, (cfg.hidden_size, cfg.vocab_size), dtype)

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, *, dtype=jnp.bfloat16, revision: str | None = None) -> Qwen3:
        """Load a HF Qwen3 checkpoint folder (safetensors), a hub id, or a folder written by `scripts/convert.py`."""
        from vase_jax.weights import load_pretrained

        return load_pretrained(path_or_hub_id, dtype=dtype, revision=revision)

    # ---- pieces -------------------------------------------------------------------------------------------------
    def embed(self, input_ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], input_ids, axis=0)  # [batch, seq, embed]

    def logits(self, x: jax.Array) -> jax.Array:
        """Final norm and LM head; float32 logits [batch, seq, vocab]."""
        with jax.named_scope("lm_head"):
            x = self.norm(x)
            if self.lm_head is None:
                return jnp.einsum("bte,ve->btv", x, self.embedding[...], preferred_element_type=jnp.float32)
            return jnp.einsum("bte,ev->btv", x, self.lm_head[...], preferred_element_type=jnp.float32)

    # ---- plain forward and prefill -------------------------------------------------------------------------------
    def prefill(self, input_ids: jax.Array, attention_mask: jax.Array, last_logits_only: bool = False):
        """Forward over left-padded prompts; also returns what the cache needs.

        input_ids, attention_mask: [batch, seq]. Each row's RoPE positions count its real tokens (padding gets 0).
        Returns (logits [batch, seq, vocab] f32, keys, values, queries): per layer, k/v [batch, kv_heads, seq, head_dim]
        post-RoPE, queries [batch, kv_heads, group, seq, head_dim] post-RoPE. With `last_logits_only` the logits
        are those of the last position, [batch, 1, vocab] (what generation needs; the LM head is the largest
        matmul of a prefill).
        """
        mask = attention_mask.astype(bool)  # [batch, seq]
        positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)  # [batch, seq]
        t = input_ids.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))
        attn_mask = causal[None] & mask[:, None, :]  # [batch, tq, tk]
        x = self.embed(input_ids)
        keys, values, queries = [], [], []
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                with jax.named_scope("attention"):
                    q, k, v = layer.attn.project(layer.input_norm(x), positions)
                    x = x + layer.attn.output(dense_attention(q, k, v, attn_mask))
                x = layer.mlp_block(x)
            keys.append(k)
            values.append(v)
            queries.append(q)
        return self.logits(x[:, -1:] if last_logits_only else x), keys, values, queries

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Plain forward pass (no cache): float32 logits [batch, seq, vocab]."""
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        return self.prefill(input_ids, attention_mask)[0]
