"""Sharding over a ("data", "model") mesh: the rules table, validation, and `generate` on 8 simulated devices.

Multi-device tests run in a subprocess with its own XLA_FLAGS (8 CPU devices); this process keeps 1 device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from vase_jax import aot
from vase_jax.cache import init_cache
from vase_jax.config import PARAM_AXES, param_kind, param_shapes
from vase_jax.eviction.registry import SlotState
from vase_jax.random_model import TINY
from vase_jax.sharding import (
    RULES,
    cache_specs,
    check_mesh,
    param_specs,
    parse_mesh,
    per_device_bytes,
    spec_for,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny Qwen3 with 8 kv heads (as every real Qwen3) and a vocabulary that 8 divides.
MODEL_SETUP = """
import dataclasses, json, sys
import jax, jax.numpy as jnp, numpy as np
import vase_jax as vj
from vase_jax.jit import enable_compilation_cache
from vase_jax.random_model import HEAD_SCALE, TINY, random_model
from vase_jax.sharding import make_mesh, shard_model
enable_compilation_cache()  # the suite's ($VASE_JAX_COMPILATION_CACHE): programs and probed rules shared
cfg = dataclasses.replace(TINY, num_heads=16, num_kv_heads=8, head_dim=16, vocab_size=512)
model = random_model(cfg, head_scale=HEAD_SCALE)
rng = np.random.default_rng(0)
ids = rng.integers(0, 512, (8, 20)).astype(np.int32)
mask = np.ones((8, 20), np.int32)
mask[1, :5] = 0
mask[3, :9] = 0
def config(greedy, **kw):
    return vj.GenerateConfig(max_new_tokens=40, temperature=0.0 if greedy else 0.8, eos_token_ids=(),
                             prompt_buckets=(32,), **kw)
def eviction(method, **kw):
    if method == "triattention":  # statistics of random numbers (the code path, not the method's quality)
        import tempfile
        from vase_jax.calibration import random_statistics
        from vase_jax.eviction.triattention import save_calibration
        kw["calibration"] = save_calibration(tempfile.mkdtemp(), random_statistics(cfg))
    return vj.EvictionConfig(method) if method == "full" else vj.EvictionConfig(method, budget=24, buffer=8, **kw)
"""


def run_devices(script: str, devices: int = 8, timeout: int = 600) -> dict:
    """Run `script` (which prints one JSON line last) in a fresh Python with `devices` CPU devices."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"  # the last count wins
    env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", MODEL_SETUP + textwrap.dedent(script)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the rules table and validation (one device) ---------------------------------------------------------------
def test_parse_mesh():
    assert parse_mesh("data=2,model=4") == {"data": 2, "model": 4}
    assert parse_mesh("model=8") == {"data": 1, "model": 8}
    assert parse_mesh(" data=4 ") == {"data": 4, "model": 1}
    for bad, words in [("pipe=2", "'pipe=2'"), ("data=0", "positive"), ("data=x", "positive"),
                       ("data=2,data=2", "twice"), ("model", "AXIS=SIZE")]:
        with pytest.raises(ValueError, match=words):
            parse_mesh(bad)


