"""`generate` lowered for GPU (cuda) and TPU on this CPU host: the platform's Pallas kernels must be in the program.

For every packaged Qwen3 config's attention geometry (GQA groups 2, 4, 5 and 8 over 8 kv heads, head_dim 128), for
`full` and every eviction method, in bfloat16 or float32 (alternating: every geometry and every method is lowered in
both), `generate` (prefill, decode loop, eviction) is traced
with `attention_impl="auto"` at the paper's sizes (N = 2048, B = 64; 4096 new tokens) and lowered for `("cuda",)`
and for `("tpu",)`. Lowering runs every Pallas lowering rule (block shapes, unsupported ops) but does not compile:
the Triton -> PTX and Mosaic compilers run only on the device (`python -m benchmarks.device_check`).

The models are abstract (`nnx.eval_shape`): the real head geometry with a narrow residual stream (hidden 256),
one layer and a 512-token vocabulary, so tracing is cheap and no weights are allocated.
"""

from __future__ import annotations

import functools
import glob
import os
import re

import calibrations
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import vase_jax as vj
from pallas_kernels.dispatch import lowering_target
from vase_jax.config import Qwen3Config
from vase_jax.eviction.registry import METHODS
from vase_jax.generate import lower_generate

# jax >= 0.11.2 warns at every Triton lowering that the Pallas Triton backend is deprecated (it still lowers and
# runs); `test_triton_backend_deprecation_under_jax_0_11` keeps track of it, the other tests need not repeat it.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

CONFIG_DIR = os.path.join(os.path.dirname(vj.__file__), "data", "configs")
# methods whose policy calls the window-attention score (and so its kernel); rkv_official has its own scoring
SCORED = {"snapkv", "attn_sample", "range_attn", "range_sample_attn", "vase_attnv", "attn_random", "rkv"}
KERNELS = {
    "cuda": dict(marker="__gpu$xla.gpu.triton", decode="vase_decode_attention", mass="vase_window_scores_accumulate",
                 other="tpu_custom_call"),
    "tpu": dict(marker="tpu_custom_call", decode="vase_decode_attention_tpu", mass="vase_window_mass_tpu",
                other="__gpu$xla.gpu.triton"),
}


def _geometries() -> dict[tuple[int, int, int], list[str]]:
    """(num_heads, num_kv_heads, head_dim) -> the packaged configs that have it."""
    out: dict[tuple[int, int, int], list[str]] = {}
    for path in sorted(glob.glob(os.path.join(CONFIG_DIR, "*.json"))):
        cfg = Qwen3Config.from_json_file(path)
        out.setdefault((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), []).append(os.path.basename(path)[:-5])
    return out


GEOMETRIES = _geometries()
GEOMETRY_IDS = {g: f"g{g[0] // g[1]}-{'+'.join(names)}" for g, names in GEOMETRIES.items()}


