"""The device check: on the accelerator present (GPU or TPU), in about 8 minutes, one JSON and one table.

    python -m benchmarks.device_check --out DIR   # exit 0: every phase run passed (or was skipped for time),
                                                  # 1: a phase failed, 2: no accelerator (nothing run or written)

Phases, in order, each a child process (a TPU belongs to one process at a time; the workload one per method) under
its cap (`CAPS`; what does not fit --budget-s, 470 s, is skipped), writing results.json and results.md in DIR/<phase>
(the workload's in DIR/workload_vase_dkv_2048 and DIR/workload_full):
  tests       the compiled kernels' tests (tests/test_kernels.py, tests/test_kernels_generate.py)
  invariance  `invariance_check`: row 0's greedy tokens alone and in batches of 16 and 128; invariance's cost
  sweep       `benchmarks.kernels --sweep-seconds` (GPU only): the decode kernel's launch table against the best found
  workload    `benchmarks.bench --workload aime25` for vase_dkv@2048, then full, each planning its rows on the device
  events      `benchmarks.bench --micro` (`EVENTS`): an eviction event against the B = 64 steps between events
  memory      `memory_peak`: the device's peak in one `generate` call against weights + cache + 2 GiB
  decode      `benchmarks.bench --micro` (`DECODE`): steps at 4k and 16k tokens against their bytes bound; full on K4V4
The default budget fits tests to sweep, the workload getting what is left: in a second lease run the workload alone,
and events, memory and decode with `--skip tests,invariance,sweep,workload`. Keep DIR/device_check.json and .md under
docs/device-runs/<date>-<device>/ and summarize the run in docs/BENCHMARKS.md.

Targets (in the table, not the exit status): the decode kernel >= 70% of the read bandwidth (batch 16 x 4k-16k slots,
128 x 2k); eviction events <= 3% of the decode time between them; the AIME25 protocol's projected wall time for
vase_dkv@2048 <= 30 min; the vase_dkv@2048 step at 16k >= 0.75 of its bytes bound; vase_dkv against full tokens/s at
16k >= 2.3x; full's K4V4 step at 16k <= 0.6x the 16-bit cache's; the device peak <= weights + cache + 2 GiB."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report import num, table, write_json, write_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_ACCELERATOR = 2
# the check's processes in order, each with the seconds it may take at most: a phase each, but the workload one
# per method (each its own peak); events, memory and decode together fill one budget of their own
CAPS = {"tests": 60, "invariance": 90, "sweep": 80, "workload vase_dkv@2048": 264, "workload full": 216, "events": 100,
        "memory": 70, "decode": 290}
PHASES = tuple(dict.fromkeys(key.split()[0] for key in CAPS))  # what --skip names
MIN_PHASE_S = 30  # a process with less time left is skipped
# per method, before the measuring: process start, the model's random weights, the plan (3 to 5 compiles of the
# engine's programs, about 40 s each for Qwen3-14B's 40 layers on XLA:GPU), the engine's two compiles
WORKLOAD_SETUP_S = 180
# the benchmarks' flags per phase (a phase adds --out, and --deadline where it stops new work in time)
DECODE = {"--micro": None, "--model": "qwen3-8b", "--dtype": "bfloat16", "--batch": "16", "--prompt-len": "256",
          "--output-lens": "4096,16384", "--methods": "full,vase_dkv,vase_attnv", "--budgets": "2048",
          "--buffer": "64", "--kv-bits": "K4V4", "--bandwidth-mib": "8192"}
EVENTS = {k: v for k, v in DECODE.items() if k != "--kv-bits"} | {  # a batch with room for the benchmark's cache
    "--model": "qwen3-14b", "--batch": "128", "--output-lens": "16384", "--methods": "vase_dkv,vase_attnv"}
DETECT = ("import json, jax; d = jax.devices()[0]; print(json.dumps(dict(backend=jax.default_backend(), "
          "device_kind=d.device_kind, count=jax.device_count(), jax=jax.__version__)))")


def flags(values: dict) -> list[str]:
    """{"--name": value or None (a switch)} as command-line arguments."""
    return [x for k, v in values.items() for x in ((k,) if v is None else (k, str(v)))]


def module(name: str, values: dict) -> list[str]:
    """`python -m benchmarks.<name>` with `values` as its flags."""
    return [sys.executable, "-m", f"benchmarks.{name}", *flags(values)]


def _env() -> dict[str, str]:
    """A child's environment: the repository importable, GPU memory not preallocated (the phases share the device
    one after another)."""
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", **os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return env


def _run(cmd: list[str], timeout: float, folder: str | None = None) -> dict:
    """A child process (`_env`): rc (None when stopped for time), status (done, failed or stopped), seconds, the
    output's last lines, and what it wrote in `folder`: results.json (as "results") and results.md (as "table")."""
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=max(timeout, 1))
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:  # its output comes as bytes whatever `text` asked for
        rc, out = None, (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "")
        out += f"\n[stopped after {timeout:.0f} s: phase time budget]"
    phase = dict(rc=rc, status="done" if rc == 0 else ("stopped" if rc is None else "failed"),
                 seconds=round(time.time() - start, 1), tail=out.strip().splitlines()[-30:])
    if folder and (path := Path(folder, "results.json")).exists():
        phase["results"] = json.loads(path.read_text())
    if folder and (path := Path(folder, "results.md")).exists():
        phase["table"] = path.read_text()
    return phase


