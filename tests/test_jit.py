"""`vase_jax.jit`: compiled programs hold memory mappings, and `backend_jit` releases them before the limit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from vase_jax import jit


def _many_kernels(x):
    # several fusions that XLA:CPU cannot merge (each reduction feeds the next), so several kernels to load
    for i in range(8):
        x = jnp.cumsum(jnp.sin(x) * (i + 1), axis=-1)
    return x


@pytest.mark.skipif(jit.mapping_count() is None, reason="no /proc/self/maps: not Linux")
def test_compiled_programs_hold_mappings_until_released():
    f = jax.jit(_many_kernels)
    x = jnp.arange(64.0).reshape(8, 8)
    f(x).block_until_ready()  # runtime warm: what follows counts the program only
    jax.clear_caches()
    before = jit.mapping_count()
    f(x + 1).block_until_ready()
    compiled = jit.mapping_count()
    assert compiled >= before + 3, (before, compiled)  # code, read-only data and data of at least one kernel
    assert jit.release_programs_near_mapping_limit(share=1.0) is False  # far below the limit: nothing cleared
    assert f._cache_size() == 1
    with pytest.warns(RuntimeWarning, match="max_map_count"):
        assert jit.release_programs_near_mapping_limit(share=0.0) is True
    assert f._cache_size() == 0
    assert jit.mapping_count() < compiled  # the program's mappings are gone with it


@pytest.mark.skipif(jit.mapping_count() is None, reason="no /proc/self/maps: not Linux")
def test_backend_jit_clears_caches_past_the_share_and_keeps_counting_compiles(monkeypatch):
    f = jit.backend_jit(_many_kernels)
    x = jnp.ones((4, 8))
    f(x)
    assert f._cache_size() == 1
    monkeypatch.setattr(jit, "MAPPING_SHARE", 0.0)  # every compile is now past the share
    with pytest.warns(RuntimeWarning, match="compiled-program caches are cleared"):
        f(jnp.ones((4, 16)))  # a new shape: compiles, then clears every cache
    assert f._cache_size() == 2  # compiles so far, not the programs held now
    with pytest.warns(RuntimeWarning):
        f(jnp.ones((4, 16)))  # compiled again after the clear: counted, cleared again
    assert f._cache_size() == 3
    monkeypatch.setattr(jit, "MAPPING_SHARE", 0.5)
    f(jnp.ones((4, 16)))  # cleared after the last call: compiles, and now stays cached
    f(jnp.ones((4, 16)))
    assert f._cache_size() == 4
    assert jit.mapping_limit() is None or jit.mapping_limit() > 0
