"""No weight is copied: the compiled CPU program and the programs lowered for cuda and tpu read every weight where
it lives, and `generate` holds no more than the cache, one layer's worth of weights and one layer's eviction.

The model is abstract (`ShapeDtypeStruct` weights: nothing is allocated) and its widths are chosen so that no
array but a weight has a weight's shape: hidden 320, MLP 704, 4 query / 2 kv heads of 128, vocabulary 1000.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from hlo_utils import stablehlo_weight_slices

import vase_jax as vj
from pallas_kernels.dispatch import lowering_target
from vase_jax.aot import copying_reads
from vase_jax.cache import cache_bytes, init_cache
from vase_jax.config import Qwen3Config, param_shapes
from vase_jax.eviction import framework
from vase_jax.generate import lower_generate, query_window
from vase_jax.target import LAYER_LOOPS, Target

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

CFG = Qwen3Config(vocab_size=1000, hidden_size=320, intermediate_size=704, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=128)
METHODS = {"full": vj.EvictionConfig("full"), "vase_dkv": vj.EvictionConfig("vase_dkv", budget=192, buffer=64)}
BATCH, PROMPT, NEW = 2, 40, 256


def _model():
    return nnx.eval_shape(lambda: vj.Qwen3(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))


def weight_dims() -> set[tuple[int, ...]]:
    """Every parameter's dims, and the 2-D `[out, in]` views the projections read, with their stacked forms."""
    c, d = CFG, CFG.head_dim
    dims = {s for s in param_shapes(c).values() if len(s) > 1}
    dims |= {(c.num_heads * d, c.hidden_size), (c.num_kv_heads * d, c.hidden_size), (c.hidden_size, c.num_heads * d)}
    return dims | {(c.num_layers,) + s for s in dims}


def _lower(method: str, platform: str, loop: str = "auto"):
    ids = jnp.ones((BATCH, PROMPT), jnp.int32)
    config = vj.GenerateConfig(max_new_tokens=NEW, layer_loop=loop)
    with lowering_target(platform):
        return lower_generate(_model(), ids, ids, key=jax.random.key(0), config=config, eviction=METHODS[method],
                              platforms=(platform,))


def test_the_shapes_single_out_the_weights():
    """The premise of the checks below: a check by dims finds the weights and nothing else of the program (the
    cache and activations have other dims)."""
    cache = jax.eval_shape(lambda: init_cache(CFG, BATCH, 256, 64, jnp.bfloat16))
    others = {tuple(x.shape) for x in jax.tree.leaves(cache)} | {(BATCH, CFG.vocab_size), (BATCH, CFG.hidden_size)}
    assert not others & weight_dims()


@pytest.mark.slow
@pytest.mark.parametrize("loop", LAYER_LOOPS)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_compiled_cpu_program_copies_no_weight_and_holds_one_layer_at_most(method, loop):
    compiled = _lower(method, "cpu", loop).compile()
    copies = copying_reads(compiled.as_text(), weight_dims())
    assert copies == [], "\n".join(copies[:5])
    ev = METHODS[method]
    capacity = framework.capacity_for(ev, 64, NEW)
    cache = jax.eval_shape(lambda: init_cache(CFG, BATCH, capacity, query_window(ev), jnp.bfloat16,
                                              framework.slot_state(ev), Target.make("cpu")))
    layer = sum(math.prod(s) for p, s in param_shapes(CFG).items() if p[:2] == ("layers", 0)) * 2  # bf16 bytes
    # one layer's eviction temporaries: a few float32 values per candidate slot and kv head of each row
    eviction = BATCH * CFG.num_kv_heads * capacity * 4 * 16
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(f"{method} {loop}: temporaries {temp} B = cache {cache_bytes(cache)} + {temp - cache_bytes(cache)}; "
          f"one layer's weights {layer}, eviction {eviction}")
    assert temp - cache_bytes(cache) < layer + eviction


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_lowered_gpu_and_tpu_programs_slice_no_weight(method, platform):
    text = _lower(method, platform).as_text()
    types = {f"tensor<{'x'.join(map(str, dims))}xbf16>" for dims in weight_dims()}
    assert sum(text.count(t) for t in types) > 0  # the weights are in the program, under these types
    slices = stablehlo_weight_slices(text, types)
    assert slices == [], "\n".join(slices[:5])


def test_the_checks_see_a_weight_copy():
    """A scan over stacked weights slices a layer out of the stack at every step: both checks report it."""
    c = CFG
    stack = jax.ShapeDtypeStruct((c.num_layers, c.intermediate_size, c.hidden_size), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((BATCH, c.hidden_size), jnp.bfloat16)

    def scanned(stack, x):
        def step(h, _):
            return jax.lax.scan(lambda h, w: (jnp.tanh((h @ w.T) @ w), None), h, stack)[0], None
        return jax.lax.scan(step, x, None, length=4)[0]

    lowered = jax.jit(scanned).lower(stack, x)
    assert copying_reads(lowered.compile().as_text(), weight_dims())
    assert stablehlo_weight_slices(lowered.as_text(), {f"tensor<{c.num_layers}x{c.intermediate_size}x"
                                                       f"{c.hidden_size}xbf16>"})
