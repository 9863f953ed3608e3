"""`vase_jax.jit`: compiled programs hold memory mappings; the library warns near the limit, the guard releases them."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import models
import pytest

from vase_jax import jit
from vase_jax.target import CPU_COMPILER_OPTIONS, Target

pytestmark = pytest.mark.skipif(jit.mapping_count() is None, reason="no /proc/self/maps: not Linux")


def _many_kernels(x):
    # several fusions that XLA:CPU cannot merge (each reduction feeds the next), so several kernels to load
    for i in range(8):
        x = jnp.cumsum(jnp.sin(x) * (i + 1), axis=-1)
    return x


@pytest.mark.slow
def test_compiled_programs_hold_mappings_until_released():
    traces = []

    def counted(x):
        traces.append(1)
        return _many_kernels(x)

    f = jax.jit(counted)
    x = jnp.arange(64.0).reshape(8, 8)
    f(x).block_until_ready()  # runtime warm: what follows counts the program only
    jax.clear_caches()
    before = jit.mapping_count()
    f(x + 1).block_until_ready()
    compiled = jit.mapping_count()
    assert compiled >= before + 3, (before, compiled)  # code, read-only data and data of at least one kernel
    assert jit.release_programs_near_mapping_limit(share=1.0) is False  # far below the limit: nothing cleared
    f(x).block_until_ready()
    assert len(traces) == 2  # still cached
    with pytest.warns(RuntimeWarning, match="max_map_count"):
        assert jit.release_programs_near_mapping_limit(share=0.0) is True
    assert jit.mapping_count() < compiled  # the program's mappings are gone with it
    f(x).block_until_ready()
    assert len(traces) == 3  # cleared: traced and compiled again


def test_target_jit_warns_once_near_the_limit_and_never_clears(monkeypatch):
    f = jit.target_jit(lambda x, target: _many_kernels(x), static_argnums=(1,), target_argnum=1)
    cpu = Target.make("cpu")
    monkeypatch.setattr(jit, "MAPPING_SHARE", 0.0)  # every compile is now past the share
    monkeypatch.setattr(jit, "_warned", False)
    with pytest.warns(RuntimeWarning, match="release_programs_near_mapping_limit"):
        f(jnp.ones((4, 8)), cpu)
    assert f.traces == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second compile is silent
        f(jnp.ones((4, 16)), cpu)
        f(jnp.ones((4, 8)), cpu)  # the first program is still cached: the library cleared nothing
    assert f.traces == 2


def test_target_jit_compiles_with_the_target_options_and_counts_traces():
    f = jit.target_jit(lambda x, target: x * 2, static_argnums=(1,), target_argnum=1)
    for _ in range(3):
        f(jnp.ones(3), Target.make("cpu"))
    f(jnp.ones(3), Target.make("cpu", "unroll"))  # another target: another program
    assert f.traces == 2
    assert Target.make("cpu").compiler_options() == CPU_COMPILER_OPTIONS
    assert Target.make("cuda").compiler_options() is None and Target.make("cpu").compiler_options(sharded=True) is None


@pytest.mark.slow
def test_generate_is_loaded_from_the_persistent_compilation_cache():
    """The suite runs with JAX's persistent cache on (`conftest`, `enable_compilation_cache`): after its in-memory
    caches are cleared, `generate`'s program is loaded from the cache folder, not compiled again (no part of it,
    Pallas kernels or callbacks, keeps it out of the cache)."""
    import vase_jax as vj

    assert jax.config.jax_compilation_cache_dir
    model = models.full_vocab()
    ids = jnp.ones((2, 7), jnp.int32)
    config = vj.GenerateConfig(max_new_tokens=13)
    eviction = vj.EvictionConfig("vase_attnv", budget=32, buffer=8)
    events: list[str] = []

    def listen(name, **_):
        events.append(name)

    jax.monitoring.register_event_listener(listen)
    try:
        first = vj.generate(model, ids, ids, key=jax.random.key(0), config=config, eviction=eviction).tokens
        jax.clear_caches()
        events.clear()
        again = vj.generate(model, ids, ids, key=jax.random.key(0), config=config, eviction=eviction).tokens
    finally:
        jax.monitoring.unregister_event_listener(listen)
    assert "/jax/compilation_cache/cache_hits" in events
    assert (first == again).all()

