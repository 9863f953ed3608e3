"""The suite's canonical random models: the one tiny shape (`vase_jax.random_model.TINY`: 2 layers, 4 query / 2 kv
heads, head_dim 32), in the few forms the tests need, built once per process. Files that need a random model take
one of these, so that they share its shapes, and the programs compiled for them through the suite's persistent
compilation cache, instead of each drawing a variant of its own.

- `peaked(dtype)`: the head scaled by `HEAD_SCALE` (next-token distributions peaked like a trained model's, so
  that eviction changes tokens) and a `VOCAB`-token vocabulary, for random prompts; float32 or bfloat16.
- `full_vocab()`: float32, Qwen3's whole vocabulary (prompts from the real tokenizer), the same head scale.

Other shapes stay with the tests whose subject is the shape: Qwen3's head geometry for the lowering and memory
tests, 8 kv heads for the meshes, the HF checkpoints of `conftest` for parity with `transformers`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from vase_jax.model import Qwen3
from vase_jax.random_model import HEAD_SCALE, TINY, random_model

VOCAB = 4096  # random prompts draw ids below it


@functools.cache
def peaked(dtype: str = "float32") -> Qwen3:
    return random_model(TINY, getattr(jnp, dtype), head_scale=HEAD_SCALE, vocab_size=VOCAB)


@functools.cache
def full_vocab() -> Qwen3:
    return random_model(TINY, jnp.float32, head_scale=HEAD_SCALE)
