"""One device check: on the accelerator present (GPU or TPU), in about 8 minutes, write one JSON and one table.

    python -m benchmarks.device_check --out device_check   # exit 0: what ran passed (phases past the budget are
                                                           # skipped), 1: something failed, 2: no accelerator

Keep each run: copy its device_check.json and device_check.md to docs/device-runs/<date>-<device>/ and summarize
it in docs/BENCHMARKS.md.

Phases, in this order of priority, each in its own process (a TPU belongs to one process at a time; a GPU's memory is
not preallocated), each under a cap of seconds (`CAPS`); what does not fit the budget is reported as skipped:
  1. tests    the compiled kernel tests: tests/test_kernels.py and tests/test_kernels_generate.py without the
              interpret-mode classes (the kernels of this platform, compiled, against their references; `generate`
              with the kernels against the XLA path's greedy tokens)
  1b. invariance  batch invariance: `vase_jax.invariance`'s rule on the device (Qwen3-8B's matmul widths, bf16) and a
              row's greedy tokens alone and in batches of 16 and 128 (Qwen3-0.6B's widths, 2 layers, bf16; full and
              vase_dkv@128): identical or not; one call's time at 1 and 128 rows with batch invariance on and off
  2. sweep    the Triton decode kernel's launch parameters (`kernels.sweep_decode`) on Qwen3-14B's and 8B's
              heads at batch 16 x 4k and 16k slots, 128 x 2k and 64 x 2080: each shape's GB/s with the table's
              parameters and with the best found, against the read bandwidth, and the table rows to paste into
              `pallas_kernels/decode_tuning.py` (GPU only)
  3. workload `benchmarks.bench --workload aime25` per method, each in its own process (its own memory peak):
              vase_dkv@2048 and full (`--workload-methods` adds vase_attnv@2048) at the most rows that fit this
              device, planned there (`planner.largest_batch` with the device's own compiler and allocator limit:
              3 to 5 compiles of the engine per method): tokens/s, utilization, the protocol's projected wall time,
              and the device's peak beside the plan's total
  4. events   eviction events against the decode steps between them (B = 64): `decode_benchmark` on Qwen3-14B's
              shape at batch `EVENTS_BATCH`, vase_dkv and vase_attnv, evict ms / (B x step ms)
  5. memory   device peak of one `generate` call (Qwen3-8B shape, bf16, batch 16, vase_dkv@2048, 2304 new
              tokens: a few eviction events) against weights + cache + 2 GiB
  6. decode   a Qwen3-8B-shaped random model in bfloat16 at batch 16: decode tokens/s at 4k and 16k generated
              tokens for full, vase_dkv and vase_attnv at N = 2048 (B = 64). Each figure times `decode_step`s in a
              compiled loop on a cache holding what `generate` holds at that point (full: prompt + tokens slots;
              eviction: N + B/2 slots on average) plus the amortized eviction (one event per B steps), next to the
              bandwidth bound (weights + live K/V/pos per step at the measured read bandwidth); with the platform's
              layer loop, and vase_dkv at 16k once more with the other loop; and after each `full` figure the same
              step on a K4V4 mixed-precision cache (its default: a quarter of the capacity in 16 bits, the rest
              quantized; `decode_step.filled_tiered_cache`), its step time against the 16-bit cache's
  7. lowering `generate` lowered on the device, and lowered for the device's platform by a CPU-only process
              (JAX_PLATFORMS=cpu, `lower_generate(platforms=...)`): any difference is reported
  8. kernels  `benchmarks.kernels` with the table's parameters: decode attention and window scores, XLA vs the
              platform's kernel, at batch 1 and 16 and 1k-16k slots (Qwen3-8B heads)
  9. spread   `benchmarks.bench`'s spread workload: continuous vs static batching, qwen3-0.6b shape, batch 16

With the default budget (470 s) phases 1-2 fit and the workload gets what is left (its plan on the device takes 3
to 5 compiles per method); run the workload alone (`--skip tests,invariance,sweep,events,memory,decode,lowering,
kernels,spread`) and the others with `--skip tests,invariance,sweep,workload` in other leases (for the K4V4 step
first: add `,events,memory`).

Targets (benchmark goals, not pass/fail of this script), reported in the table: the decode kernel at >= 70% of the
read bandwidth at batch 16 x 4k-16k slots and at batch 128 x 2k slots; eviction events <= 3% of the decode time
between them (vase_dkv, vase_attnv); the AIME25 protocol's projected wall time for vase_dkv@2048 <= 30 minutes
(full's beside it); the vase_dkv@2048 decode step at 16k at >= 0.75 of its bytes bound; vase_dkv vs full decode
tokens/s at 16k >= 2.3x; the full K4V4 decode step at 16k <= 0.6x of the 16-bit cache's; device peak
<= weights + cache + 2 GiB; the device's lowering equals the CPU host's.

Each phase has a time budget (`--budget-s` in all); a phase that runs out is stopped and reported as such, and the
decode phase writes each figure as soon as it has it, so a stopped run still reports what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time

from benchmarks.report import method_label, num, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_ACCELERATOR = 2
# seconds each phase may take at most (the whole check: --budget-s, 500 by default)
CAPS = {"tests": 60, "invariance": 90, "sweep": 80, "workload": 480, "events": 85, "memory": 60, "decode": 180,
        "lowering": 50, "kernels": 40, "spread": 50}
WORKLOAD_SHARE = {"vase_dkv@2048": 0.55, "full": 0.45, "vase_attnv@2048": 0.45}  # of the workload's cap
WORKLOAD_DEFAULT = ("vase_dkv@2048", "full")  # the targets' figures; vase_attnv@2048 with --workload-methods
# per method, before the measuring: process start, the model's random weights, the plan (3 to 5 compiles of the
# engine's programs, about 40 s each for Qwen3-14B's 40 layers on XLA:GPU), the engine's two compiles
WORKLOAD_SETUP_S = 180
EVENTS_BATCH = 128  # a large batch that leaves room for the benchmark's own cache (the workload's rows would not)

DETECT = (
    "import json, jax; d = jax.devices()[0]; "
    "print(json.dumps(dict(backend=jax.default_backend(), device_kind=d.device_kind, count=jax.device_count(), "
    "jax=jax.__version__)))"
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # phases share the GPU one after another
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run a phase (with `env` added to the environment); returns rc (None when stopped for time), seconds and the
    output's last lines."""
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env={**_env(), **(env or {})}, capture_output=True, text=True,
                              timeout=max(timeout, 1))
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\n[stopped after {timeout:.0f} s: phase time budget]"
    return dict(rc=rc, seconds=round(time.time() - start, 1), tail=out.strip().splitlines()[-30:])