def test_packaged_geometries_cover_the_gqa_groups():
    groups = sorted({h // kv for h, kv, _ in GEOMETRIES})
    assert groups == [2, 4, 5, 8]
    assert {d for _, _, d in GEOMETRIES} == {128}


@functools.cache
def _model(geometry: tuple[int, int, int], dtype: str) -> vj.Qwen3:
    num_heads, num_kv_heads, head_dim = geometry
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=1, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim)
    return nnx.eval_shape(lambda: vj.Qwen3(cfg, dtype=getattr(jnp, dtype), rngs=nnx.Rngs(0)))


def _lowered_texts(model, method: str) -> dict[str, str]:
    ids = jnp.ones((2, 20), jnp.int32)
    mask = jnp.ones((2, 20), jnp.int32).at[1, :5].set(0)  # row 1 left-padded
    # full-size caches (lowering costs the same whatever the sizes): several kernel blocks, a partial last one
    config = vj.GenerateConfig(max_new_tokens=4096, temperature=0.6, top_p=0.95)
    eviction = calibrations.eviction(method, model.cfg, budget=2048, buffer=64)
    texts = {}
    for platform in KERNELS:
        with lowering_target(platform):  # jax >= 0.11 on a CPU host: an abstract GPU for the Triton lowering
            lowered = lower_generate(model, ids, mask, key=jax.random.key(0), config=config, eviction=eviction,
                                     platforms=(platform,))
        texts[platform] = lowered.as_text()
    return texts


def _method_geometry_dtype() -> list:
    """Every method on two neighbouring geometries, one in each dtype: the r-th scored method (or the r-th
    unscored one) on geometries r and r + 1 (mod their count), so that each geometry is lowered in both dtypes by
    scored and unscored methods alike, and each method in both dtypes (the kernels' lowering rules see the
    geometry and the dtype; the method decides which kernels are called)."""
    methods = ["full", *sorted(METHODS)]
    geometries = list(GEOMETRIES)
    params = []
    for m in methods:
        r = [x for x in methods if (x in SCORED) == (m in SCORED)].index(m)
        for j in (r % len(geometries), (r + 1) % len(geometries)):
            g = geometries[j]
            params.append(pytest.param(m, g, ("bfloat16", "float32")[(r + j) % 2], id=f"{m}-{GEOMETRY_IDS[g]}"))
    return params


def test_the_lowered_combinations_cover_every_geometry_dtype_and_kernel():
    combos = {(m, g, d) for m, g, d in (p.values for p in _method_geometry_dtype())}
    for g in GEOMETRIES:
        for d in ("bfloat16", "float32"):
            assert {m in SCORED for m, g2, d2 in combos if (g2, d2) == (g, d)} == {True, False}, (g, d)
    assert {m for m, _, _ in combos} == {"full", *METHODS}
    assert all({d for m2, _, d in combos if m2 == m} == {"bfloat16", "float32"} for m, _, _ in combos)


@pytest.mark.slow
@pytest.mark.parametrize("method, geometry, dtype", _method_geometry_dtype())
def test_generate_lowers_with_the_platform_kernels(method, geometry, dtype):
    texts = _lowered_texts(_model(geometry, dtype), method)
    for platform, text in texts.items():
        names = KERNELS[platform]
        assert names["marker"] in text, f"{platform}: no Pallas kernel in the lowered generate"
        assert names["decode"] in text, f"{platform}: decode attention is not the Pallas kernel"
        assert names["other"] not in text, f"{platform}: the other platform's kernel was lowered"
        if method in SCORED:
            assert names["mass"] in text, f"{platform}: the window score is not the Pallas kernel"
        else:
            assert names["mass"] not in text, f"{platform}: {method} unexpectedly calls the window-score kernel"


def test_auto_lowers_no_kernel_for_the_host():
    geometry = next(iter(GEOMETRIES))
    model = _model(geometry, "float32")
    ids, mask = jnp.ones((1, 20), jnp.int32), jnp.ones((1, 20), jnp.int32)
    eviction = vj.EvictionConfig("vase_attnv", budget=256, buffer=64)
    text = lower_generate(model, ids, mask, key=jax.random.key(0), config=vj.GenerateConfig(max_new_tokens=8),
                          eviction=eviction, platforms=("cpu",)).as_text()
    assert "custom_call @__gpu" not in text and "tpu_custom_call" not in text


@functools.cache
def _deep_model(dtype: str) -> vj.Qwen3:
    """Three layers (so an unrolled program names layer_2), the Qwen3-8B attention geometry."""
    cfg = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=3, num_heads=32,
                      num_kv_heads=8, head_dim=128)
    return nnx.eval_shape(lambda: vj.Qwen3(cfg, dtype=getattr(jnp, dtype), rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("method", ["full", "vase_dkv"])
def test_each_platform_lowers_its_own_program(method):
    """`lower_generate(platforms=(p,))` lowers the program that p runs, whatever the host (`vase_jax.target`): for
    cuda and tpu a bf16 cache stored as bf16 and a lone row run alone, for cpu a cache stored as uint16 bits and
    the lone row beside a copy; unrolled layers (each its own code: `layer_2` in the locations) on cuda only; the
    MLP's gate and up projections ([rows, 768]) written in bf16 by their dots on cuda and tpu, in float32 (and cast)
    on cpu (`model.matmuls`)."""
    model = _deep_model("bfloat16")
    ids = jnp.ones((1, 20), jnp.int32)
    eviction = (vj.EvictionConfig(method) if method == "full"
                else calibrations.eviction(method, model.cfg, budget=256, buffer=64))
    for platform in ("cuda", "tpu", "cpu"):
        with lowering_target(platform):
            lowered = lower_generate(model, ids, ids, key=jax.random.key(0), eviction=eviction,
                                     config=vj.GenerateConfig(max_new_tokens=64), platforms=(platform,))
        text = lowered.as_text(debug_info=True)
        main = next(line for line in text.splitlines() if "func.func public @main" in line)
        ids_type = re.search(r'tensor<(\d+)x\d+xi32> loc\("input_ids"\)', main).group(1)
        cpu = platform == "cpu"
        # the cache [layers, rows, kv_heads, slots, head_dim] stored as uint16 bits only on CPU (the embedding is
        # gathered through its bits everywhere)
        assert bool(re.search(r"tensor<3x\d+x8x\d+x128xui16>", text)) == cpu, f"{platform}: cache storage"
        # the embedding table [vocab, embed] gathered through its uint16 bits only on CPU (on TPU the view would be
        # a relayout, a copy of the table)
        assert ("tensor<512x256xui16>" in text) == cpu, f"{platform}: embedding gather"
        assert ("layer_2/" in text) == (platform == "cuda"), f"{platform}: layer loop"
        # a lone row runs beside copies on CPU (as many as this machine's `RowRule` says), alone elsewhere
        assert (int(ids_type) >= 2) if cpu else ids_type == "1", f"{platform}: {ids_type} rows"
        mlp_dots = re.findall(r"stablehlo.dot_general.*-> tensor<[0-9x]*x768x(\w+)>", text)
        assert mlp_dots and set(mlp_dots) == {"f32" if cpu else "bf16"}, f"{platform}: MLP dots {mlp_dots}"


def test_a_lone_row_of_a_16_bit_model_runs_beside_a_copy_on_cpu_only():
    """With batch invariance off no `RowRule` pads the batch, but on CPU a lone row of a bf16 model still runs as
    two (`Target.min_rows`: its one-row matmuls would be matrix-vector products, 5-8x slower); a float32 one, and
    any lone row on cuda and tpu, runs alone."""
    ids = jnp.ones((1, 20), jnp.int32)
    config = vj.GenerateConfig(max_new_tokens=8, batch_invariant=False)
    for dtype, platform, rows in (("bfloat16", "cpu", 2), ("float32", "cpu", 1), ("bfloat16", "cuda", 1),
                                  ("bfloat16", "tpu", 1)):
        with lowering_target(platform):
            lowered = lower_generate(_deep_model(dtype), ids, ids, key=jax.random.key(0), config=config,
                                     platforms=(platform,))
        main = next(line for line in lowered.as_text(debug_info=True).splitlines() if "func.func public @main" in line)
        got = re.search(r'tensor<(\d+)x\d+xi32> loc\("input_ids"\)', main).group(1)
        assert got == str(rows), f"{dtype} on {platform}: {got} rows, expected {rows}"


def test_lowering_takes_one_known_platform():
    model = _deep_model("bfloat16")
    ids = jnp.ones((2, 8), jnp.int32)
    for platforms in (("cuda", "tpu"), ("metal",)):
        with pytest.raises(ValueError, match="one platform"):
            lower_generate(model, ids, ids, key=jax.random.key(0), platforms=platforms)
    with pytest.raises(ValueError, match="disagrees"):
        lower_generate(model, ids, ids, key=jax.random.key(0), config=vj.GenerateConfig(platform="tpu"),
                       platforms=("cuda",))


def test_small_model_is_abstract():
    # the lowering models hold no weights: only shapes (so every geometry is cheap, whatever its width)
    leaves = jax.tree.leaves(nnx.state(_model(next(iter(GEOMETRIES)), "bfloat16")))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


@pytest.mark.skipif(jax.__version_info__ < (0, 11), reason="jax < 0.11: the Pallas Triton backend is not deprecated")
def test_triton_backend_deprecation_under_jax_0_11():
    # jax 0.11.x (the GPU machine's) deprecates Pallas' Triton lowering: it warns, and lowers, on every call. When a
    # release stops lowering it, this test fails first: the GPU kernels then need the Mosaic GPU backend.
    model = _model(next(iter(GEOMETRIES)), "bfloat16")
    with pytest.warns(DeprecationWarning, match="Pallas Triton backend is deprecated"):
        texts = _lowered_texts(model, "full")
    assert KERNELS["cuda"]["decode"] in texts["cuda"]