def test_rules_table():
    assert RULES == {"batch": "data", "q_heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
    specs = param_specs(TINY)
    assert set(specs) == set(param_shapes(TINY))  # every parameter, each layer's own
    assert {param_kind(p) for p in specs} == set(PARAM_AXES)
    assert specs[("embedding",)] == P("model", None)
    assert specs[("lm_head",)] == P("model", None)  # [vocab, embed]
    for i in range(TINY.num_layers):
        assert specs[("layers", i, "q_proj")] == P("model", None, None)  # [q_heads, head_dim, embed]
        assert specs[("layers", i, "o_proj")] == P(None, "model", None)  # [embed, q_heads, head_dim]
        assert specs[("layers", i, "down_proj")] == P(None, "model")  # [embed, mlp]
        assert specs[("layers", i, "q_norm")] == P(None)


def test_check_mesh_errors():
    cfg = TINY  # 2 kv heads, 4 query heads, mlp 128, vocab 151936
    check_mesh(cfg, AbstractMesh((4, 2), ("data", "model")), batch=8)
    with pytest.raises(ValueError, match=r"model=4 does not divide kv_heads=2 .*never replicated"):
        check_mesh(cfg, AbstractMesh((1, 4), ("data", "model")))
    with pytest.raises(ValueError, match=r"model=3 does not divide kv_heads=2"):
        check_mesh(cfg, AbstractMesh((1, 3), ("data", "model")))
    with pytest.raises(ValueError, match=r"data=4 does not divide the batch of 6 rows"):
        check_mesh(cfg, AbstractMesh((4, 1), ("data", "model")), batch=6)
    with pytest.raises(ValueError, match=r"not known"):
        check_mesh(cfg, AbstractMesh((2,), ("pipe",)))


def test_cache_specs_follow_axis_names():
    """Derived from CACHE_AXES / STATE_AXES: batch -> data, kv heads -> model; per-row counters over data."""
    cache = jax.eval_shape(lambda: init_cache(TINY, 4, 64, 8, jnp.float32, (SlotState("acc"),)))
    specs = cache_specs(cache)
    assert specs.k == specs.v == P(None, "data", "model", None, None)
    assert specs.pos == P(None, "data", "model", None)
    assert specs.queries == P(None, "data", "model", None, None, None)
    assert specs.query_valid == P("data", None)
    assert specs.row_pos == P("data")
    assert specs.state == {"acc": P(None, "data", "model", None)}
    for name in ("length", "seen", "evictions", "active"):  # one per row
        assert getattr(specs, name) == P("data")


def test_per_device_bytes():
    assert per_device_bytes((8, 16, 4), jnp.bfloat16, spec_for(("batch", "kv_heads", "head_dim")),
                            {"data": 2, "model": 4}) == 4 * 4 * 4 * 2


# ---- generate on simulated devices -----------------------------------------------------------------------------
# rows only, rows and heads, heads only; on 4 devices (8 virtual devices on 2 cores ran each program ~2x slower)
MESHES = [(4, 1), (2, 2), (1, 4)]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["full", "vase_dkv"])  # vase_attnv on meshes: tests/test_distributed.py
def test_generate_on_meshes_matches_one_device(method):
    """Every mesh gives the tokens of one device. Greedy and sampled alternate over the meshes (and the
    alternation flips per method), so each method runs both modes and each mesh runs both over the two methods,
    while each subprocess compiles five programs, not eight. Evicting methods evict several times."""
    flip = ["full", "vase_attnv", "vase_dkv"].index(method) % 2
    plan = [(d, m, bool((i + flip) % 2)) for i, (d, m) in enumerate(MESHES)]
    result = run_devices(f"""
        method = {method!r}
        ref = {{}}
        for greedy in (False, True):
            out = vj.generate(model, ids, mask, key=jax.random.key(3), config=config(greedy),
                              eviction=eviction(method))
            ref[greedy] = (np.asarray(out.tokens), int(out.evictions))
        rows = []
        for d, m, greedy in {plan!r}:
            sharded = shard_model(model, make_mesh(d, m))
            out = vj.generate(sharded, ids, mask, key=jax.random.key(3), config=config(greedy),
                              eviction=eviction(method))
            tokens = np.asarray(out.tokens)
            rows.append(dict(mesh=[d, m], greedy=greedy, evictions=int(out.evictions),
                             ref_evictions=ref[greedy][1],
                             same=[int(np.argmin(np.append(a == b, False))) for a, b in zip(tokens, ref[greedy][0])],
                             sharding=str(out.tokens.sharding.spec)))
        print(json.dumps(rows))
    """, devices=4)
    for row in result:
        assert row["same"] == [40] * 8, row  # the first differing step per row (40: none)
        assert row["evictions"] == row["ref_evictions"]
        if method != "full":
            assert row["evictions"] >= 3, row


@pytest.mark.slow
def test_mixed_precision_cache_on_a_mesh_matches_one_device():
    """A K4V4 cache on a mesh of rows and heads (data=2, model=2) gives the tokens and evictions of one device:
    both tiers of a row and head live on one device, the ticks and the evictions run per device, and the two
    tiers' attention partials (the 16-bit tier's through `pallas_kernels.per_device`) merge there."""
    result = run_devices("""
        rows = []
        for method, greedy in (("full", True), ("vase_attnv", False)):
            kv = config(greedy, key_bits=4, value_bits=4)
            ref = vj.generate(model, ids, mask, key=jax.random.key(3), config=kv, eviction=eviction(method))
            out = vj.generate(shard_model(model, make_mesh(2, 2)), ids, mask, key=jax.random.key(3), config=kv,
                              eviction=eviction(method))
            rows.append(dict(method=method, evictions=int(out.evictions), ref_evictions=int(ref.evictions),
                             same=[int(np.argmin(np.append(a == b, False)))
                                   for a, b in zip(np.asarray(out.tokens), np.asarray(ref.tokens))]))
        print(json.dumps(rows))
    """, devices=4)
    for row in result:
        assert row["same"] == [40] * 8, row  # the first differing step per row (40: none)
        assert row["evictions"] == row["ref_evictions"]
        if row["method"] != "full":
            assert row["evictions"] >= 3, row