# ---- the phases that are this module's own (`--phase NAME`, a child process) ----------------------------------
def memory_peak(*, model: str = "qwen3-8b", layers: int | None = None, dtype: str = "bfloat16", batch: int = 16,
                prompt_len: int = 256, budget: int = 2048, buffer: int = 64, new_tokens: int = 2304) -> dict:
    """One `generate` call (vase_dkv@budget, greedy, no end token) on a model of `model`'s shape: the device's peak
    bytes in use (None where the device does not say: CPU) against weights + cache (`planner.plan_memory`'s) +
    2 GiB, and the call's wall time."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import vase_jax as vj
    from vase_jax.config import NORM_PARAMS, param_shapes
    from vase_jax.planner import plan_memory
    from vase_jax.random_model import named_configs, shrink
    from vase_jax.sharding import make_mesh

    cfg, ev = shrink(named_configs()[model], layers=layers), vj.EvictionConfig("vase_dkv", budget=budget, buffer=buffer)
    plan = plan_memory(cfg, make_mesh(), batch, ev, prompt_len=prompt_len, max_new_tokens=new_tokens,
                       dtype=jnp.dtype(dtype), compile_program=False)
    # weights made in place, one array at a time (a random init would hold float32 draws beside them, which the
    # device's peak would count): constant weights read and compute exactly as random ones
    qwen = vj.Qwen3.from_params(cfg, {path: jnp.full(shape, 1.0 if path[-1] in NORM_PARAMS + ("weight",) else 0.01,
                                                     dtype) for path, shape in param_shapes(cfg).items()},
                                jnp.dtype(dtype))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
    t0 = time.perf_counter()
    out = jax.block_until_ready(vj.generate(qwen, ids, np.ones_like(ids), key=jax.random.key(0), eviction=ev, config=(
        vj.GenerateConfig(max_new_tokens=new_tokens, temperature=0.0, eos_token_ids=()))))
    seconds = time.perf_counter() - t0
    peak, bound = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"), plan.weights + plan.cache + 2**31
    return dict(model=model, layers=cfg.num_layers, dtype=dtype, batch=batch, prompt_len=prompt_len, budget=budget,
                new_tokens=new_tokens, evictions=int(out.evictions), seconds=seconds, weights=plan.weights,
                cache=plan.cache, bound=bound, peak=peak, within=None if peak is None else peak <= bound)


def memory_markdown(m: dict) -> str:
    """`memory_peak`'s line: the call, the peak and its bound."""
    return (f"One generate: {m['model']} shape, {m['layers']} layers, {m['dtype']}, batch {m['batch']}, "
            f"vase_dkv@{m['budget']}, {m['new_tokens']} new tokens, {m['evictions']} eviction events, "
            f"{m['seconds']:.1f} s: peak {num(m['peak'], '.2f', 2**-30)} GiB; weights {m['weights'] / 2**30:.2f} + "
            f"cache {m['cache'] / 2**30:.2f} + 2 GiB = {m['bound'] / 2**30:.2f} GiB\n")


