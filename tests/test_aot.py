"""`generate` compiled deviceless for an NVIDIA H200 (XLA:GPU, Triton kernels) and a TPU v5p (XLA:TPU, Mosaic
kernels) on this host (`vase_jax.aot`): the program each device would run, checked on the compiler's own output.

Qwen3-8B's shape with 4 layers, bf16, batch 16, a 128-token prompt, 4096 new tokens, `vase_attnv` at the paper's
budget 2048. For each: no instruction slices or copies a layer weight, nothing copies the
embedding table, the cache is held once (no copy of it, in the decode loop or around it), and the temporaries are
at most the cache plus one layer's weights, plus 10%. Beyond the cache, the temporaries are the prefill's
activations, which grow with batch x prompt tokens (the dense prefill attention's scores with batch x prompt^2),
hence the short prompt: the bound is about the decode loop (docs/BENCHMARKS.md has 256-token figures).

Marked `aot`; they need the target's JAX plugin (`pip install "jax[cuda13-local]==<jax>"` / `"jax[tpu]==<jax>"`)
and skip cleanly without it. `.ci/run` installs each plugin in a venv of its own and runs `pytest -m aot` there.
The suite's persistent compilation cache is off here: a deviceless program cannot be loaded from it.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

import vase_jax as vj
from vase_jax import aot
from vase_jax.random_model import named_configs

pytestmark = [pytest.mark.aot, pytest.mark.usefixtures("no_persistent_cache"),
              pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")]

CFG = dataclasses.replace(named_configs()["qwen3-8b"], num_layers=4)
METHODS = {"vase_attnv": vj.EvictionConfig("vase_attnv", budget=2048, buffer=64)}



@functools.cache
def _report(target: str, method: str) -> aot.ProgramReport:
    reason = aot.missing(target)
    if reason:
        pytest.skip(reason)
    eviction, new_tokens = METHODS[method], 4096
    if target == "v5p":  # the same program at a quarter of the slots: XLA:TPU's compile time grows with them
        eviction, new_tokens = dataclasses.replace(eviction, budget=512), 1024
    _, report = aot.compile_generate(target, CFG, batch=16, eviction=eviction, prompt_len=128,
                                     max_new_tokens=new_tokens)
    print(f"{target} {method}: temporaries {report.temporaries / 2**30:.3f} GiB, cache {report.cache / 2**30:.3f} "
          f"GiB, one layer {report.one_layer / 2**30:.3f} GiB, compiled in {report.compile_s:.0f} s")
    return report


# vase_attnv on each target: its decode loop is full's plus the eviction (full's own program took 21 s of CI's
# critical path on the H200, a v5p compile 100-200 s), and vase_dkv evicts through the same loop with other
# scores; `tests/test_lowering.py` lowers every method for both targets
PROGRAMS = [("h200", "vase_attnv"), ("v5p", "vase_attnv")]


@pytest.mark.parametrize("target, method", PROGRAMS)
def test_device_program_reads_weights_in_place_and_holds_the_cache_once(target, method):
    report = _report(target, method)
    assert report.device_kind == ("NVIDIA H200" if target == "h200" else "TPU v5")
    assert report.weight_slices == (), "\n".join(report.weight_slices[:5])
    assert report.embedding_copies == (), "\n".join(report.embedding_copies[:5])
    assert report.cache_copies == (), "\n".join(report.cache_copies[:5])
    assert report.temporaries <= 1.1 * (report.cache + report.one_layer)
    assert report.arguments >= report.weights  # the weights are arguments, read where they are


def test_h200_mixed_precision_program_holds_its_smaller_cache_once():
    """The mixed-precision cache (K4V4, vase_attnv's Nv slots in 16 bits) on an H200: no copy of any of its arrays
    (its ticks rewrite each layer in place), no weight sliced, and temporaries within the 16-bit program's bound
    for its own, smaller cache. (On a TPU: the next test.)"""
    reason = aot.missing("h200")
    if reason:
        pytest.skip(reason)
    _, report = aot.compile_generate("h200", CFG, batch=16, eviction=METHODS["vase_attnv"], prompt_len=128,
                                     max_new_tokens=4096, kv_bits="K4V4")
    assert report.cache_copies == (), "\n".join(report.cache_copies[:5])
    assert report.weight_slices == (), "\n".join(report.weight_slices[:5])
    assert report.cache < 0.6 * _report("h200", "vase_attnv").cache
    assert report.temporaries <= 1.1 * (report.cache + report.one_layer)


def test_v5p_mixed_precision_decode_loop_copies_no_stack_per_step():
    """K4V4 on a TPU v5p (4-bit codes [.., slots, 64] and two groups of scales per token: the arrays XLA:TPU lays
    out in more than one way): no instruction run at every decode step copies a stack of the cache. The quantized
    tier stores its scales group-major (slots on lanes) and the ticks' loops pin its stacks to the kernels' layout
    (`tiers.pinned`); before, XLA copied 16 whole stacks around those loops at every step (docs/BENCHMARKS.md). The
    ticks' own loops over layers (named scopes "flush" and "eviction", run at a tick, zero times at other steps)
    and the prefill's loop (once per call) are not per-step work. The eviction's loop body does copy the 4-bit code
    stacks (4 whole-stack copies per layer on v5p, as the tick loop did before the cache interface): a cost per
    eviction, not per step.

    Batch 8, as many rows as kv heads: there XLA:TPU also carried the per-slot arrays (`pos`, `qpos`,
    `value_range`) with rows and heads swapped and copied them at every step, until the pins covered them too (at
    batch 16 it did not). Budget 512 and 1024 new tokens: the same program as the paper's 2048, compiled in 45 s
    instead of 100 (XLA:TPU's compile time grows with the slots). A 64-token prompt: with 128, the prefill's
    activations [8, 128, 4096] would have a stacked k_proj's shape, and the weight check would flag them."""
    from hlo_utils import per_step_copies

    reason = aot.missing("v5p")
    if reason:
        pytest.skip(reason)
    batch = CFG.num_kv_heads
    compiled, report = aot.compile_generate("v5p", CFG, batch=batch, prompt_len=64, max_new_tokens=1024,
                                            eviction=vj.EvictionConfig("vase_attnv", budget=512, buffer=64),
                                            kv_bits="K4V4")
    lead = (CFG.num_layers, batch, CFG.num_kv_heads)
    copies = per_step_copies(compiled.as_text(), lambda dims: dims[:3] == lead, follow_branches=True,
                             ticks=("/flush/", "/eviction/"))
    assert copies == [], "\n".join(copies[:5])
    assert report.weight_slices == (), "\n".join(report.weight_slices[:5])
    print(f"v5p K4V4: temporaries {report.temporaries / 2**30:.3f} GiB, cache {report.cache / 2**30:.3f} GiB")


def test_the_checks_see_copies():
    """The report's detectors, on a program that copies a slice of a stacked weight and a whole cache-like array."""
    hlo = """HloModule m

%fused_slice (param_0: bf16[4,64,32], param_1: s32[]) -> bf16[1,64,32] {
  %param_0 = bf16[4,64,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %dynamic-slice.1 = bf16[1,64,32]{2,1,0} dynamic-slice(%param_0, %param_1, %c, %c), dynamic_slice_sizes={1,64,32}
}

ENTRY %main (w: bf16[4,64,32], k: bf16[2,8,128]) -> bf16[2,8,128] {
  %w = bf16[4,64,32]{2,1,0} parameter(0)
  %k = bf16[2,8,128]{2,1,0} parameter(1)
  %i = s32[] constant(1)
  %f = bf16[1,64,32]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  ROOT %copy.3 = bf16[2,8,128]{2,1,0} copy(%k)
}
"""
    assert len(aot.copying_reads(hlo, {(4, 64, 32)})) == 1
    assert len(aot.copies_of(hlo, {(2, 8, 128)})) == 1
    assert aot.copying_reads(hlo, {(2, 64, 32)}) == []


@pytest.mark.parametrize("target", sorted(aot.TARGETS))
def test_plan_script_plans_with_the_targets_compiler(target, capsys):
    """`scripts/plan.py --target` compiles on the target's topology (two devices, rows split over them): the
    temporaries are that compiler's, and hold the cache. Run in this process: libtpu admits one process at a
    time, and this one holds it once a TPU test has run."""
    reason = aot.missing(target)
    if reason:
        pytest.skip(reason)
    from conftest import load_script

    plan = load_script("plan")
    assert plan.main(["--model", "small", "--target", target, "--mesh", "data=2,model=1", "--batch", "2",
                      "--budget", "256", "--prompt", "64", "--max-new-tokens", "1024", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    per_device = out["per_device_bytes"]
    assert out["target"] == target and out["compiled_bytes"]["temporaries"] >= per_device["cache"] > 0
    assert sum(v for k, v in per_device.items() if k != "total") == per_device["total"]


def test_h200_long_prompt_prefills_in_memory_that_grows_with_the_prompt_not_its_square():
    """A prompt past `GenerateConfig.prefill_chunk` prefills in chunks (one block of chunk x chunk scores per row
    and head): at batch 4, the temporaries beyond the cache barely grow from a 2048- to an 8192-token prompt, stay
    far below the dense attention's float32 scores at 8192 (batch x heads x 8192², 32 GiB), and the program still
    copies neither the cache nor a weight."""
    reason = aot.missing("h200")
    if reason:
        pytest.skip(reason)
    eviction = METHODS["vase_attnv"]
    beyond = {}
    for prompt in (2048, 8192):
        _, report = aot.compile_generate("h200", CFG, batch=4, eviction=eviction, prompt_len=prompt,
                                         max_new_tokens=256)
        assert report.cache_copies == (), "\n".join(report.cache_copies[:5])
        assert report.weight_slices == (), "\n".join(report.weight_slices[:5])
        beyond[prompt] = report.temporaries - report.cache
        print(f"h200 prompt {prompt}: temporaries beyond the cache {beyond[prompt] / 2**30:.3f} GiB, cache "
              f"{report.cache / 2**30:.3f} GiB")
    dense_scores = 4 * CFG.num_heads * 8192**2 * 4
    assert beyond[8192] <= 1.5 * beyond[2048]
    assert beyond[8192] <= dense_scores / 20