@pytest.mark.slow
def test_chunked_prefill_and_prompt_compression_on_a_mesh_match_one_device():
    """The chunked prefill (chunks of 16 over the 32-column bucket) gives one device's dense tokens on a mesh of
    rows and heads, for a method with a query ring (vase_attnv) and one with per-slot state (h2o); prompt
    compression (N = 16 < the prompts) evicts per device like one device does."""
    result = run_devices("""
        rows = []
        for method, chunk, compress in (("vase_attnv", 16, False), ("h2o", 16, False), ("vase_attnv", 16, True)):
            ev = vj.EvictionConfig(method, budget=16, buffer=8, compress_prompt=compress)
            ref = vj.generate(model, ids, mask, key=jax.random.key(3), config=config(True), eviction=ev)
            out = vj.generate(shard_model(model, make_mesh(2, 2)), ids, mask, key=jax.random.key(3),
                              config=config(True, prefill_chunk=chunk), eviction=ev)
            rows.append(dict(method=method, compress=compress, evictions=int(out.evictions),
                             ref_evictions=int(ref.evictions),
                             same=[int(np.argmin(np.append(a == b, False)))
                                   for a, b in zip(np.asarray(out.tokens), np.asarray(ref.tokens))]))
        print(json.dumps(rows))
    """, devices=4)
    for row in result:
        assert row["same"] == [40] * 8, row  # the first differing step per row (40: none)
        assert row["evictions"] == row["ref_evictions"] >= 3, row


@pytest.mark.slow
def test_mesh_hlo_keeps_eviction_local_and_bad_input():
    """Compiled on a (2, 4) mesh: no all-gather or all-to-all of slot-sized data in any loop (decode steps and the
    eviction branch); bad meshes fail with a clear error before compiling."""
    result = run_devices("""
        import re
        sys.path.insert(0, "tests")
        from hlo_utils import computations, _reachable
        from vase_jax.generate import lower_generate
        sharded = shard_model(model, make_mesh(2, 4))
        conf, ev = config(False), eviction("vase_attnv")
        hlo = lower_generate(sharded, ids, mask, key=jax.random.key(3), config=conf, eviction=ev).compile().as_text()
        comps = computations(hlo)
        bodies = {b for lines in comps.values() for line in lines for b in re.findall(r"body=%?([\\w.\\-]+)", line)}
        collectives = []
        for name in _reachable(comps, bodies):
            for line in comps[name]:
                m = re.search(r"= \\w+\\[([\\d,]*)\\]\\S* (all-gather|all-to-all|all-reduce|collective-permute)", line)
                if m:
                    collectives.append([m.group(2), [int(x) for x in m.group(1).split(",") if x]])
        errors = {}
        for name, fn in [
            ("model3", lambda: shard_model(model, make_mesh(1, 3))),
            ("data_batch", lambda: vj.generate(shard_model(model, make_mesh(4, 2)), ids[:6], mask[:6],
                                               key=jax.random.key(0), config=conf)),
            ("devices", lambda: make_mesh(2, 8)),
        ]:
            try:
                fn()
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)
        from vase_jax.eviction import framework
        capacity = framework.capacity_for(ev, 32, conf.max_new_tokens)  # as generate: the prompt bucket
        print(json.dumps(dict(collectives=collectives, errors=errors, capacity=capacity)))
    """)
    capacity = result["capacity"]  # slots; candidates: capacity - buffer
    slot_sized = [c for c in result["collectives"] if c[0] in ("all-gather", "all-to-all")
                  and ({capacity, capacity - 8} & set(c[1]))]
    assert not slot_sized, slot_sized
    assert not [c for c in result["collectives"] if c[0] == "all-to-all"]
    assert any(c[0] == "all-reduce" for c in result["collectives"])  # the model axis does communicate (o_proj)
    errors = result["errors"]
    assert "model=3 does not divide kv_heads=8" in errors["model3"]
    assert "data=4 does not divide the batch of 6 rows" in errors["data_batch"]
    assert "needs 16 devices" in errors["devices"]


