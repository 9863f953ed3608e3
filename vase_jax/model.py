"""Qwen3 (dense) in Flax NNX, following the numerics of Hugging Face `transformers`.

Order of operations (HF `modeling_qwen3`): RMSNorm in float32, cast back to the input dtype, then times the weight;
q_norm / k_norm act per head on head_dim before RoPE; RoPE is rotate-half with angles computed in float32;
attention scale head_dim ** -0.5 with the softmax in float32; SwiGLU MLP; residual adds in the model dtype.
Matmuls ask for a float32 result and cast it back (HF's bf16 linear accumulates in float32 too; XLA:CPU runs a
bf16 x bf16 -> f32 dot natively, whereas a bf16-result dot converts the whole weight to float32 first).

Layer weights are held per layer (`Qwen3.layers`, one `DecoderLayer` per layer, HF's `model.layers.{i}` order;
`PARAM_AXES` names every axis), so a step reads each weight where it lives. One layer function, `decoder_layer`,
serves every entry point:

- `model(input_ids, attention_mask=None)`: the plain forward pass, float32 logits `[batch, seq, vocab]`.
- `model.forward(tokens, positions, cache, ...)`: the same layers with a KV cache (`vase_jax.cache`): a
  multi-token call fills an empty cache with a prompt (prefill), a one-token call appends to it (decode step).
  The cache write happens inside attention. Returns (logits, cache).

The layers run as the target says (`vase_jax.target.Target.layer_loop`, see `run_layers`): unrolled (a Python
loop: each layer its own code) or switched (a `lax.scan` over the layer index whose matmuls pick their layer's
weight with a `lax.switch`: one compiled layer whatever the depth). The KV cache stays stacked over layers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.dispatch import pairwise_sum
from vase_jax import weights
from vase_jax.cache import KVCache, view_as
from vase_jax.config import LAYER_PARAMS, MATRIX_PARAMS, NORM_PARAMS, PARAM_AXES, Qwen3Config
from vase_jax.target import Target


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def matmul(spec: str, x: jax.Array, w: jax.Array | PerLayer, target: Target | None = None) -> jax.Array:
    """`einsum(spec, x, w)` for a 2-D x [rows, in] with a float32 result (see `matmuls`)."""
    return matmuls(spec, x, (w,), target)[0]


def matmuls(spec: str, x: jax.Array, ws: tuple[jax.Array, ...] | tuple[PerLayer, ...],
            target: Target | None = None, out_dtype=jnp.float32, epilogue=None) -> tuple[jax.Array, ...]:
    """`einsum(spec, x, w)` for each w, a 2-D x [rows, in]: products accumulated in float32 (every backend does so
    for 16-bit operands), results in `out_dtype`. Where `target.dot_writes_result` (GPU, TPU) the dot writes them
    itself: no 16-bit result exists in float32 (XLA:GPU's prefill held each MLP projection twice, the dot's float32
    output and its cast) and no cast follows a switch (XLA:TPU mis-compiled one there, for one row per device of a
    data-sharded bf16 mesh). `epilogue` combines the results there, inside the switch's branch (the MLP's SwiGLU:
    one [rows, mlp] array leaves the branch, not two: XLA:TPU's prefill held both). Elsewhere (XLA:CPU converts the
    operands of a dot with a 16-bit result to float32, a float32 copy of the weight) the dots write float32 and the
    cast and the epilogue follow the switch. `target` None: that of x's devices (`Target.of`).

    `PerLayer` weights are multiplied in place, all in one `lax.switch` on their layer index (one branch per layer,
    whatever the number of weights)."""
    target = Target.of(x) if target is None else target
    fused = target.dot_writes_result
    dots = functools.partial(_dots, spec, out_dtype if fused else jnp.float32, epilogue if fused else None)
    if isinstance(ws[0], PerLayer):
        per_layer = zip(*(w.arrays for w in ws), strict=True)  # layer l -> (ws[0] of l, ws[1] of l, ...)
        ys = jax.lax.switch(ws[0].index, [functools.partial(dots, wl) for wl in per_layer], x)
    else:
        ys = dots(ws, x)
    if not fused:
        ys = tuple(y.astype(out_dtype) for y in ys)
        ys = ys if epilogue is None else (epilogue(*ys),)
    return ys


def _dots(spec: str, dtype, epilogue, ws: tuple[jax.Array, ...], x: jax.Array) -> tuple[jax.Array, ...]:
    ys = tuple(jnp.einsum(spec, x, w, preferred_element_type=dtype) for w in ws)
    return ys if epilogue is None else (epilogue(*ys),)


@dataclasses.dataclass(frozen=True)
class PerLayer:
    """One kind of matmul weight inside the switched layer loop: every layer's array (`arrays[l]`, the model's
    own buffers) and the traced layer `index`. `matmul` multiplies by `arrays[index]` through a `lax.switch` whose
    branches each read one buffer where it lives: nothing is sliced or copied, and each branch is one dot."""

    arrays: tuple[jax.Array, ...]
    index: jax.Array

    def reshape(self, *shape: int) -> PerLayer:
        return PerLayer(tuple(a.reshape(*shape) for a in self.arrays), self.index)


def linear(x: jax.Array, w: jax.Array | PerLayer, target: Target | None = None) -> jax.Array:
    """x [n, in] times w [out, in] (HF's layout) -> [n, out] in x's dtype, accumulated in float32. Callers flatten
    to 2-D: inside a loop, XLA:CPU runs a matmul with a 3-D operand several times slower than the same 2-D one."""
    return linears(x, (w,), target)[0]


def linears(x: jax.Array, ws: tuple, target: Target | None = None, epilogue=None) -> tuple[jax.Array, ...]:
    """`linear(x, w)` for each w of `ws` (weights that read the same input: one switch for `PerLayer` ones)."""
    return matmuls("ni,oi->no", x, ws, target, out_dtype=x.dtype, epilogue=epilogue)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """y = w * cast(x / sqrt(mean(x^2) + eps)), the mean (a `pairwise_sum`) and rsqrt in float32."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(pairwise_sum(x32 * x32) / x.shape[-1] + eps)
    return weight * normed.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


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


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, return_probs: bool = False):
    """Softmax attention over a short key axis (prefill, plain forward).

    q: [batch, kv_heads, group, tq, head_dim]; k, v: [batch, kv_heads, tk, head_dim]; mask: [batch, tq, tk] bool.
    Logits and softmax in float32; probabilities cast to v's dtype before the weighted sum (as HF does).
    `return_probs`: also return the float32 probabilities [batch, kv_heads, group, tq, tk] (0 on masked entries and
    on fully masked rows).
    """
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("bhgqd,bhkd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)  # [batch, kv_heads, group, tq, tk]
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask[:, None, None].any(-1, keepdims=True), probs, 0.0)  # fully masked rows (padding) -> 0
    out = jnp.einsum("bhgqk,bhkd->bhgqd", probs.astype(v.dtype), v)
    return (out, probs) if return_probs else out


