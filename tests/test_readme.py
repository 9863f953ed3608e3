"""The README's custom-policy examples (one stateless, one stateful) run as written and plug into generate."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vase_jax as vj
from vase_jax.eviction import METHODS

README = Path(__file__).resolve().parents[1] / "README.md"


def _check_kept(out, kept):
    for pos in out.cache.pos:
        pos = np.asarray(pos)[:, :, :kept]
        assert (pos >= 0).all()
        assert all(len(set(pos[r, h])) == kept for r in range(pos.shape[0]) for h in range(pos.shape[1]))


@pytest.mark.slow
def test_register_your_own_policy_examples(tiny_untied, prompt_batch):
    text = README.read_text()
    start = text.index("### Register your own policy")
    section = text[start:text.index("\n## ", start)]  # up to the next top-level section
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    namespace: dict = {}
    try:
        for code in blocks:
            exec(compile(code, "README.md", "exec"), namespace)
        assert {"key_norm", "recent_attention"} <= set(METHODS)
        assert namespace["ev"].validate().kept == 224 and namespace["ev_stateful"].validate().kept == 224
        assert not METHODS["key_norm"].state and METHODS["recent_attention"].state
        with pytest.raises(ValueError, match="largest"):
            vj.EvictionConfig("key_norm", budget=32, buffer=16, largest="yes").validate()
        with pytest.raises(ValueError, match="'recent_attention' has no option 'largest'"):
            vj.EvictionConfig("recent_attention", largest=True)
        model = vj.Qwen3.from_pretrained(str(tiny_untied[0]), dtype=jnp.float32)
        cfg = vj.GenerateConfig(max_new_tokens=40, temperature=0.0, eos_token_ids=(), return_cache=True)
        for method, extra in (("key_norm", {"largest": True}), ("recent_attention", {})):
            small = vj.EvictionConfig(method, budget=32, buffer=16, **extra)
            out = vj.generate(model, prompt_batch.input_ids, prompt_batch.attention_mask, key=jax.random.key(0),
                              eviction=small, config=cfg)
            assert int(out.evictions) >= 2, method
            _check_kept(out, small.kept)
            if method == "recent_attention":  # the state lives in the cache, finite and non-negative
                mass = np.asarray(out.cache.state["recent_mass"])
                assert np.isfinite(mass).all() and (mass >= 0).all() and mass.max() > 0
                for r, length in enumerate(np.asarray(out.cache_length).tolist()):  # each row's own length
                    assert (mass[:, r, :, length:] == 0).all()
    finally:
        METHODS.pop("key_norm", None)
        METHODS.pop("recent_attention", None)
