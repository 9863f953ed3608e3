"""The README's custom-policy example runs as written, and a registered policy plugs into generate."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import vase_jax as vj
from vase_jax.eviction import METHODS

README = Path(__file__).resolve().parents[1] / "README.md"


def test_register_your_own_policy_example(tiny_untied, prompt_batch):
    text = README.read_text()
    section = text[text.index("### Register your own policy"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    try:
        exec(compile(code, "README.md", "exec"), namespace)
        assert "key_norm" in METHODS
        ev = namespace["ev"].validate()
        model = vj.Qwen3.from_pretrained(str(tiny_untied[0]), dtype=jnp.float32)
        small = vj.EvictionConfig("key_norm", budget=32, buffer=16)
        out = vj.generate(model, prompt_batch.input_ids, prompt_batch.attention_mask, key=jax.random.key(0),
                          eviction=small, config=vj.GenerateConfig(max_new_tokens=40, temperature=0.0,
                                                                   eos_token_ids=(), return_cache=True))
        assert int(out.evictions) >= 2 and ev.kept == 224
        # the kept keys are the smallest-norm candidates: every kept key's norm <= the norm of every evicted one is
        # not observable after the fact, but kept slots must all be valid and distinct
        for pos in out.cache.pos:
            kept = np.asarray(pos)[:, :, : small.kept]
            assert (kept >= 0).all()
            assert all(len(set(kept[r, h])) == small.kept for r in range(kept.shape[0]) for h in range(kept.shape[1]))
    finally:
        METHODS.pop("key_norm", None)