# ---- the layer function ---------------------------------------------------------------------------------------
def project(cfg: Qwen3Config, w: dict[str, jax.Array], x: jax.Array, positions: jax.Array,
            target: Target | None = None):
    """x: [batch, seq, embed] -> post-RoPE q [batch, kv_heads, group, seq, head_dim], k and v [b, kv_heads, seq, d].

    Projections are plain 2-D matmuls against `[heads * head_dim, embed]` views of the weights, so no weight is
    transposed (copied) inside the decode loop.
    """
    b, t, e = x.shape
    d = cfg.head_dim

    counts = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads, "v_proj": cfg.num_kv_heads}
    # [batch * seq, embed] x [n * d, embed] -> [batch, n, seq, d]
    projected = linears(x.reshape(b * t, e), tuple(w[name].reshape(n * d, e) for name, n in counts.items()),
                        target)
    q, k, v = (y.reshape(b, t, counts[name], d).transpose(0, 2, 1, 3) for name, y in zip(counts, projected,
                                                                                          strict=True))
    # q [batch, q_heads, seq, head_dim]; k, v [batch, kv_heads, seq, head_dim]
    q = rope(rms_norm(q, w["q_norm"], cfg.rms_norm_eps), positions, cfg.rope_theta)
    k = rope(rms_norm(k, w["k_norm"], cfg.rms_norm_eps), positions, cfg.rope_theta)
    q = q.reshape(b, cfg.num_kv_heads, cfg.group, t, d)  # [batch, kv_heads, group, seq, head_dim]
    return q, k, v