def invariance_check(*, probe_model: str = "qwen3-8b", model: str = "qwen3-0.6b", layers: int = 2,
                     batches=(1, 16, 128), new_tokens: int = 256, deadline: float | None = None,
                     out: str | None = None) -> dict:
    """Batch invariance on this device, written after each figure: the probe's `RowRule` for `probe_model`'s widths
    in bf16, then, on a random bf16 model of `model`'s widths, row 0's greedy tokens in batches of `batches` rows
    (full and vase_dkv@128, B = 32) against the lone row's (no new batch after `deadline`); and one call's wall time
    at 1 row and at the largest batch with `batch_invariant` on and off (the cost of invariance)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import vase_jax as vj
    from benchmarks.timing import time_runs
    from vase_jax.invariance import rule_for
    from vase_jax.random_model import named_configs, random_model, shrink
    from vase_jax.target import Target

    t0 = time.perf_counter()
    rule = rule_for(named_configs()[probe_model], jnp.bfloat16, Target.of())
    result: dict = dict(model=model, layers=layers, batches=list(batches), new_tokens=new_tokens, rows={}, seconds={},
                        probe=dict(seconds=time.perf_counter() - t0, min_rows=rule.min_rows, invariant=rule.invariant,
                                   describe=rule.describe(), differs={op: list(ms) for op, ms in rule.differs}))
    qwen = random_model(shrink(named_configs()[model], layers=layers), jnp.bfloat16)
    ids = np.random.default_rng(0).integers(0, qwen.cfg.vocab_size, (max(batches), 64)).astype(np.int32)

    def call(rows: int, ev: vj.EvictionConfig | None = None, **options):
        config = vj.GenerateConfig(max_new_tokens=new_tokens, temperature=0.0, eos_token_ids=(), **options)
        return vj.generate(qwen, ids[:rows], np.ones_like(ids[:rows]), key=jax.random.key(0), config=config,
                           eviction=ev or vj.EvictionConfig("full")).tokens

    for ev in (vj.EvictionConfig("full"), vj.EvictionConfig("vase_dkv", budget=128, buffer=32)):
        lone = None
        for batch in batches:
            if deadline is not None and time.time() > deadline:
                result["stopped"] = "deadline"
                break
            tokens = np.asarray(call(batch, ev)[0])
            lone = tokens if lone is None else lone
            same = int(np.argmin(np.append(tokens == lone, False)))  # the first differing step (new_tokens: none)
            result["rows"][f"{ev.method}@{batch}"] = dict(first_difference=same, identical=same == new_tokens)
            write_results(out, result, invariance_markdown(result))
    for rows in () if "stopped" in result else (1, max(batches)):
        for on in (True, False):
            result["seconds"][f"{rows} {'on' if on else 'off'}"] = time_runs(
                lambda rows=rows, on=on: call(rows, batch_invariant=on), 1, 1).median
    write_results(out, result, invariance_markdown(result))
    return result


def invariance_markdown(result: dict) -> str:
    """`invariance_check`'s table: each batch's first step differing from the lone row's; the calls' times."""
    lines = [f"Batch invariance: {result['probe']['describe']}", ""] + table(result["rows"].items(), {
        "row 0 of a batch of": lambda kv: kv[0],
        "first step differing from the lone row's": lambda kv: "none" if kv[1]["identical"] else
        kv[1]["first_difference"]})
    timed = result["seconds"]
    lines += [f"\n{rows} rows x {result['new_tokens']} tokens: {timed[f'{rows} on']:.3f} s invariant, "
              f"{timed[f'{rows} off']:.3f} s not ({timed[f'{rows} off'] / timed[f'{rows} on']:.2f}x the tokens/s)"
              for rows in sorted({int(k.split()[0]) for k in timed})]
    return "\n".join(lines) + "\n"


# ---- running the phases -------------------------------------------------------------------------------------
def workload_command(label: str, cap: float, out: str, scale: str = "protocol") -> list[str]:
    """The workload's child for one method ("vase_dkv@2048", "full"): `benchmarks.bench --workload aime25` at
    `scale`, measuring what `cap` leaves after `WORKLOAD_SETUP_S`, ending 5 s before it, and without `--batch`: the
    child plans its rows on its device (`planner.largest_batch`, the device's compiler and allocator limit)."""
    method, _, budget = label.partition("@")
    seconds = max(cap - WORKLOAD_SETUP_S, 10)
    return module("bench", {"--workload": "aime25", "--scale": scale, "--methods": method,
                            **({"--budgets": budget} if budget else {}), "--seconds": round(seconds),
                            "--deadline": time.time() + cap - 5, "--out": out})


def phase_command(key: str, folder: str, cap: float, backend: str) -> list[str] | None:
    """The process of `CAPS`' entry `key` under `cap` seconds, writing results.json and results.md in `folder` and
    starting no new work 20 s before its cap (at most half-way). None: the sweep off a GPU (it times the Triton
    kernel)."""
    deadline = time.time() + max(cap - 20, cap / 2)
    if key == "tests":  # the compiled kernels only: the rest (interpret mode, references) runs on any CPU
        other = "pallas_tpu" if backend == "gpu" else "pallas-"  # the other family would run interpreted
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py",
                "tests/test_kernels_generate.py", "-k", f"not Interpret and not {other} and not Reference and not "
                "auto_picks and not explicit_impls"]
    if key.startswith("workload "):
        return workload_command(key.split()[1], cap, folder)
    if key == "sweep":
        return module("kernels", {"--sweep-seconds": round(deadline - time.time()), "--out": folder}) if (
            backend == "gpu") else None
    if key in ("invariance", "memory"):
        return module("device_check", {"--phase": key, "--out": folder, "--deadline": deadline})
    return module("bench", (EVENTS if key == "events" else DECODE) | {"--deadline": deadline, "--out": folder})


