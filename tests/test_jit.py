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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llvm_level_1_gives_the_numbers_of_level_2(dtype):
    """The suite compiles with LLVM at -O1 (`conftest`: XLA's HLO passes, which the tests inspect, are the same,
    and compiling is faster). That holds only while -O1 and XLA's default -O2 compute the same numbers: no
    fast-math, so both emit the same IEEE operations. Checked here, bit for bit, on the pieces of `generate` that
    compute in floating point: a prefill, decode steps, an eviction event of a stochastic, a top-k and a
    leverage-score method, and a decode step on the evicted cache (with `generate`'s CPU options)."""
    from flax import nnx

    import vase_jax as vj
    from vase_jax.eviction import framework
    from vase_jax.generate import decode_step, prefill, query_window

    model = models.peaked(dtype)
    graphdef, state = nnx.split(model)
    ids = jax.random.randint(jax.random.key(1), (3, 32), 0, models.VOCAB, jnp.int32)

    def pieces(state, ids, method):
        ev = vj.EvictionConfig(method, budget=16, buffer=8)
        m = nnx.merge(graphdef, state)

        def greedy_step(carry, _):  # a loop, as in `generate`: one step's program, not four
            logits, cache = decode_step(m, carry[1], jnp.argmax(carry[0], -1).astype(jnp.int32))
            return (logits, cache), logits

        first, cache = prefill(m, ids, jnp.ones_like(ids), 48, query_window(ev), state=framework.slot_state(ev))
        (logits, cache), steps = jax.lax.scan(greedy_step, (first, cache), length=4)
        due = jnp.full_like(cache.length, ev.budget + ev.buffer)
        cache = framework.evict(cache.replace(length=due, seen=due), ev, jax.random.key(2), jnp.arange(3))
        return [first, steps, decode_step(m, cache, jnp.argmax(logits, -1).astype(jnp.int32))[0]], cache

    for method in ("vase_dkv", "snapkv", "curdkv"):
        results = [jax.jit(pieces, static_argnums=2, compiler_options=dict(
            CPU_COMPILER_OPTIONS, xla_backend_optimization_level=level))(state, ids, method) for level in (1, 2)]
        assert (results[0][1].length == 16).all(), method  # the event ran: every row at its budget
        o1, o2 = (jax.tree.leaves(r) for r in results)
        assert len(o1) == len(o2) > 3
        for a, b in zip(o1, o2, strict=True):
            assert a.dtype == b.dtype and bytes(jax.device_get(a).data) == bytes(jax.device_get(b).data), method