def attention(cfg: Qwen3Config, w: dict[str, jax.Array], x: jax.Array, positions: jax.Array, mask: jax.Array | None,
              cache: KVCache | None, layer, attention_impl: str, target: Target | None = None, chunk_start=None):
    """Self-attention of one layer: x [batch, seq, embed] -> (x + attention output, cache).

    Without a cache, or with a multi-token input (which fills an empty cache), the queries attend densely to the
    input's own keys under `mask` [batch, seq, seq]. With `chunk_start` (the chunked prefill), the input is a
    chunk of unpadded prompts at slots [chunk_start, chunk_start + seq), written then attended through the cache
    (`attend_chunk`). A one-token input is written at each active row's next slot
    (`start_token` counted it) and attends over the row's live slots; `layer` indexes the stacked cache. The cache
    does both through its interface (`KVCache` or `tiers.TieredCache`: the same methods).

    A cache with per-slot state (`cache.state_specs`, declared by the eviction policy) also gets the attention
    weights of every slot, summed over the query group (`vase_jax.cache.update_state` / `prefill_state`); a
    cache without state runs exactly the code above.
    """
    q, k, v = project(cfg, w, rms_norm(x, w["input_norm"], cfg.rms_norm_eps), positions, target)
    b, t = x.shape[:2]
    if chunk_start is not None:
        out, cache = cache.attend_chunk(layer, k, v, q, chunk_start)  # [batch, kv_heads, group, seq, head_dim]
    elif cache is not None and t == 1:
        out, cache = cache.attend_token(layer, k, v, q, attention_impl)  # [batch, kv_heads, group, 1, head_dim]
    elif cache is not None and cache.state_specs:
        out, probs = dense_attention(q, k, v, mask, return_probs=True)  # probs [b, kv_heads, group, seq, seq]
        cache = cache.write_prompt(layer, k, v, q, mask[:, -1, :], probs.sum(axis=(2, 3)))  # [b, kv_heads, seq]
    else:
        if cache is not None:
            cache = cache.write_prompt(layer, k, v, q, mask[:, -1, :])
        out = dense_attention(q, k, v, mask)  # [batch, kv_heads, group, seq, head_dim]
    hd = cfg.num_heads * cfg.head_dim
    out = out.astype(x.dtype).reshape(b, cfg.num_heads, t, cfg.head_dim).transpose(0, 2, 1, 3).reshape(b * t, hd)
    return x + linear(out, w["o_proj"].reshape(-1, hd), target).reshape(b, t, -1), cache


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def mlp(cfg: Qwen3Config, w: dict[str, jax.Array], x: jax.Array, target: Target | None = None) -> jax.Array:
    """x + SwiGLU(RMSNorm(x)): [batch, seq, embed], as 2-D matmuls over [batch * seq, embed]."""
    b, t, e = x.shape
    h = rms_norm(x, w["post_attn_norm"], cfg.rms_norm_eps).reshape(b * t, e)
    (act,) = linears(h, (w["gate_proj"], w["up_proj"]), target, _swiglu)  # [batch * seq, mlp]
    return x + linear(act, w["down_proj"], target).reshape(b, t, e)


def decoder_layer(cfg: Qwen3Config, w: dict[str, jax.Array], x: jax.Array, positions: jax.Array,
                  mask: jax.Array | None, cache: KVCache | None, layer, attention_impl: str = "auto",
                  target: Target | None = None, chunk_start=None):
    """One decoder layer with weights `w` (`DecoderLayer.weights`, or the switched loop's view of every layer's):
    (x, cache) -> (x, cache). `layer` indexes the stacked cache (an int, or traced in the switched loop);
    `chunk_start`: see `attention`."""
    with jax.named_scope("attention"):
        x, cache = attention(cfg, w, x, positions, mask, cache, layer, attention_impl, target, chunk_start)
    with jax.named_scope("mlp"):
        x = mlp(cfg, w, x, target)
    return x, cache


