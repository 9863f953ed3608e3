"""`vase_jax.planner`'s continuous-engine plan and `largest_batch`, and `scripts/plan.py --engine / --batch auto`.

On XLA:CPU with the tiny model (vase_dkv, budget 32, buffer 8, 16-token prompts, 240 new tokens): the plan's
buffers are the engine's own arrays, the batch found fits and one row more does not (by the planner's compiled
figures), the cap and bad arguments. Marked `aot`: the same search with the H200's compiler (XLA:GPU, deviceless;
needs `pip install "jax[cuda13-local]==<jax>"`, skipped without it). Every test here plans the same programs,
so the suite's persistent compilation cache serves the repeats.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import pytest

import vase_jax as vj
from vase_jax import aot, batching, planner
from vase_jax.cache import cache_bytes, init_cache
from vase_jax.config import param_shapes
from vase_jax.eviction import framework
from vase_jax.generate import query_window
from vase_jax.random_model import SMALL
from vase_jax.random_model import TINY_1K as TINY
from vase_jax.target import Target

EV = vj.EvictionConfig("vase_dkv", budget=32, buffer=8)
PROMPT, NEW = 16, 240
KW = dict(target="cpu", max_new_tokens=NEW, prompt_len=PROMPT, dtype=jnp.float32)


def test_engine_plan_holds_the_engines_arrays():
    """weights + state + 2 staged rounds + the larger program's temporaries; the state is the batch's cache (as
    `init_cache` makes it), its token buffer [rows, max_new_tokens] and the results buffer [rows + queue,
    max_new_tokens]; a staged round is `queue` rows of the prompt bucket's slots."""
    rows = 8
    plan = planner.plan_engine(TINY, rows, EV, **KW)
    bare = planner.plan_engine(TINY, rows, EV, compile_program=False, **KW)
    target = Target.make("cpu")
    slots = vj.GenerateConfig().bucket(PROMPT)
    capacity = framework.capacity_for(EV, slots, NEW)
    cache = jax.eval_shape(lambda: init_cache(TINY, rows, capacity, query_window(EV), jnp.float32,
                                              framework.slot_state(EV), target))
    assert (plan.rows, plan.queue, plan.capacity, plan.staged_slots) == (rows, rows, capacity, slots)
    assert plan.weights == 4 * sum(math.prod(s) for s in param_shapes(TINY).values())
    assert plan.cache == cache_bytes(cache)
    token_buffers = (rows + rows + plan.queue) * NEW * 4  # loop tokens + results, int32
    assert 0 <= plan.state - plan.cache - token_buffers <= 64 * (rows + plan.queue)  # + per-row counters and keys
    staged_cache = jax.eval_shape(lambda: init_cache(TINY, rows, slots, query_window(EV), jnp.float32,
                                                     framework.slot_state(EV), target))
    assert 0 <= plan.staged - cache_bytes(staged_cache) <= 64 * plan.queue
    assert plan.engine_temporaries > 0 and plan.stage_temporaries > 0
    assert plan.total == (plan.weights + plan.state + planner.STAGED_SETS * plan.staged
                          + max(plan.engine_temporaries, plan.stage_temporaries))
    assert (bare.state, bare.staged, bare.engine_temporaries, bare.temporaries) == (plan.state, plan.staged, None, 0)
    assert plan.as_dict()["total"] == plan.total


def test_largest_batch_fits_and_one_row_more_does_not():
    """The answer is compiled and fits; one row more, compiled, does not (the planner's own figures); the reason
    gives the sums."""
    device_bytes = 12 * 2**20
    found = planner.largest_batch(TINY, EV, device_bytes=device_bytes, headroom=0.05, **KW)
    usable = int(device_bytes * 0.95)
    assert found.limit == "memory" and found.usable == usable and 16 < found.rows < found.cap == planner.MAX_ROWS
    assert found.plan.rows == found.rows and found.plan.total <= usable
    assert dict(found.compiled)[found.rows] == found.plan.total and list(dict(found.compiled))[:2] == [8, 16]
    more = dict(found.compiled).get(found.rows + 1) or planner.plan_engine(TINY, found.rows + 1, EV, **KW).total
    assert more > usable
    assert found.reason.startswith(f"limited by memory: weights {planner.size(found.weights)} + {found.rows} rows x")
    assert f"= {planner.size(found.plan.total)} <= {planner.size(usable)}" in found.reason
    assert math.isclose(found.weights + found.rows * (found.per_row + found.temporaries_per_row) + found.fixed,
                        found.plan.total)


def test_largest_batch_caps_at_the_samples():
    found = planner.largest_batch(TINY, EV, device_bytes=2**30, samples=16, **KW)
    assert (found.rows, found.limit, found.cap) == (16, "cap", 16)
    assert found.reason.startswith("capped at 16 rows (the number of samples):")
    assert [r for r, _ in found.compiled] == [8, 16]


def test_a_cap_below_the_fit_sizes_compiles_once_when_it_fits():
    """Few samples (a cap at most fit_rows[0]): the cap alone is compiled, and is the answer when it fits; one sample
    is one row (this once raised in the line fit). A cap that does not fit compiles one row less too."""
    for samples in (1, 6):
        found = planner.largest_batch(TINY, EV, device_bytes=2**30, samples=samples, **KW)
        assert (found.rows, found.limit, [r for r, _ in found.compiled]) == (samples, "cap", [samples])
        assert found.reason.startswith(f"capped at {samples} rows (the number of samples): weights")
        assert math.isclose(found.weights + found.rows * found.per_row + found.fixed, found.plan.total)
    # between 5 rows' compiled total and 6 rows': 6 does not fit, 5 does
    five = planner.plan_engine(TINY, 5, EV, **KW).total
    device_bytes = (five + found.plan.total) // 2
    smaller = planner.largest_batch(TINY, EV, device_bytes=device_bytes, headroom=0.0, samples=6, **KW)
    assert (smaller.rows, smaller.limit, [r for r, _ in smaller.compiled]) == (5, "memory", [6, 5])


