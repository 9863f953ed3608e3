"""One device check: on the accelerator present (GPU or TPU), in about 8 minutes, write one JSON and one table.

    python -m benchmarks.device_check --out device_check   # exit 0: what ran passed (phases past the budget are
                                                           # skipped), 1: something failed, 2: no accelerator

Keep each run: copy its device_check.json and device_check.md to docs/device-runs/<date>-<device>/ and summarize
it in docs/BENCHMARKS.md.

Phases, in this order of priority, each a process of its own (a TPU belongs to one process at a time; a GPU's memory
is not preallocated) that writes results.json and results.md in <out>/<phase>/, each under a cap of seconds (`CAPS`);
what does not fit the budget is reported as skipped:
  tests       tests/test_kernels.py and tests/test_kernels_generate.py, the compiled kernels only
  invariance  `invariance_check`: the probe's rule (Qwen3-8B's widths, bf16); a row's greedy tokens alone and in
              batches of 16 and 128 (Qwen3-0.6B's widths, 2 layers); a call's time with batch invariance on and off
  sweep       `kernel_sweep` (GPU only): the Triton decode kernel's launch parameters on Qwen3-14B's and 8B's heads
              (`SWEEP_SHAPES`): GB/s with the table's parameters and the best found, the table rows to paste
  workload    `benchmarks.bench --workload aime25` per method (vase_dkv@2048, full; `--workload-methods` adds
              vase_attnv@2048), each planning its rows on this device: the protocol's projected wall time
  events      `benchmarks.bench --micro` (`EVENTS`): an eviction event against the B = 64 decode steps between
              events, Qwen3-14B's shape at batch 128
  memory      `memory_peak`: the device's peak in one `generate` call against weights + cache + 2 GiB
  decode      `benchmarks.bench --micro` (`DECODE`): Qwen3-8B's shape, bf16, batch 16, full / vase_dkv@2048 /
              vase_attnv@2048 steps at 16k and 4k tokens against their bytes bound, and full's step on a K4V4 cache
  lowering    `generate` lowered on the device and for its platform by a CPU-only process: any difference
  kernels     `benchmarks.kernels`: decode attention and window scores, XLA against the platform's kernels
  spread      `benchmarks.bench --spread-samples` (`SPREAD`): continuous against static batching

With the default budget (470 s) tests to sweep fit and the workload gets what is left; run the workload alone
(`--skip` every other phase) and the others with `--skip tests,invariance,sweep,workload` in other leases.

Targets (benchmark goals, not pass/fail of this script), in the table: the decode kernel at >= 70% of the read
bandwidth at batch 16 x 4k-16k slots and 128 x 2k; eviction events <= 3% of the decode time between them; the AIME25
protocol's projected wall time for vase_dkv@2048 <= 30 minutes; the vase_dkv@2048 step at 16k at >= 0.75 of its
bytes bound; vase_dkv against full tokens/s at 16k >= 2.3x; the full K4V4 step at 16k <= 0.6x the 16-bit cache's;
device peak <= weights + cache + 2 GiB; the device's lowering equal to the CPU host's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from benchmarks.report import num, table, write_json, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_ACCELERATOR = 2
# seconds each phase may take at most (the whole check: --budget-s)
CAPS = {"tests": 60, "invariance": 90, "sweep": 80, "workload": 480, "events": 85, "memory": 60, "decode": 180,
        "lowering": 50, "kernels": 40, "spread": 50}
PHASES = tuple(CAPS)
WORKLOAD_SHARE = {"vase_dkv@2048": 0.55, "full": 0.45, "vase_attnv@2048": 0.45}  # of the workload's cap
WORKLOAD_DEFAULT = ("vase_dkv@2048", "full")  # the targets' figures; vase_attnv@2048 with --workload-methods
# per method, before the measuring: process start, the model's random weights, the plan (3 to 5 compiles of the
# engine's programs, about 40 s each for Qwen3-14B's 40 layers on XLA:GPU), the engine's two compiles
WORKLOAD_SETUP_S = 180
# the benchmarks' flags per phase (a phase adds --out, and --deadline where it stops new work in time)
DECODE = {"--micro": None, "--model": "qwen3-8b", "--dtype": "bfloat16", "--batch": "16", "--prompt-len": "256",
          "--output-lens": "4096,16384", "--methods": "full,vase_dkv,vase_attnv", "--budgets": "2048",
          "--buffer": "64", "--kv-bits": "K4V4", "--bandwidth-mib": "8192"}
EVENTS = {k: v for k, v in DECODE.items() if k != "--kv-bits"} | {  # a batch with room for the benchmark's cache
    "--model": "qwen3-14b", "--batch": "128", "--output-lens": "16384", "--methods": "vase_dkv,vase_attnv"}
SPREAD = {"--model": "qwen3-0.6b", "--dtype": "bfloat16", "--batch": "16", "--prompt-len": "64", "--output-lens": "512",
          "--spread-samples": "64", "--methods": "vase_dkv", "--budgets": "128", "--buffer": "32"}
KERNELS = {"--batches": "1,16", "--lengths": "1024,4096,16384", "--group": "4", "--kv-heads": "8", "--copy-mib": "8192"}

DETECT = (
    "import json, jax; d = jax.devices()[0]; "
    "print(json.dumps(dict(backend=jax.default_backend(), device_kind=d.device_kind, count=jax.device_count(), "
    "jax=jax.__version__)))"
)


def flags(values: dict) -> list[str]:
    """{"--name": value or None (a switch)} as command-line arguments."""
    return [x for k, v in values.items() for x in ((k,) if v is None else (k, str(v)))]


def module(name: str, values: dict) -> list[str]:
    """`python -m benchmarks.<name>` with `values` as its flags."""
    return [sys.executable, "-m", f"benchmarks.{name}", *flags(values)]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # phases share the GPU one after another
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run a phase's process (with `env` added to the environment): rc (None when stopped for time), seconds, the
    output's last lines, and status (done, failed or stopped)."""
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env={**_env(), **(env or {})}, capture_output=True, text=True,
                              timeout=max(timeout, 1))
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out += f"\n[stopped after {timeout:.0f} s: phase time budget]"
    status = "done" if rc == 0 else ("stopped" if rc is None else "failed")
    return dict(rc=rc, status=status, seconds=round(time.time() - start, 1), tail=out.strip().splitlines()[-30:])