def run_layers(body, carry, layers: Sequence[dict[str, jax.Array]], loop: str):
    """carry <- body(carry, w_l, l) for every layer l, w_l the weights of layer l (`DecoderLayer.weights`).

    - "unroll": a Python loop; each layer is its own code and indexes the cache with a static l.
    - "switch": a `lax.scan` over l (one compiled layer body, whatever the depth). Each matmul reads its layer's
      weight through a `lax.switch` on l (`PerLayer`), so no weight is sliced or copied; the RMSNorm scales, a
      few KB per layer, are stacked once per call and indexed.
    """
    if loop == "unroll":
        for i, w in enumerate(layers):
            with jax.named_scope(f"layer_{i}"):
                carry = body(carry, w, i)
        return carry
    if loop != "switch":
        raise ValueError(f"loop={loop!r}; allowed: unroll, switch")
    norms = {name: jnp.stack([w[name] for w in layers]) for name in NORM_PARAMS}  # [layers, ...] each

    def step(c, i):
        w = {name: norms[name][i] for name in NORM_PARAMS}
        w |= {name: PerLayer(tuple(lw[name] for lw in layers), i) for name in MATRIX_PARAMS}
        return body(c, w, i), None

    return jax.lax.scan(step, carry, jnp.arange(len(layers), dtype=jnp.int32))[0]


# ---- the model ------------------------------------------------------------------------------------------------
class DecoderLayer(nnx.Module):
    """One decoder layer's weights, each its own array, named and shaped as the ("layers", name) kinds of
    `PARAM_AXES` (HF's `model.layers.{i}.*`, matrices `[out, in]`)."""

    def __init__(self, cfg: Qwen3Config, dtype, rngs: nnx.Rngs):
        sizes = cfg.axis_sizes()
        for name in LAYER_PARAMS:
            shape = tuple(sizes[a] for a in PARAM_AXES[("layers", name)])
            value = nnx.Param(jnp.ones(shape, dtype)) if name in NORM_PARAMS else _normal(rngs, shape, dtype)
            setattr(self, name, value)

    def weights(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in LAYER_PARAMS}


