"""Random Qwen3 models for offline smoke runs, tests and benchmarks: one definition of the tiny shape.

`TINY` is the shape of the test fixtures (2 layers, 4 query / 2 kv heads, head_dim 32) with the real Qwen3
vocabulary, so the packaged tokenizer's ids are valid. `random_model` draws weights with NumPy (no compile per
parameter shape): normal with std 0.02, RMSNorm scales 1, the output head's std times `head_scale`. With std 0.02
everywhere the next-token distribution over 151936 tokens is nearly uniform; a trained model's is peaked, as the
one with a scaled head is (the eval smoke run uses `HEAD_SCALE`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from vase_jax.config import NORM_PARAMS, PARAM_AXES, Qwen3Config
from vase_jax.model import Qwen3

TINY = Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=32, tie_word_embeddings=False, rope_theta=10000.0,
                   max_position_embeddings=1 << 16)
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
