"""generate through the Pallas kernels gives the XLA path's greedy tokens, with and without eviction (at least two
eviction events per run).

On a CPU host, "pallas" runs the Triton kernels through the Pallas interpreter and "pallas_tpu" the Mosaic TPU
kernels in TPU interpret mode (TPU semantics). On a GPU or a TPU, "pallas" runs that platform's kernels compiled
(`benchmarks/device_check.py` runs this file there).
"""

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


def _generate(model, batch, method: str, impl: str, max_new_tokens: int):
    cfg = vj.GenerateConfig(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_ids=(), attention_impl=impl)
    ev = vj.EvictionConfig(method, budget=32, buffer=16, value_slots=8)
    return vj.generate(model, batch.input_ids, batch.attention_mask, key=jax.random.key(0), config=cfg, eviction=ev)


@pytest.mark.slow
@pytest.mark.parametrize("impl,max_new_tokens", [("pallas", 32), ("pallas_tpu", 32)])
@pytest.mark.parametrize("method", ["full", "vase_attnv"])
def test_kernels_give_the_xla_greedy_tokens(peaked, prompt_batch, method, impl, max_new_tokens):
    xla = _generate(peaked, prompt_batch, method, "xla", max_new_tokens)
    out = _generate(peaked, prompt_batch, method, impl, max_new_tokens)
    if method != "full":
        assert int(out.evictions) >= 2
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(xla.tokens))