# ---------------------------------------------------------------------------------------------------------------
# phase 3: decode benchmark (runs in a child process: `device_check.py --phase decode`)
# ---------------------------------------------------------------------------------------------------------------
def decode_benchmark(
    *,
    model: str = "qwen3-8b",
    layers: int | None = None,
    dtype: str = "bfloat16",
    batch: int = 16,
    prompt_len: int = 256,
    lengths: tuple[int, ...] = (4096, 16384),
    methods: tuple[str, ...] = ("full", "vase_dkv", "vase_attnv"),
    other_loop: tuple[str, ...] = ("vase_dkv",),
    budget: int = 2048,
    buffer: int = 64,
    micro_steps: int = 8,
    repeats: int = 3,
    attention_impl: str = "auto",
    deadline: float | None = None,
    json_path: str | None = None,
    bandwidth_mib: int | None = None,
    kv_bits: tuple[str, ...] = ("K4V4",),
) -> dict:
    """Decode tokens/s of `methods` at the cache state after each of `lengths` generated tokens (module docstring):
    `decode_step.step_ms` and `decode_step.evict_ms`, the benchmark's own micro figures, on caches holding what
    `generate` holds there. `bandwidth_mib`: the read-bandwidth probe's size (default `DEVICE_PROBE_BYTES`).

    Returns (and writes to `json_path` after every figure) dict(meta=..., rows=[...]); a row per (method, length)
    with step_ms, evict_ms (eviction methods), tokens_per_s, bound_tokens_per_s, or `skipped` past the deadline.
    `kv_bits`: after each `full` row, the same step on a mixed-precision cache of each setting (its
    default protection, a quarter of the capacity in 16 bits), a row "full K4V4" with `x_bf16_step`.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import vase_jax as vj
    from benchmarks import decode_step as ds
    from benchmarks.timing import DEVICE_PROBE_BYTES, bandwidth
    from vase_jax.eviction import framework
    from vase_jax.generate import generate_target, generate_tiers, query_window
    from vase_jax.kvquant import KVBits, token_bytes
    from vase_jax.random_model import named_configs, shrink
    from vase_jax.target import LAYER_LOOPS, Target

    cfg = shrink(named_configs()[model], layers=layers)
    jdtype = jnp.dtype(dtype)
    qwen = vj.Qwen3(cfg, dtype=jdtype, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(qwen)
    read_bw = bandwidth(DEVICE_PROBE_BYTES if bandwidth_mib is None else bandwidth_mib << 20, repeats=3)["read"]
    weight_bytes = ds.weight_bytes_per_step(qwen)
    per_slot = ds.slot_bytes(cfg, batch, jdtype.itemsize)
    gen = vj.GenerateConfig(max_new_tokens=max(lengths), temperature=0.0, eos_token_ids=())
    bucket = gen.bucket(prompt_len)
    default = generate_target(qwen, gen)  # the platform's layer loop, as `generate` runs it
    other = next(loop for loop in LAYER_LOOPS if loop != default.layer_loop)
    result = dict(
        meta=dict(model=model, layers=cfg.num_layers, dtype=dtype, batch=batch, prompt_len=prompt_len,
                  prompt_bucket=bucket, budget=budget, buffer=buffer, micro_steps=micro_steps, repeats=repeats,
                  attention_impl=attention_impl, read_bandwidth_gb_s=read_bw / 1e9, weight_bytes=weight_bytes,
                  layer_loop=default.layer_loop,
                  device=jax.devices()[0].device_kind, backend=jax.default_backend(), jax=jax.__version__),
        rows=[],
    )

    def add(row: dict) -> None:
        result["rows"].append(row)
        if json_path:
            write_json(json_path, result)

    def step(cache, start, target) -> float:  # median ms per step; the cache is consumed
        return ds.step_ms(graphdef, state, cache, start, micro_steps, repeats, attention_impl, target).median

    def tiered_step(name: str, length: int, live: int, bf16_step_ms: float, target) -> dict:
        """`full`'s decode step at `live` tokens on a mixed-precision cache of setting `name` (its default
        protection: the capacity's quarter in 16 bits, the rest quantized), against the 16-bit cache's step."""
        kv = KVBits.parse(name)
        config = dataclasses.replace(gen, max_new_tokens=length, key_bits=kv.key_bits, value_bits=kv.value_bits,
                                     kv_group=kv.key_group)
        layout = generate_tiers(cfg, config, vj.EvictionConfig("full", buffer=buffer), bucket)
        ms = step(ds.filled_tiered_cache(cfg, batch, layout, live, 0, jdtype, target=target), None, target)
        n16 = min(live, layout.protected + layout.buffer)
        quant_slot = per_slot * token_bytes(cfg.head_dim, config.kv_bits_for(cfg.head_dim), jdtype.itemsize) / (
            token_bytes(cfg.head_dim, KVBits(), jdtype.itemsize))
        step_bytes = weight_bytes + n16 * per_slot + (live - n16) * quant_slot
        bound = batch * read_bw / step_bytes
        return dict(method=f"full {name}", tokens=length, live_slots=live, protected=layout.protected,
                    quantized_slots=live - n16, step_ms=ms, tokens_per_s=batch / ms * 1e3, bound_tokens_per_s=bound,
                    achieved_over_bound=batch / ms * 1e3 / bound, bytes_per_step=step_bytes,
                    x_bf16_step=ms / bf16_step_ms)

    measured: dict[tuple, dict] = {}  # eviction methods: one cache state for every length
    # the longest length first, so that a run stopped for time still has the 16k comparison; every method with the
    # platform's layer loop, then the `other_loop` ones at the longest length with the other loop
    figures = sorted(((n, m, default.layer_loop) for m in methods for n in lengths), key=lambda x: -x[0])
    figures += [(max(lengths), m, other) for m in other_loop if m in methods]
    for length, method, layer_loop in figures:
        target = Target.make(default.platform, layer_loop)
        ev = (vj.EvictionConfig("full") if method == "full" else
              vj.EvictionConfig(method, budget=budget, buffer=buffer)).validate()
        window = query_window(ev)
        row = dict(method=method_label(method, ev.evicts and budget)
                   + (f" ({layer_loop})" if layer_loop != default.layer_loop else ""), tokens=length)
        if deadline is not None and time.time() > deadline:
            add({**row, "skipped": "time budget"})
            continue
        capacity = framework.capacity_for(ev, bucket, length)
        live = bucket + length if not ev.evicts else budget + buffer // 2  # slots at that point (mean)
        live = min(live, capacity - micro_steps)  # the micro steps append `micro_steps` slots
        state_key = (method, capacity, live, layer_loop)
        if state_key not in measured:
            entry = dict(live_slots=live, capacity=capacity, step_ms=step(
                ds.filled_cache(cfg, batch, capacity, live, window, jdtype, target=target), live, target))
            if ev.evicts:
                full = ds.filled_cache(cfg, batch, capacity, budget + buffer, window, jdtype, target=target)
                entry["evict_ms"] = ds.evict_ms(full, ev, repeats, attention_impl).median
            measured[state_key] = entry
        entry = measured[state_key]
        step_s = entry["step_ms"] / 1e3 + (entry.get("evict_ms", 0.0) / 1e3 / buffer if ev.evicts else 0.0)
        # a step over `live` slots, one eviction event (if any) amortized over the B steps to the next
        step_bytes = ds.roofline(qwen, ev, np.full(buffer, live), int(ev.evicts), batch, jdtype.itemsize)[
            "bytes_step_mean"]
        bound = batch * read_bw / step_bytes
        tps = batch / step_s
        share = entry["evict_ms"] / (buffer * entry["step_ms"]) if ev.evicts else None  # of the steps between events
        add({**row, **entry, "tokens_per_s": tps, "bound_tokens_per_s": bound, "achieved_over_bound": tps / bound,
             "bytes_per_step": step_bytes, "eviction_share": share})
        if method == "full" and layer_loop == default.layer_loop:
            for name in kv_bits:
                if deadline is not None and time.time() > deadline:
                    add({**row, "method": f"full {name}", "skipped": "time budget"})
                else:
                    add(tiered_step(name, length, live, entry["step_ms"], target))
    return result


# ---------------------------------------------------------------------------------------------------------------
# the kernel sweep (`--phase sweep`): launch parameters of the Triton decode kernel on the shapes
# ---------------------------------------------------------------------------------------------------------------
SWEEP_SHAPES = tuple((b, 8, g, 128, n, "bfloat16") + ((cap,) if cap else ())  # Qwen3-14B (group 5), 8B (group 4)
                     for g in (5, 4) for b, n, cap in ((16, 4096, 0), (16, 16384, 0), (128, 2048, 2112),
                                                       (64, 2080, 2112)))


def kernel_sweep(seconds: float, json_path: str | None = None, shapes=SWEEP_SHAPES, **kwargs) -> dict:
    """`kernels.sweep_decode` on `shapes` within `seconds`: each shape's time with the table's launch
    parameters and with the best found, as fractions of the read bandwidth, and the table rows to paste."""
    from benchmarks.kernels import sweep_decode

    # one shape at a time, the JSON rewritten after each: a sweep stopped for time keeps the shapes it finished
    deadline = time.time() + seconds
    result: dict = {}
    for i, shape in enumerate(shapes):
        share = (deadline - time.time()) / (len(shapes) - i)
        if share < 1:
            break
        one = sweep_decode([shape], None, share, log=lambda m: print(m, flush=True), **kwargs)
        if not result:
            result = dict(one, shapes=[], entries=[], table_text="")
            kwargs.setdefault("read_bandwidth_bytes_s", one["read_bandwidth_gb_s"] * 1e9)  # measured once
        result["shapes"] += one["shapes"]
        result["entries"] += one.get("entries", [])
        result["table_text"] += one.get("table_text", "")
        result["seconds"] = seconds - (deadline - time.time())
        if json_path:
            write_json(json_path, result)
    return result


# ---------------------------------------------------------------------------------------------------------------
# phase 4: the device's lowering against the CPU host's (`--phase lowering`, run twice: on the device, and with
# JAX_PLATFORMS=cpu lowering for the device's platform)
# ---------------------------------------------------------------------------------------------------------------
def lowered_text(platform: str | None, *, model: str = "qwen3-8b", layers: int = 2, batch: int = 16,
                 prompt_len: int = 256, budget: int = 2048, buffer: int = 64, max_new_tokens: int = 4096) -> str:
    """`generate` (vase_dkv, bf16, abstract weights) lowered for `platform`, or, with None, as `generate` picks the
    platform on this process's device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import vase_jax as vj
    from pallas_kernels.dispatch import lowering_target
    from vase_jax.generate import lower_generate
    from vase_jax.random_model import named_configs, shrink

    cfg = shrink(named_configs()[model], layers=layers)
    qwen = nnx.eval_shape(lambda: vj.Qwen3(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    ids = np.ones((batch, prompt_len), np.int32)
    kwargs = dict(key=jax.random.key(0), config=vj.GenerateConfig(max_new_tokens=max_new_tokens),
                  eviction=vj.EvictionConfig("vase_dkv", budget=budget, buffer=buffer))
    if platform is None:
        return lower_generate(qwen, ids, ids, **kwargs).as_text()
    with lowering_target(platform):
        return lower_generate(qwen, ids, ids, platforms=(platform,), **kwargs).as_text()


def compare_lowerings(device_text: str, host_text: str) -> dict:
    """Whether two lowered programs are the same text; else how many lines differ and the first differences."""
    import difflib

    if device_text == host_text:
        return dict(identical=True, lines=len(device_text.splitlines()))
    diff = [line for line in difflib.unified_diff(host_text.splitlines(), device_text.splitlines(), "host",
                                                  "device", lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    return dict(identical=False, lines=len(device_text.splitlines()), differing_lines=len(diff), first=diff[:20])


# ---------------------------------------------------------------------------------------------------------------
# phase 5: device peak of one `generate` call (`--phase memory`)
# ---------------------------------------------------------------------------------------------------------------
def memory_peak(*, model: str = "qwen3-8b", layers: int | None = None, dtype: str = "bfloat16", batch: int = 16,
                prompt_len: int = 256, budget: int = 2048, buffer: int = 64, new_tokens: int = 2304) -> dict:
    """One `generate` call (vase_dkv@budget, greedy, no end token) on a random model: the device's peak bytes in
    use (None where the device does not say: CPU) against weights + cache + 2 GiB, and its wall time."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import vase_jax as vj
    from benchmarks.decode_step import param_bytes
    from vase_jax.cache import cache_bytes, init_cache
    from vase_jax.config import NORM_PARAMS, param_shapes
    from vase_jax.eviction import framework
    from vase_jax.generate import generate_target, query_window
    from vase_jax.random_model import named_configs, shrink

    cfg = shrink(named_configs()[model], layers=layers)
    # weights made in place, one array at a time (a random init would hold float32 draws beside them, which the
    # device's peak would count): constant weights read and compute exactly as random ones
    params = {path: jnp.full(shape, 1.0 if path[-1] in NORM_PARAMS + ("weight",) else 0.01, dtype)
              for path, shape in param_shapes(cfg).items()}
    qwen = vj.Qwen3.from_params(cfg, params, jnp.dtype(dtype))
    del params
    config = vj.GenerateConfig(max_new_tokens=new_tokens, temperature=0.0, eos_token_ids=())
    ev = vj.EvictionConfig("vase_dkv", budget=budget, buffer=buffer)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
    capacity = framework.capacity_for(ev, config.bucket(prompt_len), new_tokens)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, capacity, query_window(ev), jnp.dtype(dtype),
                                              framework.slot_state(ev), generate_target(qwen, config)))
    t0 = time.perf_counter()
    out = jax.block_until_ready(vj.generate(qwen, ids, np.ones_like(ids), key=jax.random.key(0), config=config,
                                            eviction=ev))
    seconds = time.perf_counter() - t0
    stats = jax.devices()[0].memory_stats() or {}
    weights, cache_b = param_bytes(qwen), cache_bytes(cache)
    peak = stats.get("peak_bytes_in_use")
    return dict(model=model, layers=cfg.num_layers, dtype=dtype, batch=batch, prompt_len=prompt_len,
                budget=budget, new_tokens=new_tokens, evictions=int(out.evictions), seconds=seconds,
                weights=weights, cache=cache_b, bound=weights + cache_b + (2 << 30), peak=peak,
                within=None if peak is None else peak <= weights + cache_b + (2 << 30))


def invariance_check(*, probe_model: str = "qwen3-8b", model: str = "qwen3-0.6b", layers: int = 2,
                     batches=(1, 16, 128), new_tokens: int = 256, deadline: float | None = None,
                     json_path: str | None = None) -> dict:
    """Batch invariance on this device: the probe's `RowRule` for `probe_model`'s widths in bf16 (and its seconds),
    then a random bf16 model of `model`'s widths: row 0's greedy tokens in batches of `batches` rows (full and
    vase_dkv@128, B = 32), each compared with the lone row's; one call's wall time at 1 row and at the largest
    batch with `batch_invariant` on and off (the padding's cost; the fixed splits')."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import vase_jax as vj
    from vase_jax.invariance import probe_shapes
    from vase_jax.random_model import named_configs, random_params, shrink

    result: dict = {"model": model, "layers": layers, "batches": list(batches), "new_tokens": new_tokens}

    def save():
        if json_path:
            write_json(json_path, result)

    big = named_configs()[probe_model]
    t0 = time.perf_counter()
    rule = probe_shapes(hidden=big.hidden_size, q_dim=big.num_heads * big.head_dim,
                        kv_dim=big.num_kv_heads * big.head_dim, mlp=big.intermediate_size, vocab=big.vocab_size,
                        dtype=jnp.bfloat16)
    result["probe"] = dict(seconds=time.perf_counter() - t0, min_rows=rule.min_rows, invariant=rule.invariant,
                           describe=rule.describe(), differs={op: list(ms) for op, ms in rule.differs})
    save()
    cfg = shrink(named_configs()[model], layers=layers)
    qwen = vj.Qwen3.from_params(cfg, random_params(cfg, seed=0), jnp.bfloat16)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (max(batches), 64)).astype(np.int32)
    result["rows"] = {}
    for method in ("full", "vase_dkv"):
        ev = vj.EvictionConfig(method) if method == "full" else vj.EvictionConfig(method, budget=128, buffer=32)
        first = None
        for batch in batches:
            if deadline is not None and time.time() > deadline:
                result["stopped"] = "deadline"
                save()
                return result
            config = vj.GenerateConfig(max_new_tokens=new_tokens, temperature=0.0, eos_token_ids=())
            out = vj.generate(qwen, ids[:batch], np.ones_like(ids[:batch]), key=jax.random.key(0), config=config,
                              eviction=ev)
            tokens = np.asarray(out.tokens[0])
            first = tokens if first is None else first
            same = int(np.argmin(np.append(tokens == first, False)))  # the first differing step (new_tokens: none)
            result["rows"][f"{method}@{batch}"] = dict(first_difference=same, identical=same == new_tokens)
            save()
    timings = {}
    for rows in (1, max(batches)):  # the padding's cost (a lone row) and the fixed splits' (the largest batch)
        for invariant in (True, False):
            config = vj.GenerateConfig(max_new_tokens=new_tokens, temperature=0.0, eos_token_ids=(),
                                       batch_invariant=invariant)
            for _ in range(2):  # the first call compiles, the second is timed
                t0 = time.perf_counter()
                jax.block_until_ready(vj.generate(qwen, ids[:rows], np.ones_like(ids[:rows]), key=jax.random.key(0),
                                                  config=config).tokens)
            timings[f"{rows} {'on' if invariant else 'off'}"] = time.perf_counter() - t0
    result["seconds"] = timings  # "rows on|off": one call's wall time, batch invariance on or off
    save()
    return result


# ---------------------------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------------------------
def _fmt(x, digits=1) -> str:
    return num(x, f".{digits}f")


def _pct(x, digits=0) -> str:
    return num(x, f".{digits}f", 100, "%")


def _table_result(entry: dict) -> dict:
    """The sweep's timing of a shape with the table's own launch parameters."""
    return next((r for r in entry.get("results", []) if r.get("source") == "table" and "ms" in r), {})


def _workload_record(res: dict) -> dict | None:
    """The method's record in one workload child's results.json."""
    methods = res.get("methods") or []
    return methods[0] if methods and "protocol" in methods[0] else None


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# Device check: {env.get('device_kind')} ({env.get('backend')}), jax {env.get('jax')}", "",
             f"{report['started']}; python {env.get('python')}; total {report['seconds']:.0f} s.", "",
             "| phase | status | seconds |", "|---|---|---|"]
    for name, phase in report["phases"].items():
        lines.append(f"| {name} | {phase.get('status')} | {phase.get('seconds', '-')} |")
    tests = report["phases"].get("tests", {})
    if tests.get("summary"):
        lines += ["", f"Tests: `{tests['summary']}`"]
    invariance = report["phases"].get("invariance", {}).get("results")
    if invariance:
        lines += ["", "Batch invariance: " + invariance.get("probe", {}).get("describe", "no probe"), "",
                  "| row 0 of a batch of | first step differing from the lone row's |", "|---|---|"]
        for label, row in invariance.get("rows", {}).items():
            lines.append(f"| {label} | {'none' if row['identical'] else row['first_difference']} |")
        timed = invariance.get("seconds", {})
        for rows in sorted({int(k.split()[0]) for k in timed}):
            on, off = timed.get(f"{rows} on"), timed.get(f"{rows} off")
            if on and off:
                lines.append(f"\n{rows} rows x {invariance['new_tokens']} tokens: {on:.3f} s invariant, {off:.3f} s "
                             f"not ({off / on:.2f}x the tokens/s)")
    sweep = report["phases"].get("sweep", {}).get("results")
    if sweep:
        lines += ["", f"## Decode kernel sweep ({sweep.get('device_kind')}, {sweep.get('sm_count')} SMs, read "
                  f"bandwidth {_fmt(sweep.get('read_bandwidth_gb_s'), 0)} GB/s, {_fmt(sweep.get('seconds'), 0)} s)",
                  "", "| batch | kv heads | group | slots | table ms | table % of read bw | best ms | best % | "
                  "best params |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for entry in sweep.get("shapes", []):
            sh, table, best = entry.get("shape", {}), _table_result(entry), entry.get("best") or {}
            lines.append(f"| {sh.get('batch')} | {sh.get('kv_heads')} | {sh.get('group')} | {sh.get('slots')} | "
                         f"{_fmt(table.get('ms'), 3)} | {_pct(table.get('fraction_of_read_bw'))} | "
                         f"{_fmt(best.get('ms'), 3)} | {_pct(best.get('fraction_of_read_bw'))} | "
                         f"{best.get('params')} |")
        if sweep.get("table_text"):
            lines += ["", "Table rows from the sweep (`pallas_kernels/decode_tuning.py`):", "", "```python",
                      sweep["table_text"].rstrip(), "```"]
    workload = report["phases"].get("workload", {}).get("results")
    if workload:
        lines += ["", "## AIME25 protocol's shape (Qwen3-14B, bf16, 480 samples, log-normal lengths), projected", "",
                  "| method | rows | step ms | tok/s | utilization | projected min | peak GiB | planned GiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, res in workload.items():
            rec = _workload_record(res)
            if rec is None:
                lines.append(f"| {label} | {res.get('skipped', 'no result')} | | | | | | |")
                continue
            proto = rec.get("protocol", {})
            planned = (rec.get("plan") or {}).get("total")
            lines.append(f"| {label} | {rec.get('rows')} | {_fmt(proto.get('step_ms'), 2)} | "
                         f"{_fmt(proto.get('tok_s'), 0)} | {_fmt(proto.get('utilization'), 2)} | "
                         f"{_fmt(proto.get('seconds') and proto['seconds'] / 60, 1)} | "
                         f"{_fmt(rec.get('peak_bytes') and rec['peak_bytes'] / 2**30, 2)} | "
                         f"{_fmt(planned and planned / 2**30, 2)} |")
    events = report["phases"].get("events", {}).get("results")
    if events:
        m = events["meta"]
        lines += ["", f"## Eviction events (Qwen3-14B shape, batch {m['batch']}, N = {m['budget']}, B = {m['buffer']})",
                  "", "| method | step ms | evict ms/event | event / (B steps) |", "|---|---|---|---|"]
        for r in events["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['method']} | skipped ({r['skipped']}) | | |")
                continue
            lines.append(f"| {r['method']} | {r['step_ms']:.2f} | {_fmt(r.get('evict_ms'), 2)} | "
                         f"{_pct(r.get('eviction_share'), 1)} |")
    kernels = report["phases"].get("kernels", {}).get("results")
    if kernels:
        meta = kernels["meta"]
        lines += ["", f"## Kernels (copy bandwidth {meta['copy_bandwidth_gb_per_s']:.0f} GB/s, {meta['dtype']}, "
                  f"{meta['kv_heads']} kv heads, group {meta['group']}, head_dim {meta['head_dim']}, window "
                  f"{meta['window']})", "",
                  "| op | impl | batch | slots | ms | GB/s | % of copy bandwidth |", "|---|---|---|---|---|---|---|"]
        for r in kernels["results"]:
            lines.append(f"| {r['op']} | {r['impl']} | {r['batch']} | {r['length']} | {r['ms']:.3f} | "
                         f"{r['gb_per_s']:.0f} | {100 * r['fraction_of_copy_bw']:.0f}% |")
    decode = report["phases"].get("decode", {}).get("results")
    if decode:
        m = decode["meta"]
        lines += ["", f"## Decode ({m['model']} shape, {m['layers']} layers, {m['dtype']}, batch {m['batch']}, "
                  f"prompt {m['prompt_len']}, B = {m['buffer']}; read bandwidth {m['read_bandwidth_gb_s']:.0f} GB/s)",
                  "", "| method | tokens | live slots | step ms | evict ms/event | tok/s | bound tok/s | "
                  "achieved/bound |", "|---|---|---|---|---|---|---|---|"]
        for r in decode["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['method']} | {r['tokens']} | skipped ({r['skipped']}) | | | | | |")
                continue
            lines.append(f"| {r['method']} | {r['tokens']} | {r['live_slots']} | {r['step_ms']:.2f} | "
                         f"{_fmt(r.get('evict_ms'), 2)} | {r['tokens_per_s']:.0f} | {r['bound_tokens_per_s']:.0f} | "
                         f"{r['achieved_over_bound']:.2f} |")
    lowering = report["phases"].get("lowering", {}).get("comparison")
    if lowering:
        lines += ["", "## Lowering: the device's against the CPU host's (`JAX_PLATFORMS=cpu`, `platforms=(...)`)", "",
                  f"{'identical' if lowering['identical'] else 'DIFFERENT'}: {lowering['lines']} lines"
                  + ("" if lowering["identical"] else f", {lowering['differing_lines']} differ; first:")]
        lines += [f"    {line[:160]}" for line in lowering.get("first", [])]
    memory = report["phases"].get("memory", {}).get("results")
    if memory:
        gib = 2**30
        lines += ["", f"## Device memory of one generate ({memory['model']} shape, {memory['layers']} layers, "
                  f"{memory['dtype']}, batch {memory['batch']}, vase_dkv@{memory['budget']}, {memory['new_tokens']} "
                  f"new tokens, {memory['evictions']} eviction events, {memory['seconds']:.1f} s)", "",
                  f"peak {_fmt(memory['peak'] and memory['peak'] / gib, 2)} GiB; weights {memory['weights'] / gib:.2f}"
                  f" + cache {memory['cache'] / gib:.2f} + 2 GiB = {memory['bound'] / gib:.2f} GiB"]
    spread = report["phases"].get("spread", {}).get("table")
    if spread:
        lines += ["", "## Continuous vs static batching (qwen3-0.6b shape, bf16, batch 16, spread outputs "
                  "over [32, 512])", "", spread.strip()]
    targets = report.get("targets", {})
    if targets:
        lines += ["", "## Targets", ""] + [f"- {k}: {v}" for k, v in targets.items()]
    return "\n".join(lines) + "\n"


def targets(report: dict) -> dict[str, str]:
    out = {}
    sweep = report["phases"].get("sweep", {}).get("results")
    if sweep:
        for name, want in (("batch 16, 4k-16k slots", lambda s: s["batch"] == 16 and 4096 <= s["slots"] <= 16384),
                           ("batch 128, 2k slots", lambda s: s["batch"] == 128)):
            rows = [e for e in sweep.get("shapes", []) if want(e.get("shape", {}))]
            table = [_table_result(e).get("fraction_of_read_bw") for e in rows]
            best = [(e.get("best") or {}).get("fraction_of_read_bw") for e in rows]
            if rows and None not in table:
                out[f"decode kernel >= 70% of the read bandwidth ({name})"] = (
                    f"{'met' if min(table) >= 0.7 else 'not met'} with the table: lowest {100 * min(table):.0f}%"
                    + (f"; the sweep's best: lowest {100 * min(best):.0f}%" if None not in best else ""))
    events = report["phases"].get("events", {}).get("results")
    if events:
        for r in events["rows"]:
            if r.get("eviction_share") is not None:
                out[f"{r['method']} eviction events <= 3% of the decode time between them"] = (
                    f"{'met' if r['eviction_share'] <= 0.03 else 'not met'}: {100 * r['eviction_share']:.1f}%")
    workload = report["phases"].get("workload", {}).get("results") or {}
    dkv = _workload_record(workload.get("vase_dkv@2048", {}))
    if dkv is not None:
        minutes = dkv["protocol"]["seconds"] / 60
        full = _workload_record(workload.get("full", {}))
        beside = "" if full is None else f" (full: {full['protocol']['seconds'] / 60:.1f} min at {full['rows']} rows)"
        out["the AIME25 protocol's projected wall time, vase_dkv@2048, <= 30 min"] = (
            f"{'met' if minutes <= 30 else 'not met'}: {minutes:.1f} min at {dkv['rows']} rows{beside}")
    kernels = report["phases"].get("kernels", {}).get("results")
    if kernels:
        rows = [r for r in kernels["results"] if r["op"] == "decode" and r["impl"] != "xla" and r["batch"] == 16
                and 4096 <= r["length"] <= 16384]
        if rows:
            worst = min(r["fraction_of_copy_bw"] for r in rows)
            out["decode kernel >= 70% of copy bandwidth (batch 16, 4k-16k slots)"] = (
                f"{'met' if worst >= 0.7 else 'not met'}: lowest {100 * worst:.0f}%")
    decode = report["phases"].get("decode", {}).get("results")
    if decode:
        at = {r["method"].split("@")[0]: r for r in decode["rows"] if r["tokens"] == 16384 and "tokens_per_s" in r
              and not r["method"].endswith(")")}
        if "vase_dkv" in at:
            share = at["vase_dkv"]["achieved_over_bound"]
            out["vase_dkv@2048 decode step at 16k >= 0.75 of its bytes bound"] = (
                f"{'met' if share >= 0.75 else 'not met'}: {share:.2f}")
        for name in [m for m in at if m.startswith("full K")]:
            ratio = at[name]["x_bf16_step"]
            out[f"{name} decode step at 16k <= 0.6x the 16-bit cache's"] = (
                f"{'met' if ratio <= 0.6 else 'not met'}: {ratio:.2f}x ({at[name]['step_ms']:.2f} ms against "
                f"{at['full']['step_ms']:.2f} ms)")
        if "full" in at and "vase_dkv" in at:
            ratio = at["vase_dkv"]["tokens_per_s"] / at["full"]["tokens_per_s"]
            bound = at["vase_dkv"]["bound_tokens_per_s"] / at["full"]["bound_tokens_per_s"]
            out["vase_dkv vs full tokens/s at 16k >= 2.3x"] = (
                f"{'met' if ratio >= 2.3 else 'not met'}: {ratio:.2f}x (bandwidth bound {bound:.2f}x)")
    memory = report["phases"].get("memory", {}).get("results")
    if memory and memory.get("peak") is not None:
        out["device peak <= weights + cache + 2 GiB"] = (
            f"{'met' if memory['within'] else 'not met'}: {memory['peak'] / 2**30:.2f} GiB against "
            f"{memory['bound'] / 2**30:.2f} GiB")
    lowering = report["phases"].get("lowering", {}).get("comparison")
    if lowering:
        out["the device's lowering equals the CPU host's"] = (
            "met" if lowering["identical"] else f"not met: {lowering['differing_lines']} lines differ")
    return out


PHASES = ("tests", "invariance", "sweep", "workload", "events", "memory", "decode", "lowering", "kernels", "spread")


def _status(phase: dict) -> str:
    return "done" if phase["rc"] == 0 else ("stopped" if phase["rc"] is None else "failed")


def _results(phase: dict, path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            phase["results"] = json.load(f)
    return phase


def _save(out: str, report: dict, start: float) -> None:
    report["seconds"] = time.time() - start
    write_json(os.path.join(out, "device_check.json"), report)


def _child(phase: str, path: str, cap: float, extra: list[str] | None = None) -> list[str]:
    """This script as a child process for one phase, stopping new work 20 s before its cap."""
    return [sys.executable, "-m", "benchmarks.device_check", "--phase", phase, "--json", path,
            "--deadline", str(time.time() + max(cap - 20, cap / 2))] + (extra or [])


def workload_command(label: str, seconds: float, deadline: float, out: str, scale: str = "protocol") -> list[str]:
    """The workload phase's child for one method ("vase_dkv@2048", "full"): `benchmarks.bench --workload aime25`
    at `scale`, measuring for `seconds` and ending by `deadline`, without `--batch`: the child plans its rows on its
    device (`planner.largest_batch`, the device's compiler and allocator limit; its record has the plan)."""
    method, _, budget = label.partition("@")
    return [sys.executable, "-m", "benchmarks.bench", "--workload", "aime25", "--scale", scale, "--methods", method,
            *(["--budgets", budget] if budget else []), "--seconds", str(round(seconds)), "--deadline", str(deadline),
            "--out", out]


def run_phase(name: str, args, env: dict, remaining, layers: list[str]) -> dict:
    """Run phase `name` under min(its cap, the time left); returns its report entry."""
    cap = min(CAPS[name], remaining())
    out = args.out
    if name == "tests":  # the compiled kernel tests
        other = "pallas_tpu" if env["backend"] == "gpu" else "pallas-"  # the other family would run interpreted
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
               "tests/test_kernels_generate.py", "-k", f"not Interpret and not {other} and not Reference and not "
               "auto_picks and not explicit_impls"]  # the compiled kernels only: the rest runs on any CPU
        phase = _run(cmd, cap)
        summary = next((line for line in reversed(phase["tail"]) if " passed" in line or " failed" in line), None)
        return dict(phase, status="passed" if phase["rc"] == 0 else _status(phase), summary=summary)
    if name == "invariance":  # the probe's rule and a row's tokens in batches of 1, 16 and 128
        path = os.path.join(out, "invariance.json")
        phase = _run(_child("invariance", path, cap), cap)
        phase = _results(dict(phase, status=_status(phase)), path)
        rows = phase.get("results", {}).get("rows", {})
        if rows and not all(r["identical"] for r in rows.values()):
            phase["status"] = "failed"
        return phase
    if name == "sweep":  # the Triton decode kernel's launch parameters on the shapes (GPU only)
        if env["backend"] != "gpu":
            return dict(status="skipped", rc=None, seconds=0, tail=["the sweep times the Triton kernel: GPU only"])
        path = os.path.join(out, "sweep.json")
        phase = _run(_child("sweep", path, cap), cap)
        return _results(dict(phase, status=_status(phase)), path)
    if name == "workload":  # the AIME25 protocol's shape per method, each in its own process (its own peak)
        folder = os.path.join(out, "workload")
        phase = dict(rc=0, seconds=0.0, tail=[], results={})
        spent = 0.0
        for label in args.workload_methods.split(","):
            sub = min(WORKLOAD_SHARE[label] * CAPS["workload"], CAPS["workload"] - spent, remaining())
            spent += max(sub, 0)
            if sub < 30:
                phase["results"][label] = dict(skipped="time budget")
                continue
            # the measuring ends in time (the deadline) whatever the plan and the compile took
            run = _run(workload_command(label, max(sub - WORKLOAD_SETUP_S, 10), time.time() + sub - 5,
                                        os.path.join(folder, label.replace("@", "_"))), sub)
            phase["seconds"] += run["seconds"]
            phase["tail"] += [f"[{label}]"] + run["tail"][-8:]
            if run["rc"] != 0:
                phase["rc"] = run["rc"] if phase["rc"] == 0 else phase["rc"]
            found = os.path.join(folder, label.replace("@", "_"), "results.json")
            if os.path.exists(found):
                with open(found) as f:
                    phase["results"][label] = json.load(f)
        return dict(phase, status=_status(phase))
    if name == "events":  # eviction events against the decode steps between them (B = 64)
        path = os.path.join(out, "events.json")
        phase = _run(_child("events", path, cap, layers), cap)
        return _results(dict(phase, status=_status(phase)), path)
    if name == "memory":  # device peak of one generate call
        path = os.path.join(out, "memory.json")
        phase = _run([sys.executable, "-m", "benchmarks.device_check", "--phase", "memory", "--json", path] + layers,
                     cap)
        return _results(dict(phase, status=_status(phase)), path)
    if name == "decode":  # the decode benchmark; it writes each figure as soon as it has it
        path = os.path.join(out, "decode.json")
        phase = _run(_child("decode", path, cap, layers), cap)
        return _results(dict(phase, status=_status(phase)), path)
    if name == "lowering":  # the device's lowering of generate against a CPU-only process's for this platform
        platform_name = "tpu" if env["backend"] == "tpu" else "cuda"
        texts = {where: os.path.join(out, f"lowered_{where}.txt") for where in ("device", "host")}
        cmd = [sys.executable, "-m", "benchmarks.device_check", "--phase", "lowering", "--json"]
        phase = _run(cmd + [texts["device"]], cap / 2)
        host = _run(cmd + [texts["host"], "--platform", platform_name], min(cap / 2, remaining()),
                    env={"JAX_PLATFORMS": "cpu"})
        phase.update(status=_status(phase) if host["rc"] == 0 else "failed", host_tail=host["tail"])
        if all(os.path.exists(t) for t in texts.values()):
            with open(texts["device"]) as f, open(texts["host"]) as g:
                phase["comparison"] = compare_lowerings(f.read(), g.read())
        return phase
    if name == "kernels":  # kernel bandwidth with the table's launch parameters, decode and window scores
        path = os.path.join(out, "kernels.json")
        cmd = [sys.executable, "-m", "benchmarks.kernels", "--batches", "1,16", "--lengths", "1024,4096,16384",
               "--group", "4", "--kv-heads", "8", "--repeats", "5", "--copy-mib", "8192", "--json", path]
        phase = _run(cmd, cap)
        return _results(dict(phase, status=_status(phase)), path)
    if name == "spread":  # continuous vs static batching on the spread workload (benchmarks.bench)
        folder = os.path.join(out, "spread")
        cmd = [sys.executable, "-m", "benchmarks.bench", "--model", "qwen3-0.6b", "--dtype", "bfloat16", "--batch",
               "16", "--prompt-len", "64", "--output-lens", "512", "--spread-samples", "64", "--methods", "vase_dkv",
               "--budgets", "128", "--buffer", "32", "--repeats", "3", "--out", folder]
        phase = _run(cmd, cap)
        phase["status"] = _status(phase)
        if os.path.exists(os.path.join(folder, "results.md")):
            with open(os.path.join(folder, "results.md")) as f:
                phase["table"] = f.read()
        return phase
    raise ValueError(f"unknown phase {name!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="device_check", help="folder for device_check.json and device_check.md")
    p.add_argument("--budget-s", type=float, default=470.0, help="time for all phases together (default 470)")
    p.add_argument("--skip", default="", help=f"comma list of phases to skip: {', '.join(PHASES)}")
    p.add_argument("--workload-methods", default=",".join(WORKLOAD_DEFAULT),
                   help=f"workload phase: comma list of {', '.join(WORKLOAD_SHARE)} (default: "
                   f"{','.join(WORKLOAD_DEFAULT)})")
    p.add_argument("--layers", type=int, default=None, help="decode phase: layers of the model (default: all 36)")
    p.add_argument("--phase", choices=("decode", "lowering", "memory", "sweep", "events", "invariance"), default=None,
                   help=argparse.SUPPRESS)  # a child process
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--platform", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.workload_methods.split(",")) - set(WORKLOAD_SHARE)
    if unknown:
        p.error(f"--workload-methods: {', '.join(sorted(unknown))} unknown; known: {', '.join(WORKLOAD_SHARE)}")

    if args.phase == "decode":
        decode_benchmark(layers=args.layers, deadline=args.deadline, json_path=args.json)
        return 0
    if args.phase == "events":  # eviction events against the decode steps between them (B = 64), Qwen3-14B,
        # at the workload's batch of vase_dkv
        decode_benchmark(model="qwen3-14b", layers=args.layers, batch=EVENTS_BATCH, lengths=(16384,),
                         methods=("vase_dkv", "vase_attnv"), other_loop=(), repeats=2, deadline=args.deadline,
                         json_path=args.json)
        return 0
    if args.phase == "invariance":
        invariance_check(deadline=args.deadline, json_path=args.json)
        return 0
    if args.phase == "sweep":
        kernel_sweep(max(args.deadline - time.time(), 1.0), args.json)
        return 0
    if args.phase == "lowering":
        with open(args.json, "w") as f:
            f.write(lowered_text(args.platform))
        return 0
    if args.phase == "memory":
        write_json(args.json, memory_peak(layers=args.layers))
        return 0

    start = time.time()
    detect = subprocess.run([sys.executable, "-c", DETECT], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=120)
    try:
        env = json.loads(detect.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        print(f"device_check.py: error: could not start jax:\n{detect.stderr[-2000:]}", file=sys.stderr)
        return 1
    if env["backend"] not in ("gpu", "tpu"):
        print(f"device_check.py: no accelerator: jax {env['jax']} sees only {env['backend']} devices "
              f"({env['device_kind']}). This check runs the kernels compiled on a GPU or a TPU; on this machine the "
              "kernels are checked by `pytest tests/test_kernels.py tests/test_lowering.py` (interpret mode and "
              "lowering). Nothing was run.", file=sys.stderr)
        return NO_ACCELERATOR
    env["python"] = platform.python_version()
    os.makedirs(args.out, exist_ok=True)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    report = dict(started=time.strftime("%Y-%m-%d %H:%M:%S"), environment=env, phases={})
    deadline = start + args.budget_s

    def remaining() -> float:
        return deadline - time.time()

    layers = ["--layers", str(args.layers)] if args.layers else []
    # Phases in order of what matters most for the open issues; each under a cap of seconds (`CAPS`), never past
    # the overall deadline.
    for name in PHASES:
        if name in skip:
            continue
        if remaining() < 5:
            report["phases"][name] = dict(status="skipped", rc=None, seconds=0, tail=["no time left"])
            continue
        report["phases"][name] = run_phase(name, args, env, remaining, layers)
        _save(args.out, report, start)  # what has run so far, in case the whole check is stopped

    report["targets"] = targets(report)
    _save(args.out, report, start)
    table = markdown(report)
    with open(os.path.join(args.out, "device_check.md"), "w") as f:
        f.write(table)
    print(table)
    ok = all(phase.get("status") in ("passed", "done", "skipped") for phase in report["phases"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