def _collect(phase: dict, folder: str) -> dict:
    """The phase with its process's results.json (as "results") and results.md (as "table"), where written."""
    for key, name in (("results", "results.json"), ("table", "results.md")):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path) as f:
                phase[key] = json.load(f) if key == "results" else f.read()
    return phase


# ---- the phases that are this module's own (`--phase NAME`, a child process) ----------------------------------
SWEEP_SHAPES = tuple((b, 8, g, 128, n, "bfloat16") + ((cap,) if cap else ())  # Qwen3-14B (group 5), 8B (group 4)
                     for g in (5, 4) for b, n, cap in ((16, 4096, 0), (16, 16384, 0), (128, 2048, 2112),
                                                       (64, 2080, 2112)))


def kernel_sweep(seconds: float, out: str | None = None, shapes=SWEEP_SHAPES, **kwargs) -> dict:
    """`kernels.sweep_decode` on `shapes` within `seconds`, the results written after each shape: each shape's
    time with the table's launch parameters and with the best found, as fractions of the read bandwidth, and the
    table rows to paste."""
    from benchmarks.kernels import sweep_decode

    return sweep_decode(shapes, None, seconds, log=lambda m: print(m, flush=True),
                        on_shape=lambda r: write_results(out, r, sweep_markdown(r)), **kwargs)


def _table_result(entry: dict) -> dict:
    """The sweep's timing of a shape with the table's own launch parameters."""
    return next((r for r in entry.get("results", []) if r.get("source") == "table" and "ms" in r), {})


def sweep_markdown(sweep: dict) -> str:
    lines = [f"{sweep.get('device_kind')}, {sweep.get('sm_count')} SMs, read bandwidth "
             f"{num(sweep.get('read_bandwidth_gb_s'), '.0f')} GB/s, {num(sweep.get('seconds'), '.0f')} s", ""]
    lines += table(sweep.get("shapes", []), {
        **{k: lambda e, k=k: e["shape"][k] for k in ("batch", "kv_heads", "group", "slots")},
        "table ms": lambda e: num(_table_result(e).get("ms"), ".3f"),
        "table % of read bw": lambda e: num(_table_result(e).get("fraction_of_read_bw"), ".0f", 100, "%"),
        "best ms": lambda e: num((e.get("best") or {}).get("ms"), ".3f"),
        "best %": lambda e: num((e.get("best") or {}).get("fraction_of_read_bw"), ".0f", 100, "%"),
        "best params": lambda e: (e.get("best") or {}).get("params")})
    if sweep.get("table_text"):
        lines += ["", "Table rows (`pallas_kernels/decode_tuning.py`):", "", "```python", sweep["table_text"].rstrip(),
                  "```"]
    return "\n".join(lines) + "\n"


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


