"""generate through the Pallas kernels (interpret mode on CPU) gives the XLA path's greedy tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vase_jax as vj


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    from conftest import save_tiny_checkpoint

    folder, _ = save_tiny_checkpoint(tmp_path_factory.mktemp("peaked_k"), seed=5, init_std=0.1)
    return vj.Qwen3.from_pretrained(str(folder), dtype=jnp.float32)


@pytest.mark.parametrize("method", ["full", "vase_attnv"])
def test_pallas_interpret_matches_xla_greedy(peaked, prompt_batch, method):
    ev = vj.EvictionConfig(method, budget=32, buffer=16, value_slots=8)
    outs = {}
    for impl in ("xla", "pallas"):
        cfg = vj.GenerateConfig(max_new_tokens=48, temperature=0.0, eos_token_ids=(), attention_impl=impl)
        outs[impl] = vj.generate(peaked, prompt_batch.input_ids, prompt_batch.attention_mask, key=jax.random.key(0),
                                 config=cfg, eviction=ev)
    if method != "full":
        assert int(outs["pallas"].evictions) >= 2
    np.testing.assert_array_equal(np.asarray(outs["pallas"].tokens), np.asarray(outs["xla"].tokens))