# ---- loading straight into shards -------------------------------------------------------------------------------
@pytest.mark.slow
def test_from_pretrained_with_mesh_safetensors_and_orbax(tmp_path):
    """A sharded safetensors checkpoint (several files) and its orbax conversion, loaded with mesh=(2, 4): every
    parameter has its rule's sharding (each device holds only its shard), values equal the unsharded load's, and
    the logits equal the unsharded model's. A mesh from `jax.make_mesh` (Explicit axes) loads and generates as
    `make_mesh`'s does."""
    from conftest import save_tiny_checkpoint

    _, hf = save_tiny_checkpoint(tmp_path / "one_file", seed=2, num_attention_heads=16, num_key_value_heads=8,
                                 head_dim=16, vocab_size=512)
    folder = tmp_path / "hf"
    hf.save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) > 3  # really sharded
    result = run_devices(f"""
        from flax import nnx
        from vase_jax import weights
        from vase_jax.sharding import param_shardings
        folder = {str(folder)!r}
        plain = vj.Qwen3.from_pretrained(folder, dtype=jnp.float32)
        weights.save_orbax(plain, {str(tmp_path / "orbax")!r}, source=folder)
        mesh = make_mesh(2, 4)
        want = param_shardings(plain.cfg, mesh)
        ids_ = jnp.asarray(ids)
        ref = np.asarray(plain(ids_, jnp.asarray(mask)))
        out = {{}}
        for kind, path in (("safetensors", folder), ("orbax", {str(tmp_path / "orbax")!r})):
            model_ = vj.Qwen3.from_pretrained(path, dtype=jnp.float32, mesh=mesh)
            flat = weights.flat_params(model_)
            wrong = [".".join(map(str, p)) for p, x in flat.items()
                     if not x.sharding.is_equivalent_to(want[p], x.ndim)
                     or any(s.data.shape != want[p].shard_shape(x.shape) for s in x.addressable_shards)]
            unequal = [".".join(map(str, p)) for p, x in flat.items()
                       if not np.array_equal(np.asarray(x), np.asarray(weights.flat_params(plain)[p]))]
            logits = np.asarray(jax.jit(lambda m, a, b: m(a, b))(model_, ids_, jnp.asarray(mask)))
            out[kind] = dict(wrong=wrong, unequal=unequal, n=len(flat), diff=float(np.abs(logits - ref).max()),
                             scale=float(np.abs(ref).max()))
        # a mesh made the way JAX users make one (its axes are Explicit in current JAX) works as make_mesh's
        explicit = jax.make_mesh((2, 4), ("data", "model"))
        def tokens(m):
            return np.asarray(vj.generate(m, ids, mask, key=jax.random.key(0), config=config(True),
                                          eviction=eviction("vase_attnv")).tokens).tolist()
        want_tokens = tokens(vj.Qwen3.from_pretrained(folder, dtype=jnp.float32, mesh=mesh))
        out["explicit"] = dict(axis_types=[str(t) for t in explicit.axis_types],
                               loaded=tokens(vj.Qwen3.from_pretrained(folder, dtype=jnp.float32, mesh=explicit))
                               == want_tokens, sharded=tokens(shard_model(plain, explicit)) == want_tokens)
        print(json.dumps(out))
    """)
    explicit = result.pop("explicit")
    assert explicit["loaded"] and explicit["sharded"], explicit
    for kind, r in result.items():
        assert r["n"] == 3 + 11 * 2 and r["wrong"] == [] and r["unequal"] == [], (kind, r)  # 2 layers of 11
        assert r["diff"] <= 1e-5 * max(1.0, r["scale"]), (kind, r)  # float32; only the summation order differs