# ---- the report ---------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    """The phases' statuses, the kernel tests' summary line, each phase's own table (its results.md), the targets."""
    env, phases = report["environment"], report["phases"]
    lines = [f"# Device check: {env.get('device_kind')} ({env.get('backend')}), jax {env.get('jax')}", "",
             f"{report['started']}; python {env.get('python')}; total {report['seconds']:.0f} s.", ""]
    lines += table(phases.items(), {"phase": lambda p: p[0], "status": lambda p: p[1].get("status"),
                                    "seconds": lambda p: p[1].get("seconds", "-")})
    tests = [s for s in phases.get("tests", {}).get("tail", []) if " passed" in s or " failed" in s]
    lines += [f"\nTests: `{tests[-1]}`"] if tests else []
    for name, phase in phases.items():
        lines += ["", f"## {name}", "", phase["table"].strip()] if phase.get("table") else []
    if report.get("targets"):
        lines += ["", "## Targets", ""] + [f"- {k}: {v}" for k, v in report["targets"].items()]
    return "\n".join(lines) + "\n"


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def targets(report: dict) -> dict[str, str]:
    """Each target (module docstring) that the phases' results measure: met or not, and the figure. Read from the
    sweep's {"shapes": [{"shape", "table", "best"}]}, bench --workload's {"methods"}, bench --micro's {"runs"} and
    `memory_peak`'s record."""
    out, results = {}, {name: p.get("results") or {} for name, p in report["phases"].items()}
    for name, want in (("batch 16, 4k-16k slots", lambda s: s["batch"] == 16 and 4096 <= s["slots"] <= 16384),
                       ("batch 128, 2k slots", lambda s: s["batch"] == 128)):
        rows = [e for e in results.get("sweep", {}).get("shapes", []) if want(e["shape"])]
        tab, best = ([(e.get(k) or {}).get("fraction_of_read_bw") for e in rows] for k in ("table", "best"))
        if rows and None not in tab:
            out[f"decode kernel >= 70% of the read bandwidth ({name})"] = (
                f"{_met(min(tab) >= 0.7)} with the table: lowest {100 * min(tab):.0f}%"
                + (f"; the sweep's best: lowest {100 * min(best):.0f}%" if None not in best else ""))
    for r in results.get("events", {}).get("runs", []):
        if r.get("eviction_share") is not None:
            out[f"{r['method']}@{r['budget']} eviction events <= 3% of the decode time between them"] = (
                f"{_met(r['eviction_share'] <= 0.03)}: {100 * r['eviction_share']:.1f}%")
    dkv, full = ((results.get(f"workload {m}", {}).get("methods") or [{}])[0] for m in ("vase_dkv@2048", "full"))
    if "protocol" in dkv:
        minutes = dkv["protocol"]["seconds"] / 60
        beside = f" (full: {full['protocol']['seconds'] / 60:.1f} min at {full['rows']} rows)" if (
            "protocol" in full) else ""
        out["the AIME25 protocol's projected wall time, vase_dkv@2048, <= 30 min"] = (
            f"{_met(minutes <= 30)}: {minutes:.1f} min at {dkv['rows']} rows{beside}")
    at = {r["method"]: r for r in results.get("decode", {}).get("runs", [])
          if r["output_len"] == 16384 and "skipped" not in r}
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
    if (memory := results.get("memory", {})).get("peak") is not None:
        out["device peak <= weights + cache + 2 GiB"] = (
            f"{_met(memory['within'])}: {memory['peak'] / 2**30:.2f} GiB against {memory['bound'] / 2**30:.2f} GiB")
    return out


