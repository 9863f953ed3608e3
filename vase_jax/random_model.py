"""Random Qwen3 models for offline smoke runs, tests and benchmarks: one definition of the tiny shape, and the
named shapes (`named_configs`) that scripts and benchmarks take as `--model NAME` (`named_or_pretrained`).

`TINY` is the shape of the test fixtures (2 layers, 4 query / 2 kv heads, head_dim 32) with the real Qwen3
vocabulary, so the packaged tokenizer's ids are valid; `TINY_1K` is the same shape with a 1024-token vocabulary
(random prompts only: about 1% of the weights, for smoke benchmarks and memory plans in seconds). `random_model`
draws weights with NumPy (no compile per parameter shape): normal with std 0.02, RMSNorm scales 1, the output
head's std times `head_scale`. With std 0.02 everywhere the next-token distribution over 151936 tokens is nearly
uniform; a trained model's is peaked, as the one with a scaled head is (the eval smoke run uses `HEAD_SCALE`).
"""

from __future__ import annotations

import dataclasses
from importlib import resources

import jax.numpy as jnp
import numpy as np
from flax import nnx

from vase_jax.config import NORM_PARAMS, PARAM_AXES, Qwen3Config
from vase_jax.model import Qwen3

TINY = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=32, tie_word_embeddings=False, rope_theta=10000.0,
                   max_position_embeddings=1 << 16)
TINY_1K = dataclasses.replace(TINY, vocab_size=1024)
# Long generations on a CPU: Qwen3's head_dim (128) and GQA group (2) but 12 MB of float32 weights, so that
# the cache dominates the bytes a step reads after a few thousand tokens (at 8k tokens, batch 2: 67 MB).
SMALL = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=128, tie_word_embeddings=True, max_position_embeddings=1 << 16)
RANDOM_MODELS = {"tiny": TINY}
HEAD_SCALE = 50.0  # head std 1: logits of std ~8, not ~0.2, peaked like a trained model's


def random_params(cfg: Qwen3Config, seed: int = 0, std: float = 0.02,
                  head_scale: float = 1.0) -> dict[tuple, np.ndarray]:
    """{parameter path: float32 array} drawn with NumPy. Each kind of layer weight is drawn for all layers at once
    and split per layer, so a seed gives the same weights as when layers were stored stacked."""
    rng = np.random.default_rng(seed)
    sizes = cfg.axis_sizes()
    params = {}
    for kind, axes in PARAM_AXES.items():
        if kind == ("lm_head",) and cfg.tie_word_embeddings:
            continue
        shape = tuple(sizes[a] for a in axes)
        layered = kind[0] == "layers"
        if layered:
            shape = (cfg.num_layers,) + shape
        if kind[-1] in NORM_PARAMS or kind == ("norm", "weight"):
            value = np.ones(shape, np.float32)
        else:
            scale = std * (head_scale if kind == ("lm_head",) else 1.0)
            value = rng.normal(0.0, scale, shape).astype(np.float32)
        params |= {("layers", i, kind[1]): value[i] for i in range(cfg.num_layers)} if layered else {kind: value}
    return params


def random_model(cfg: Qwen3Config = TINY, dtype=jnp.float32, seed: int = 0, head_scale: float = 1.0,
                 vocab_size: int | None = None):
    """A `Qwen3` of shape `cfg` (optionally with another vocabulary size) with `random_params` weights."""
    if vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    return Qwen3.from_params(cfg, random_params(cfg, seed, head_scale=head_scale), dtype)


def named_configs() -> dict[str, Qwen3Config]:
    """`tiny`, `tiny-1k`, `small`, and one entry per packaged real config: `qwen3-0.6b`, `qwen3-4b`, ..."""
    out = {"tiny": TINY, "tiny-1k": TINY_1K, "small": SMALL}
    for f in sorted(resources.files("vase_jax.data").joinpath("configs").iterdir()):
        if f.name.endswith(".json"):
            with resources.as_file(f) as path:
                out[f.name[: -len(".json")].lower()] = Qwen3Config.from_json_file(path)
    return out


def shrink(cfg: Qwen3Config, layers: int | None = None, vocab: int | None = None, hidden: int | None = None,
           intermediate: int | None = None) -> Qwen3Config:
    """The same shape with another number of layers, vocabulary size, hidden or MLP width (heads unchanged):
    e.g. Qwen3-4B's 36 layers and heads with widths of 256, whose compile time is that of the real model."""
    sizes = {"layers": layers, "vocab": vocab, "hidden": hidden, "intermediate": intermediate}
    for name, v in sizes.items():
        if v is not None and v < 1:
            raise ValueError(f"--{name}={v} must be >= 1")
    return dataclasses.replace(cfg, num_layers=layers or cfg.num_layers, vocab_size=vocab or cfg.vocab_size,
                               hidden_size=hidden or cfg.hidden_size,
                               intermediate_size=intermediate or cfg.intermediate_size)


def named_or_pretrained(model: str, dtype, *, layers: int | None = None, vocab: int | None = None,
                        hidden: int | None = None, intermediate: int | None = None) -> tuple[Qwen3, str]:
    """`--model` as the benchmarks take it: a named shape (`named_configs`, changed by `shrink`) with Flax's
    initial weights (`nnx.Rngs(0)`), else a checkpoint folder or hub id (`Qwen3.from_pretrained`; the shape options
    are then a ValueError). Returns (the model, a description for reports)."""
    named, name = named_configs(), model.lower()
    if name in named:
        cfg = shrink(named[name], layers, vocab, hidden, intermediate)
        return Qwen3(cfg, dtype=dtype, rngs=nnx.Rngs(0)), (
            f"{name} (random weights, {cfg.num_layers} layers, hidden {cfg.hidden_size}, mlp {cfg.intermediate_size}, "
            f"vocab {cfg.vocab_size})")
    if any(v is not None for v in (layers, vocab, hidden, intermediate)):
        raise ValueError(f"--layers / --vocab / --hidden / --intermediate apply to named random models "
                         f"({', '.join(named)}) only, not to --model={model!r}")
    return Qwen3.from_pretrained(model, dtype=dtype), model