def memory_markdown(m: dict) -> str:
    return (f"One generate: {m['model']} shape, {m['layers']} layers, {m['dtype']}, batch {m['batch']}, "
            f"vase_dkv@{m['budget']}, {m['new_tokens']} new tokens, {m['evictions']} eviction events, "
            f"{m['seconds']:.1f} s: peak {num(m['peak'], '.2f', 2**-30)} GiB; weights {m['weights'] / 2**30:.2f} + "
            f"cache {m['cache'] / 2**30:.2f} + 2 GiB = {m['bound'] / 2**30:.2f} GiB\n")


def invariance_check(*, probe_model: str = "qwen3-8b", model: str = "qwen3-0.6b", layers: int = 2,
                     batches=(1, 16, 128), new_tokens: int = 256, deadline: float | None = None,
                     out: str | None = None) -> dict:
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
        write_results(out, result, invariance_markdown(result))

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

    def call(rows: int, ev=None, **options):
        config = vj.GenerateConfig(max_new_tokens=new_tokens, temperature=0.0, eos_token_ids=(), **options)
        return vj.generate(qwen, ids[:rows], np.ones_like(ids[:rows]), key=jax.random.key(0), config=config,
                           **({} if ev is None else {"eviction": ev})).tokens

    result["rows"] = {}
    for ev in (vj.EvictionConfig("full"), vj.EvictionConfig("vase_dkv", budget=128, buffer=32)):
        first = None
        for batch in batches:
            if deadline is not None and time.time() > deadline:
                result["stopped"] = "deadline"
                save()
                return result
            tokens = np.asarray(call(batch, ev)[0])
            first = tokens if first is None else first
            same = int(np.argmin(np.append(tokens == first, False)))  # the first differing step (new_tokens: none)
            result["rows"][f"{ev.method}@{batch}"] = dict(first_difference=same, identical=same == new_tokens)
            save()
    result["seconds"] = {}  # "rows on|off": one call's wall time, batch invariance on or off
    for rows in (1, max(batches)):  # the padding's cost (a lone row) and the fixed splits' (the largest batch)
        for invariant in (True, False):
            for _ in range(2):  # the first call compiles, the second is timed
                t0 = time.perf_counter()
                jax.block_until_ready(call(rows, batch_invariant=invariant))
            result["seconds"][f"{rows} {'on' if invariant else 'off'}"] = time.perf_counter() - t0
    save()
    return result


def invariance_markdown(result: dict) -> str:
    lines = [f"Batch invariance: {result.get('probe', {}).get('describe', 'no probe')}", ""]
    lines += table(result.get("rows", {}).items(), {"row 0 of a batch of": lambda kv: kv[0],
                                                    "first step differing from the lone row's": lambda kv:
                                                    "none" if kv[1]["identical"] else kv[1]["first_difference"]})
    timed = result.get("seconds", {})
    for rows in sorted({int(k.split()[0]) for k in timed}):
        on, off = timed.get(f"{rows} on"), timed.get(f"{rows} off")
        if on and off:
            lines.append(f"\n{rows} rows x {result['new_tokens']} tokens: {on:.3f} s invariant, {off:.3f} s not "
                         f"({off / on:.2f}x the tokens/s)")
    return "\n".join(lines) + "\n"


# ---- running the phases -------------------------------------------------------------------------------------
def workload_command(label: str, seconds: float, deadline: float, out: str, scale: str = "protocol") -> list[str]:
    """The workload phase's child for one method ("vase_dkv@2048", "full"): `benchmarks.bench --workload aime25`
    at `scale`, measuring for `seconds` and ending by `deadline`, without `--batch`: the child plans its rows on its
    device (`planner.largest_batch`, the device's compiler and allocator limit; its record has the plan)."""
    method, _, budget = label.partition("@")
    return module("bench", {"--workload": "aime25", "--scale": scale, "--methods": method,
                            **({"--budgets": budget} if budget else {}), "--seconds": round(seconds),
                            "--deadline": deadline, "--out": out})


