"""Shared fixtures: tiny random HF Qwen3 checkpoints saved with `save_pretrained`, and the real Qwen3 tokenizer."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

VOCAB = 151936  # the real Qwen3 vocabulary, so the real tokenizer's ids are valid


def hf_tiny_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, rope_theta=10000.0,
              max_position_embeddings=8192, rms_norm_eps=1e-6)
    kw.update(overrides)
    return Qwen3Config(**kw)


def save_tiny_checkpoint(folder, seed: int = 0, dtype: str = "float32", init_std: float = 0.02, **overrides):
    """Random-init `Qwen3ForCausalLM`, saved with `save_pretrained`; returns (folder, hf_model)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    hf = Qwen3ForCausalLM(hf_tiny_config(initializer_range=init_std, **overrides)).eval()
    hf = hf.to(getattr(torch, dtype))
    hf.save_pretrained(folder)
    return folder, hf


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory):
    """2 layers, 4 query / 2 kv heads (GQA group 2), untied head."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_untied"))


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory):
    """3 layers, 8 query / 2 kv heads (GQA group 4), tied embeddings."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny_tied"), seed=1, num_hidden_layers=3,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tokenizer():
    import vase_jax as vj

    return vj.load_tokenizer()


PROMPTS = [
    "What is 2 + 2? Answer briefly.",
    "Write a haiku about the sea.",
    "Explain, step by step and in detail, why the sum of the angles of a triangle is 180 degrees in the plane.",
]


@pytest.fixture(scope="session")
def prompt_batch(tokenizer):
    import vase_jax as vj

    return vj.encode_prompts(tokenizer, PROMPTS)