class Qwen3(nnx.Module):
    """A dense Qwen3 causal LM. Parameters are `nnx.Param`s in `dtype`; the module is a pytree."""

    def __init__(self, cfg: Qwen3Config, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = dtype
        self.embedding = _normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _normal(rngs, (cfg.vocab_size, cfg.hidden_size), dtype)

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str, *, dtype=jnp.bfloat16, revision: str | None = None,
                        mesh: jax.sharding.Mesh | None = None) -> Qwen3:
        """Load a HF Qwen3 checkpoint folder (safetensors), a hub id, or a folder written by `scripts/convert.py`.

        `mesh`: a `("data", "model")` mesh (`vase_jax.sharding.make_mesh`, or `jax.make_mesh`); each weight is read
        straight into its shards (`vase_jax.sharding.param_shardings`), and `generate` then runs on that mesh."""
        cfg, params = weights.load_params(path_or_hub_id, dtype=dtype, revision=revision, mesh=mesh)
        return cls.from_params(cfg, params, dtype)

    @classmethod
    def from_params(cls, cfg: Qwen3Config, params: dict[tuple, jax.Array], dtype) -> Qwen3:
        """A model holding `params` ({`param_axes` path: array}, every parameter of `cfg`), cast to `dtype`."""
        graphdef, state = nnx.split(nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0))))
        flat = []
        for path, var in nnx.to_flat_state(state):
            if path not in params:
                raise ValueError(f"no weight for parameter {'.'.join(map(str, path))}")
            if tuple(params[path].shape) != tuple(var.shape):
                raise ValueError(f"parameter {'.'.join(map(str, path))} has shape {tuple(params[path].shape)}, "
                                 f"expected {tuple(var.shape)}")
            flat.append((path, var.replace(jnp.asarray(params[path], dtype=dtype))))
        return nnx.merge(graphdef, nnx.from_flat_state(flat))

    # ---- pieces -------------------------------------------------------------------------------------------------
    def embed(self, tokens: jax.Array, target: Target) -> jax.Array:
        """Rows of the embedding table: [batch, seq, embed], gathered through the view `target.storage` names (its
        uint16 bits on CPU: XLA:CPU would convert a whole bf16 table to float32 to gather from it)."""
        table = self.embedding[...]  # [vocab, embed]
        rows = jnp.take(view_as(table, target.storage(table.dtype)), tokens, axis=0)
        return view_as(rows, table.dtype)

    def logits(self, x: jax.Array, target: Target | None = None) -> jax.Array:
        """Final norm and LM head; float32 logits [batch, seq, vocab]."""
        with jax.named_scope("lm_head"):
            b, t, e = x.shape
            x = self.norm(x).reshape(b * t, e)  # a 2-D matmul: XLA:CPU runs "bte,ve->btv" inside a loop 3x slower
            head = self.embedding if self.lm_head is None else self.lm_head  # [vocab, embed]
            logits = matmul("ne,ve->nv", x, head[...], target)
            return logits.reshape(b, t, -1)  # [batch, seq, vocab]

    def layer_weights(self) -> tuple[dict[str, jax.Array], ...]:
        """Every layer's weights (`DecoderLayer.weights`), in order: what `run_layers` reads."""
        return tuple(layer.weights() for layer in self.layers)

    # ---- forward ------------------------------------------------------------------------------------------------
    def forward(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache | None = None,
        *,
        attention_mask: jax.Array | None = None,
        attention_impl: str = "auto",
        target: Target | None = None,
        last_logits_only: bool = False,
    ) -> tuple[jax.Array, KVCache | None]:
        """tokens, positions: [batch, seq] int32 -> (float32 logits [batch, seq, vocab], cache).

        - `cache=None`: causal attention over `tokens` (left padding masked by `attention_mask` [batch, seq]).
        - a cache and `seq > 1`: the same, and the keys, values (and the query ring) of each row's real tokens are
          written into slots [0, P_b) of the empty `cache` (`vase_jax.cache.init_cache`); padding is dropped.
        - a cache and `seq == 1`: one decode step; each active row's token is written at slot `cache.length[b]`
          and attends over the row's live slots (`attention_impl` picks the decode kernel).
        `target`: the platform the program is for and its layer loop (`vase_jax.target`; default: the platform of
        the weights' devices, or JAX's default backend for abstract or traced weights, and its default loop).
        `last_logits_only`: logits of the last position only, [batch, 1, vocab] (the LM head is the largest
        matmul of a prefill).
        """
        target = Target.of(self.embedding[...]) if target is None else target
        b, t = tokens.shape
        decoding = cache is not None and t == 1
        mask = None
        if not decoding:
            token_mask = (jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool))
            mask = jnp.tril(jnp.ones((t, t), bool))[None] & token_mask[:, None, :]  # [batch, tq, tk]
        cfg = self.cfg

        def body(carry, w, i):
            x, c = carry
            return decoder_layer(cfg, w, x, positions, mask, c, i, attention_impl, target)

        if cache is not None:  # positions and counters first: every layer's `pos` is the same
            cache = cache.start_token() if decoding else cache.start_prompt(mask[:, -1, :])
        x, cache = run_layers(body, (self.embed(tokens, target), cache), self.layer_weights(), target.layer_loop)
        return self.logits(x[:, -1:] if last_logits_only else x, target), cache

    def prefill_chunk(self, tokens: jax.Array, start: jax.Array, cache: KVCache, *, attention_impl: str = "auto",
                      target: Target | None = None) -> tuple[jax.Array, KVCache]:
        """One chunk of the chunked prefill (`vase_jax.generate.prefill`): tokens [batch, C] of unpadded prompts at
        positions, and slots, [start, start + C), through every layer into `cache` (after `cache.start_prompt`;
        `KVCache.attend_chunk`) -> (the last layer's output [batch, C, embed], cache). `logits` of a row of it are
        that token's logits."""
        target = Target.of(self.embedding[...]) if target is None else target
        b, c = tokens.shape
        positions = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), (b, c))  # [batch, C]
        cfg = self.cfg

        def body(carry, w, i):
            x, cache = carry
            return decoder_layer(cfg, w, x, positions, None, cache, i, attention_impl, target, start)

        return run_layers(body, (self.embed(tokens, target), cache), self.layer_weights(), target.layer_loop)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """Plain forward pass (no cache) over left-padded prompts: float32 logits [batch, seq, vocab]."""
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, jnp.int32)
        return self.forward(input_ids, prompt_positions(attention_mask), attention_mask=attention_mask)[0]


def prompt_positions(attention_mask: jax.Array) -> jax.Array:
    """RoPE positions of left-padded prompts: each row counts its real tokens from 0 (padding gets 0). [batch, seq]"""
    mask = attention_mask.astype(bool)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)