def phase_command(name: str, folder: str, deadline: float, args, backend: str) -> list[str]:
    """The process of a phase that is one process: it writes results.json (and results.md) in `folder`, and
    starts no new work after `deadline`."""
    layers = {"--layers": args.layers} if args.layers else {}
    if name == "tests":  # the compiled kernels only: the rest (interpret mode, references) runs on any CPU
        other = "pallas_tpu" if backend == "gpu" else "pallas-"  # the other family would run interpreted
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
                "tests/test_kernels_generate.py", "-k", f"not Interpret and not {other} and not Reference and not "
                "auto_picks and not explicit_impls"]
    if name in ("invariance", "sweep", "memory"):
        return module("device_check", {"--phase": name, "--out": folder, "--deadline": deadline, **layers})
    if name in ("events", "decode"):
        return module("bench", (EVENTS if name == "events" else DECODE) | layers | {"--deadline": deadline,
                                                                                    "--out": folder})
    if name == "kernels":
        return module("kernels", KERNELS | {"--json": os.path.join(folder, "results.json")})
    if name == "spread":
        return module("bench", SPREAD | {"--out": folder})
    raise ValueError(f"unknown phase {name!r}")


def run_phase(name: str, args, env: dict, remaining) -> dict:
    """Run phase `name` under min(its cap, the time left), new work stopping 20 s before; its report entry."""
    cap = min(CAPS[name], remaining())
    folder = os.path.join(args.out, name)
    if name == "sweep" and env["backend"] != "gpu":
        return dict(status="skipped", rc=None, seconds=0, tail=["the sweep times the Triton kernel: GPU only"])
    if name == "workload":  # per method, each in its own process (its own peak)
        phase = dict(rc=0, status="done", seconds=0.0, tail=[], results={}, table="")
        spent = 0.0
        for label in args.workload_methods.split(","):
            sub = min(WORKLOAD_SHARE[label] * CAPS["workload"], CAPS["workload"] - spent, remaining())
            spent += max(sub, 0)
            if sub < 30:
                phase["results"][label] = dict(skipped="time budget")
                continue
            # the measuring ends in time (the deadline) whatever the plan and the compile took
            where = os.path.join(folder, label.replace("@", "_"))
            run = _collect(_run(workload_command(label, max(sub - WORKLOAD_SETUP_S, 10), time.time() + sub - 5,
                                                 where), sub), where)
            phase["seconds"] += run["seconds"]
            phase["tail"] += [f"[{label}]"] + run["tail"][-8:]
            if run["rc"] != 0 and phase["rc"] == 0:
                phase.update(rc=run["rc"], status=run["status"])
            phase["results"][label] = run.get("results", {})
            phase["table"] += run.get("table", "")
        return phase
    if name == "lowering":  # the device's lowering of generate against a CPU-only process's for this platform
        texts = {where: os.path.join(folder, f"lowered_{where}.txt") for where in ("device", "host")}
        cmd = module("device_check", {"--phase": "lowering", "--out": folder})
        phase = _run(cmd + ["--lowered", texts["device"]], cap / 2)
        host = _run(cmd + ["--lowered", texts["host"], "--platform", "tpu" if env["backend"] == "tpu" else "cuda"],
                    min(cap / 2, remaining()), env={"JAX_PLATFORMS": "cpu"})
        phase.update(status=phase["status"] if host["rc"] == 0 else "failed", host_tail=host["tail"])
        if all(os.path.exists(t) for t in texts.values()):
            with open(texts["device"]) as f, open(texts["host"]) as g:
                c = phase["comparison"] = compare_lowerings(f.read(), g.read())
            phase["table"] = (f"{'identical' if c['identical'] else 'DIFFERENT'}: {c['lines']} lines" + (
                "" if c["identical"] else f", {c['differing_lines']} differ; first:\n\n"
                + "\n".join(f"    {line[:160]}" for line in c["first"])) + "\n")
        return phase
    phase = _collect(_run(phase_command(name, folder, time.time() + max(cap - 20, cap / 2), args, env["backend"]),
                          cap), folder)
    if name == "tests":
        phase["summary"] = next((s for s in reversed(phase["tail"]) if " passed" in s or " failed" in s), None)
        phase["status"] = "passed" if phase["rc"] == 0 else phase["status"]
    if name == "invariance" and not all(r["identical"] for r in phase.get("results", {}).get("rows", {}).values()):
        phase["status"] = "failed"
    if name == "kernels" and "results" in phase:
        phase["table"] = "\n".join(table(phase["results"]["results"], {
            **{k: lambda r, k=k: r[k] for k in ("op", "impl", "batch", "length")}, "ms": lambda r: f"{r['ms']:.3f}",
            "GB/s": lambda r: f"{r['gb_per_s']:.0f}", "% of copy bandwidth": lambda r:
            f"{100 * r['fraction_of_copy_bw']:.0f}%"})) + "\n"
    return phase