def main(argv: list[str] | None = None) -> int:
    """The check (module docstring; its exit status), or as a child one phase of this module's own (`--phase`)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="device_check", help="folder for device_check.json and device_check.md")
    p.add_argument("--budget-s", type=float, default=470.0, help="time for all phases together (default 470)")
    p.add_argument("--skip", default="", help=f"comma list of phases to skip: {', '.join(PHASES)}")
    p.add_argument("--phase", choices=("invariance", "memory"), default=None, help=argparse.SUPPRESS)  # a child
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if (skip := {s.strip() for s in args.skip.split(",") if s.strip()}) - set(PHASES):
        p.error(f"--skip: {', '.join(sorted(skip - set(PHASES)))} unknown; phases: {', '.join(PHASES)}")
    if args.phase == "invariance":  # fails where a row's tokens depend on its batch
        rows = invariance_check(deadline=args.deadline, out=args.out)["rows"]
        return int(not all(r["identical"] for r in rows.values()))
    if args.phase == "memory":
        write_results(args.out, m := memory_peak(), memory_markdown(m))
        return 0
    start = time.time()
    # jax's own answer on stdout (its warnings, however many, on stderr)
    detect = subprocess.run([sys.executable, "-c", DETECT], cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=120)
    if not (found := [line for line in detect.stdout.splitlines() if line.startswith("{")]):
        print(f"device_check.py: error: could not start jax:\n{detect.stderr[-2000:]}", file=sys.stderr)
        return 1
    env = json.loads(found[-1]) | {"python": platform.python_version()}
    if env["backend"] not in ("gpu", "tpu"):
        print(f"device_check.py: no accelerator: jax {env['jax']} sees only {env['backend']} devices "
              f"({env['device_kind']}). Nothing was run (on a CPU, `pytest tests/test_kernels.py "
              "tests/test_lowering.py` checks the kernels in interpret mode and their lowering).", file=sys.stderr)
        return NO_ACCELERATOR
    report = dict(started=time.strftime("%Y-%m-%d %H:%M:%S"), environment=env, phases={}, targets={})
    for key, cap in ((k, c) for k, c in CAPS.items() if k.split()[0] not in skip):
        cap = min(cap, start + args.budget_s - time.time())
        folder = os.path.join(args.out, key.replace(" ", "_").replace("@", "_"))
        cmd = phase_command(key, folder, cap, env["backend"])
        report["phases"][key] = _run(cmd, cap, folder) if cmd and cap >= MIN_PHASE_S else dict(
            status="skipped", rc=None, seconds=0, tail=["time budget" if cmd else "the sweep needs a GPU"])
        report["seconds"] = time.time() - start
        write_json(os.path.join(args.out, "device_check.json"), report)  # so far, in case the check is stopped
    report["targets"], report["seconds"] = targets(report), time.time() - start  # seconds: also when all skipped
    write_json(os.path.join(args.out, "device_check.json"), report)
    Path(args.out, "device_check.md").write_text(text := markdown(report))
    print(text)
    return 0 if all(phase["status"] in ("done", "skipped") for phase in report["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