# ---- the memory planner -------------------------------------------------------------------------------------------
def _plan(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "scripts/plan.py", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_plan_script_counts_per_device_bytes():
    """Weights and cache per device, counted here by hand from the shapes; temporaries from the compiled program."""
    import math

    from vase_jax.config import param_shapes
    from vase_jax.random_model import named_configs

    proc = _plan("--model", "tiny-1k", "--target", "cpu", "--mesh", "data=2,model=2", "--batch", "4", "--budget",
                 "48", "--buffer", "16", "--prompt", "40", "--max-new-tokens", "256", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = named_configs()["tiny-1k"]
    from vase_jax.config import param_kind

    model_sharded = {("embedding",), ("lm_head",)} | {("layers", n) for n in ("q_proj", "k_proj", "v_proj",
                                                                              "o_proj", "gate_proj", "up_proj",
                                                                              "down_proj")}
    weights = sum(math.prod(s) * 2 // (2 if param_kind(p) in model_sharded else 1)
                  for p, s in param_shapes(cfg).items())
    cap, window = out["capacity"], 16  # bf16; the query ring of vase_attnv holds `buffer` queries
    per_row_head = cfg.num_layers * cap * (2 * cfg.head_dim * 2 + 4) + cfg.num_layers * cfg.group * window * \
        cfg.head_dim * 2  # k, v, pos, queries per (row, kv head)
    # rows and heads over 4 devices; per row over 2: query_valid [4, window] bool, row_pos, length, seen,
    # evictions, prompt_length [4] int32, active [4] bool
    cache = per_row_head * 4 * cfg.num_kv_heads // 4 + (4 * window + 5 * 4 * 4 + 4) // 2
    got = out["per_device_bytes"]
    assert got["weights"] == weights
    assert got["cache"] == cache
    assert out["compiled_bytes"]["temporaries"] > got["cache"]  # the cache is created inside the program
    assert got["inputs"] >= 0 and got["temporaries"] > 0 and got["outputs"] > 0
    assert sum(v for k, v in got.items() if k != "total") == got["total"]  # the table adds up


def test_plan_script_takes_the_prompt_settings():
    """--compress-prompt: the cache holds N + B slots whatever the prompt (with `full` refused); --prefill-chunk
    reaches the config."""
    import vase_jax as vj
    from vase_jax.eviction import framework

    args = ("--model", "tiny-1k", "--target", "cpu", "--batch", "4", "--budget", "48", "--buffer", "16",
            "--prompt", "4000", "--max-new-tokens", "256", "--no-compile", "--json")
    kept = json.loads(_plan(*args).stdout.strip().splitlines()[-1])
    out = json.loads(_plan(*args, "--compress-prompt", "--prefill-chunk", "512").stdout.strip().splitlines()[-1])
    assert kept["capacity"] >= 4096 + 16 and kept["prefill_chunk"] == 256 and not kept["compress_prompt"]
    assert out["capacity"] == framework.capacity_for(vj.EvictionConfig("rkv", budget=48, buffer=16,
                                                                        compress_prompt=True), 4096, 256) == 64
    assert out["compress_prompt"] and out["prefill_chunk"] == 512
    assert out["per_device_bytes"]["cache"] < kept["per_device_bytes"]["cache"] / 40
    bad = _plan(*args, "--method", "full", "--compress-prompt")
    assert bad.returncode == 2 and "compress_prompt=True needs an evicting method" in bad.stderr, bad.stderr
    bad = _plan(*args, "--prefill-chunk", "8")
    assert bad.returncode == 2 and "--prefill-chunk=8" in bad.stderr, bad.stderr


@pytest.mark.slow
def test_plan_script_bad_input():
    proc = _plan("--model", "qwen3-32b", "--mesh", "data=1,model=16", "--batch", "16")
    assert proc.returncode == 2 and "model=16 does not divide kv_heads=8" in proc.stderr, proc.stderr
    proc = _plan("--model", "qwen3-32b", "--mesh", "data=2,pipe=2", "--batch", "16")
    assert proc.returncode == 2 and "'pipe=2'" in proc.stderr, proc.stderr
    proc = _plan("--model", "qwen3-32b", "--mesh", "data=4", "--batch", "6", "--no-compile")
    assert proc.returncode == 2 and "data=4 does not divide the batch of 6" in proc.stderr, proc.stderr
    if aot.missing("v5p"):  # a device target's figures need its compiler: a clear refusal without it
        proc = _plan("--model", "tiny", "--target", "v5p", "--batch", "2")
        assert proc.returncode == 2 and "libtpu" in proc.stderr and "--target cpu" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_lowers_for_cuda_and_tpu_under_a_mesh():
    """On a (2, 4) mesh the program still lowers for GPU and TPU: the Pallas kernels (decode attention, window
    score) as Triton / Mosaic calls inside manual (shard_map) regions."""
    result = run_devices("""
        from pallas_kernels.dispatch import lowering_target
        from vase_jax.generate import lower_generate
        sharded = shard_model(model, make_mesh(2, 4))
        out = {}
        for platform in ("cuda", "tpu"):
            with lowering_target(platform):
                text = lower_generate(sharded, ids, mask, key=jax.random.key(0), config=config(False),
                                      eviction=eviction("vase_attnv"), platforms=(platform,)).as_text()
            out[platform] = dict(triton="__gpu$xla.gpu.triton" in text, mosaic="tpu_custom_call" in text,
                                 manual="manual_computation" in text)
        print(json.dumps(out))
    """)
    assert result["cuda"] == dict(triton=True, mosaic=False, manual=True), result
    assert result["tpu"] == dict(triton=False, mosaic=True, manual=True), result


@pytest.mark.slow
def test_pallas_kernels_per_device_match_one_device():
    """attention_impl="pallas" (the Triton kernels in interpret mode on CPU): decode attention and the window
    score run per device inside shard_map on a (2, 4) mesh and give the tokens of one device, with evictions."""
    result = run_devices("""
        conf, ev = config(True, attention_impl="pallas"), eviction("vase_attnv")
        ref = vj.generate(model, ids, mask, key=jax.random.key(3), config=conf, eviction=ev)
        out = vj.generate(shard_model(model, make_mesh(2, 4)), ids, mask, key=jax.random.key(3), config=conf,
                          eviction=ev)
        print(json.dumps(dict(same=bool((np.asarray(out.tokens) == np.asarray(ref.tokens)).all()),
                              evictions=int(out.evictions))))
    """)
    assert result["same"] and result["evictions"] >= 3, result


@pytest.mark.slow
def test_one_row_per_device_matches_one_device_for_every_method():
    """A data mesh of 8 devices with a batch of 8 (one row per device, padded to the machine's `RowRule.min_rows`
    per device by `generate`): every scoring family gives the tokens and eviction counts of one device (the
    paper's methods, H2O, KeyDiff and TriAttention; the reference's ablations share their scores). Greedy and
    sampled alternate over the methods (a subprocess compiles 2 programs per method). Then TriAttention's modes
    that agree over heads (union: the max over every head; per_head) with the heads split over 4 devices."""
    methods = ["full", "snapkv", "rkv", "rkv_official", "curdkv", "vase_attnv", "vase_dkv", "h2o", "keydiff",
               "triattention"]
    result = run_devices(f"""
        rows = []
        mesh_model = shard_model(model, make_mesh(8, 1))
        for i, method in enumerate({methods!r}):
            greedy = i % 2 == 0
            ref = vj.generate(model, ids, mask, key=jax.random.key(3), config=config(greedy),
                              eviction=eviction(method))
            out = vj.generate(mesh_model, ids, mask, key=jax.random.key(3), config=config(greedy),
                              eviction=eviction(method))
            a, b = np.asarray(out.tokens), np.asarray(ref.tokens)
            rows.append(dict(method=method, greedy=greedy, same=[int(np.argmin(np.append(x == y, False)))
                                                                 for x, y in zip(a, b)],
                             evictions=np.asarray(out.row_evictions).tolist(),
                             ref_evictions=np.asarray(ref.row_evictions).tolist()))
        heads_mesh = shard_model(model, make_mesh(2, 4))
        for mode in ("union", "per_head"):
            ev = eviction("triattention", mode=mode)
            ref = vj.generate(model, ids, mask, key=jax.random.key(3), config=config(True), eviction=ev)
            out = vj.generate(heads_mesh, ids, mask, key=jax.random.key(3), config=config(True), eviction=ev)
            a, b = np.asarray(out.tokens), np.asarray(ref.tokens)
            rows.append(dict(method="triattention " + mode, greedy=True,
                             same=[int(np.argmin(np.append(x == y, False))) for x, y in zip(a, b)],
                             evictions=np.asarray(out.row_evictions).tolist(),
                             ref_evictions=np.asarray(ref.row_evictions).tolist()))
        print(json.dumps(rows))
    """, devices=8, timeout=900)
    assert [r["method"] for r in result] == methods + ["triattention union", "triattention per_head"]
    for row in result:
        assert row["same"] == [40] * 8, row  # the first differing step per row (40: none)
        assert row["evictions"] == row["ref_evictions"], row
