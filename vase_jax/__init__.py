"""vase-jax: Qwen3 in JAX with a fixed-size KV cache and value-aware stochastic KV eviction (VaSE)."""

from vase_jax import eviction
from vase_jax.config import Qwen3Config
from vase_jax.eviction import EvictionConfig
from vase_jax.generate import GenerateConfig, GenerateOutput, generate
from vase_jax.model import Qwen3
from vase_jax.prompts import PromptBatch, encode_prompts, load_tokenizer

__all__ = [
    "EvictionConfig",
    "GenerateConfig",
    "GenerateOutput",
    "PromptBatch",
    "Qwen3",
    "Qwen3Config",
    "encode_prompts",
    "eviction",
    "generate",
    "load_tokenizer",
]