# ---- the report ---------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    """The phases' statuses, each phase's own table (its results.md), the targets."""
    env = report["environment"]
    lines = [f"# Device check: {env.get('device_kind')} ({env.get('backend')}), jax {env.get('jax')}", "",
             f"{report['started']}; python {env.get('python')}; total {report['seconds']:.0f} s.", ""]
    lines += table(report["phases"].items(), {"phase": lambda p: p[0], "status": lambda p: p[1].get("status"),
                                              "seconds": lambda p: p[1].get("seconds", "-")})
    if report["phases"].get("tests", {}).get("summary"):
        lines += ["", f"Tests: `{report['phases']['tests']['summary']}`"]
    for name, phase in report["phases"].items():
        if phase.get("table"):
            lines += ["", f"## {name}", "", phase["table"].strip()]
    workload = report["phases"].get("workload", {}).get("results", {})
    lines += [f"- workload {label}: {res['skipped']}" for label, res in workload.items() if "skipped" in res]
    if report.get("targets"):
        lines += ["", "## Targets", ""] + [f"- {k}: {v}" for k, v in report["targets"].items()]
    return "\n".join(lines) + "\n"


def _workload_record(res: dict) -> dict | None:
    """The method's record in one workload child's results.json."""
    methods = res.get("methods") or []
    return methods[0] if methods and "protocol" in methods[0] else None


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def targets(report: dict) -> dict[str, str]:
    """Each stated target that the phases' results measure: met or not, and the figure."""
    out, results = {}, {name: p.get("results") or {} for name, p in report["phases"].items()}
    for name, want in (("batch 16, 4k-16k slots", lambda s: s["batch"] == 16 and 4096 <= s["slots"] <= 16384),
                       ("batch 128, 2k slots", lambda s: s["batch"] == 128)):
        rows = [e for e in results.get("sweep", {}).get("shapes", []) if want(e.get("shape", {}))]
        tab = [_table_result(e).get("fraction_of_read_bw") for e in rows]
        best = [(e.get("best") or {}).get("fraction_of_read_bw") for e in rows]
        if rows and None not in tab:
            out[f"decode kernel >= 70% of the read bandwidth ({name})"] = (
                f"{_met(min(tab) >= 0.7)} with the table: lowest {100 * min(tab):.0f}%"
                + (f"; the sweep's best: lowest {100 * min(best):.0f}%" if None not in best else ""))
    for r in results.get("events", {}).get("runs", []):
        if r.get("eviction_share") is not None:
            out[f"{r['method']}@{r['budget']} eviction events <= 3% of the decode time between them"] = (
                f"{_met(r['eviction_share'] <= 0.03)}: {100 * r['eviction_share']:.1f}%")
    workload = results.get("workload", {})
    dkv, full = _workload_record(workload.get("vase_dkv@2048", {})), _workload_record(workload.get("full", {}))
    if dkv is not None:
        minutes = dkv["protocol"]["seconds"] / 60
        beside = "" if full is None else f" (full: {full['protocol']['seconds'] / 60:.1f} min at {full['rows']} rows)"
        out["the AIME25 protocol's projected wall time, vase_dkv@2048, <= 30 min"] = (
            f"{_met(minutes <= 30)}: {minutes:.1f} min at {dkv['rows']} rows{beside}")
    rows = [r for r in results.get("kernels", {}).get("results", []) if r["op"] == "decode" and r["impl"] != "xla"
            and r["batch"] == 16 and 4096 <= r["length"] <= 16384]
    if rows:
        worst = min(r["fraction_of_copy_bw"] for r in rows)
        out["decode kernel >= 70% of copy bandwidth (batch 16, 4k-16k slots)"] = (
            f"{_met(worst >= 0.7)}: lowest {100 * worst:.0f}%")
    at = {r["method"]: r for r in results.get("decode", {}).get("runs", []) if r["output_len"] == 16384
          and "skipped" not in r}
    if "vase_dkv" in at:
        share = at["vase_dkv"]["roofline"]["achieved_over_bound_end"]
        out["vase_dkv@2048 decode step at 16k >= 0.75 of its bytes bound"] = f"{_met(share >= 0.75)}: {share:.2f}"
    for kv in at.get("full", {}).get("kv", []):
        out[f"full {kv['kv_bits']} decode step at 16k <= 0.6x the 16-bit cache's"] = (
            f"{_met(kv['x_bf16_step'] <= 0.6)}: {kv['x_bf16_step']:.2f}x ({kv['step_ms']:.2f} ms against "
            f"{at['full']['step_ms_end']['median']:.2f} ms)")
    if "full" in at and "vase_dkv" in at:
        ratio = at["vase_dkv"]["tok_s_end"] / at["full"]["tok_s_end"]
        bound = at["vase_dkv"]["roofline"]["bound_tok_s_end"] / at["full"]["roofline"]["bound_tok_s_end"]
        out["vase_dkv vs full tokens/s at 16k >= 2.3x"] = f"{_met(ratio >= 2.3)}: {ratio:.2f}x (bound {bound:.2f}x)"
    memory = results.get("memory", {})
    if memory.get("peak") is not None:
        out["device peak <= weights + cache + 2 GiB"] = (
            f"{_met(memory['within'])}: {memory['peak'] / 2**30:.2f} GiB against {memory['bound'] / 2**30:.2f} GiB")
    lowering = report["phases"].get("lowering", {}).get("comparison")
    if lowering:
        out["the device's lowering equals the CPU host's"] = (
            "met" if lowering["identical"] else f"not met: {lowering['differing_lines']} lines differ")
    return out