def test_nothing_fits():
    found = planner.largest_batch(TINY, EV, device_bytes=2**20, samples=16, **KW)
    assert found.rows == 0 and found.limit == "nothing fits" and found.reason.startswith("nothing fits: 1 row")


@pytest.mark.parametrize("kwargs, needle", [
    (dict(headroom=1.0), "headroom=1.0"),
    (dict(device_bytes=None), "give device_bytes"),
    (dict(device_bytes=-5), "device_bytes=-5"),
    (dict(max_rows=0), "max_rows=0"),
    (dict(samples=0), "samples=0"),
    (dict(queue=0), "queue=0"),
    (dict(fit_rows=(16, 8)), "fit_rows=(16, 8)"),
    (dict(prompt_len=0), "prompt_len=0"),
    (dict(target="gpu9"), "target='gpu9'"),
    (dict(dtype=jnp.int32), "dtype="),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
])
def test_bad_arguments_are_clear_errors_before_any_compile(kwargs, needle):
    before = batching.compile_counts()
    args = dict(KW, device_bytes=2**30) | kwargs
    with pytest.raises(ValueError) as info:
        planner.largest_batch(TINY, EV, **args)
    assert needle in str(info.value), str(info.value)
    assert batching.compile_counts() == before


def test_plan_engine_bad_rows_and_the_default_memory():
    with pytest.raises(ValueError, match="rows=0 must be a positive int"):
        planner.plan_engine(TINY, 0, EV, **KW)
    assert planner.device_memory("h200") == 139 * 2**30 and planner.device_memory("v5p") == 95 * 2**30
    assert planner.device_memory("cpu") is None


@pytest.fixture(scope="module")
def plan_script():
    from conftest import load_script

    return load_script("plan")


CLI = ["--model", "tiny", "--target", "cpu", "--method", "vase_dkv", "--budget", "32", "--buffer", "8", "--prompt",
       str(PROMPT), "--max-new-tokens", str(NEW), "--dtype", "float32"]


@pytest.mark.script
def test_plan_script_batch_auto(plan_script, capsys):
    """`--batch auto` plans the engine (in this process: one CPU device, as the suite's)."""
    assert plan_script.main([*CLI, "--batch", "auto", "--samples", "16", "--device-gb", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["program"], out["batch"], out["limit"]) == ("engine", 16, "cap")
    assert out["reason"].startswith("capped at 16 rows") and out["plan"]["total"] <= 1e9
    rows = out["per_device_bytes"]  # the table's rows add up to the plan's total
    assert rows["cache"] > 0 and rows["state"] > 0 and rows["temporaries"] > 0
    assert sum(v for k, v in rows.items() if k != "total") == rows["total"] == out["plan"]["total"]
    assert plan_script.main([*CLI, "--batch", "8", "--engine"]) == 0
    text = capsys.readouterr().out
    assert "continuous engine" in text and "staged" in text
    gib = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.split()[2:3] == ["GiB"]}
    assert set(gib) == {"weights", "cache", "state", "staged", "temporaries", "total"}  # one unit


@pytest.mark.parametrize("args, needle", [
    (["--batch", "auto"], "--device-gb"),
    (["--batch", "auto", "--device-gb", "1", "--mesh", "data=2,model=1"], "one device"),
    (["--batch", "auto", "--device-gb", "1", "--no-compile"], "drop --no-compile"),
    (["--batch", "auto", "--device-gb", "1", "--headroom", "1.5"], "--headroom=1.5"),
    (["--batch", "4", "--samples", "8"], "--samples apply to the engine"),
])
@pytest.mark.script
def test_plan_script_errors(plan_script, args, needle, capsys):
    with pytest.raises(SystemExit) as info:
        plan_script.main([*CLI, *args])
    err = capsys.readouterr().err
    assert info.value.code == 2 and needle in err and err.startswith("plan.py: error:"), err



@pytest.mark.aot
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
def test_largest_batch_for_an_h200(no_persistent_cache):
    """`full` with the protocol's cap (256-token prompt, 32512 new tokens) on the small 2-layer shape, compiled by
    XLA:GPU for an H200: the answer fits and one row more does not, by compiled figures. 1.17 GB lies between 15
    and 16 rows (about 71 MB a row), so the row more is the search's second fit size, already compiled: three
    compiles (8, 16, the answer), not four (a device size that gives 28 rows compiles 29 for the check)."""
    reason = aot.missing("h200")
    if reason:
        pytest.skip(reason)
    full = vj.EvictionConfig("full")
    kw = dict(target="h200", max_new_tokens=32768 - 256, prompt_len=256, dtype=jnp.bfloat16)
    cfg = SMALL
    found = planner.largest_batch(cfg, full, device_bytes=1_170_000_000, **kw)
    print(found.reason, found.compiled, f"{found.compile_s:.0f} s")
    assert found.limit == "memory" and 1 <= found.rows < 64
    assert found.plan.cache > found.rows * 32768 * 2 * 2 * 2 * 128 * 2 * 0.99  # layers, kv heads, k+v, bf16
    assert found.plan.total <= found.usable
    more = dict(found.compiled).get(found.rows + 1) or planner.plan_engine(cfg, found.rows + 1, full, **kw).total
    assert more > found.usable