def child(args) -> int:
    """`--phase NAME`: one of this module's own phases, in this process."""
    if args.phase == "invariance":
        invariance_check(deadline=args.deadline, out=args.out)
    elif args.phase == "sweep":
        kernel_sweep(max(args.deadline - time.time(), 1.0), args.out)
    elif args.phase == "memory":
        m = memory_peak(layers=args.layers)
        write_results(args.out, m, memory_markdown(m))
    elif args.phase == "lowering":
        os.makedirs(os.path.dirname(os.path.abspath(args.lowered)), exist_ok=True)
        with open(args.lowered, "w") as f:
            f.write(lowered_text(args.platform))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="device_check", help="folder for device_check.json and device_check.md")
    p.add_argument("--budget-s", type=float, default=470.0, help="time for all phases together (default 470)")
    p.add_argument("--skip", default="", help=f"comma list of phases to skip: {', '.join(PHASES)}")
    p.add_argument("--workload-methods", default=",".join(WORKLOAD_DEFAULT),
                   help=f"workload phase: comma list of {', '.join(WORKLOAD_SHARE)}")
    p.add_argument("--layers", type=int, default=None, help="decode, events, memory: layers of the model")
    p.add_argument("--phase", choices=("lowering", "memory", "sweep", "invariance"), default=None,
                   help=argparse.SUPPRESS)  # a child process
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--lowered", default=None, help=argparse.SUPPRESS)
    p.add_argument("--platform", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.workload_methods.split(",")) - set(WORKLOAD_SHARE)
    if unknown:
        p.error(f"--workload-methods: {', '.join(sorted(unknown))} unknown; known: {', '.join(WORKLOAD_SHARE)}")
    if args.phase:
        return child(args)

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
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    report = dict(started=time.strftime("%Y-%m-%d %H:%M:%S"), environment=env, phases={})
    deadline = start + args.budget_s

    def remaining() -> float:
        return deadline - time.time()

    def save() -> None:  # after each phase: what has run so far, in case the whole check is stopped
        report["seconds"] = time.time() - start
        write_json(os.path.join(args.out, "device_check.json"), report)

    for name in (n for n in PHASES if n not in skip):
        report["phases"][name] = (run_phase(name, args, env, remaining) if remaining() >= 5 else
                                  dict(status="skipped", rc=None, seconds=0, tail=["no time left"]))
        save()
    report["targets"] = targets(report)
    save()
    text = markdown(report)
    with open(os.path.join(args.out, "device_check.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(phase.get("status") in ("passed", "done", "skipped") for phase in report["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
