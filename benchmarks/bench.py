"""Decode speed, memory and cost of `vase_jax.generate` per eviction method, budget and output length;
optionally against Hugging Face transformers on the same weights; with a memory-bandwidth roofline.

    python -m benchmarks.bench --model tiny-1k --output-lens 64 --methods full,vase_dkv --budgets 32 --buffer 8
    python -m benchmarks.bench --model qwen3-0.6b --layers 4 --output-lens 32 --methods full --compare-hf
    python -m benchmarks.bench --model small --batch 2 --output-lens 2048,8192 --budgets 1024 --out bench_long
    python -m benchmarks.bench --workload aime25 --seconds 120 --out bench_aime25      # Qwen3-14B's shape, on a GPU
    python -m benchmarks.bench --workload aime25 --scale tiny --out bench_aime25_tiny  # the same code path, on a CPU

--workload aime25: the AIME25 protocol of the paper (30 problems x 16 samples = 480 samples, at most 32768 tokens
each, prompt included) on random weights of Qwen3-14B's shape, bf16, 256-token prompts, output lengths drawn from a
log-normal (median 12k, sigma 0.5, seeded; capped at 32768 - 256), each sample ended at its drawn length by its
cap. Per method (default vase_dkv@2048, vase_attnv@2048, full; B = 64) at the largest batch that fits the device
(`planner.largest_batch` with the device's compiler and its allocator limit; --batch N overrides), each method is
measured for --seconds and the whole protocol projected (`benchmarks.workload.aime25_workload`):

    T = rounds * round_s + steps * step_s + slot_reads * slot_s + events * event_s

rounds, steps, slot_reads (the cache slots the steps' attention reads, over rows and steps: each row up to its
own length with the Pallas kernels, up to the longest row's on the XLA path) and events from the engine's schedule
of the 480 drawn lengths, simulated on the host; round_s from runs that end at the prefill, the others fitted
(non-negative least squares) to lockstep runs of doubling lengths, then checked on a continuous run. --batch N or
--batch vase_dkv@2048=N1,full=N2 skips the search (which compiles at 3 or more sizes per method; plan beforehand
with scripts/plan.py --batch auto on any host). --scale tiny: the tiny-1k model, 24 samples, 16-token prompts, 256
tokens at most, median 96, budget 32, B = 8, 6 rows (or the largest that fits --device-gb).

`--model` is a hub id, a local HF folder, or a named random model (`vase_jax.random_model.named_configs`): `tiny`,
`tiny-1k` (tests), `small` (long CPU runs), or `qwen3-0.6b`, `qwen3-4b`, ... (the packaged real configs, random
weights), shrunk with `--layers` / `--vocab`.
Every generation is greedy and fixed-length (no end token). How each figure is obtained:
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import vase_jax as vj
from benchmarks import decode_step as ds
from benchmarks import workload as wl
from benchmarks.report import ints, method_label, num, write_json
from benchmarks.timing import Stat, bandwidth, decode_rate, device_desc, load_warning, machine, time_runs
from vase_jax.cache import cache_bytes
from vase_jax.eviction import METHODS, EvictionConfig, framework
from vase_jax.generate import LAYER_LOOPS, generate_target, generate_tiers, lower_generate, query_window
from vase_jax.jit import enable_compilation_cache, release_programs_near_mapping_limit
from vase_jax.kvquant import KVBits, token_bytes
from vase_jax.random_model import named_configs, shrink

HOW = {
    "compile_s": "jax.jit(generate).lower(...).compile(), timed once; never part of a timed run",
    "total_s": "one compiled generate call (prefill + every decode step + evictions), wall time ended by "
    "block_until_ready; median [min-max] of --repeats runs after --warmup untimed runs",
    "prefill_s": "a jitted copy of generate's prefill alone (prompt forward, cache allocation, first token)",
    "decode_tok_s": "batch * (output_len - 1) / (total_s - fastest prefill_s), per run",
    "segments": "marginal decode tokens/s between consecutive output lengths, batch * delta_len / "
    "delta(median total_s); the first segment is decode_tok_s of the shortest length",
    "step_ms_start/end": "a jitted fori_loop of --micro-steps greedy decode_steps (cache donated, no "
    "eviction) on a cache filled with random K/V to the length at the first / the last step of the run; "
    "per step",
    "evict_ms": "a jitted framework.evict on a cache filled to budget + buffer slots (donated); per event",
    "evict_overhead": "events * median evict_ms / (median total_s - median prefill_s)",
    "tok_s_start/end": "batch / step_ms_start, and batch / (step_ms_end + evict_ms / buffer) (eviction "
    "amortized)",
    "cache_bytes": "bytes of the KV-cache arrays generate allocates (vase_jax.cache.cache_bytes)",
    "program_bytes": "arguments + outputs + temporaries - aliased bytes of the compiled generate program "
    "(Compiled.memory_analysis()): its peak memory, weights included",
    "peak_rss_bytes": "CPU: the process's peak resident set (ru_maxrss) after the run (whole process)",
    "device_peak_bytes": "GPU: memory_stats()['peak_bytes_in_use'] after the run (whole process)",
    "roofline": "bytes a decode step must read: weights + live K/V/pos slots (+ 2x the budget+buffer slots "
    "per eviction event); bound_tok_s = batch * steps * bandwidth / total bytes, with the larger read "
    "bandwidth measured after the runs (a jax sum over --bandwidth-mib; on a CPU also a numpy sum)",
    "hf": "transformers Qwen3ForCausalLM holding our weights, generate(do_sample=False, min_new_tokens = "
    "max_new_tokens = n), timed the same way; its prefill_s is generate with max_new_tokens=1 (same cache)",
}
PAPER_METHODS = ("full", "snapkv", "rkv", "curdkv", "vase_attnv", "vase_dkv")
DEFAULT_MODEL = "qwen3-0.6b"
# --workload aime25: the defaults of each scale (flags given on the command line win)
WORKLOADS = {"aime25": {
    "protocol": {"model": "qwen3-14b", "dtype": "bfloat16", "methods": "vase_dkv,vase_attnv,full",
                 "budgets": [2048], "buffer": 64, "prompt_len": wl.AIME25["prompt_len"],
                 "samples": wl.AIME25["samples"]},
    "tiny": {"model": "tiny-1k", "methods": "vase_dkv,vase_attnv,full", "budgets": [32], "buffer": 8,
             "prompt_len": wl.AIME25_TINY["prompt_len"], "samples": wl.AIME25_TINY["samples"], "batch": 6},
}}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit status 2
        print(f"bench.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def _batch(text: str) -> int | dict[str, int]:
    """N, or LABEL=N,... (per method, --workload aime25)."""
    try:
        if "=" not in text:
            return int(text)
        return {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(",") if item.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an int nor LABEL=N,...") from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(description=__doc__ + "\n".join(f"  {k}: {v}" for k, v in HOW.items()),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default=None, help="hub id, local HF folder, or named random model (default qwen3-0.6b; "
      "aime25: qwen3-14b, tiny)")
    a("--layers", type=int, default=None, help="named random models: number of layers")
    a("--vocab", type=int, default=None, help="named random models: vocabulary size")
    a("--hidden", type=int, default=None, help="named random models: hidden size (heads unchanged)")
    a("--intermediate", type=int, default=None, help="named random models: MLP width")
    a("--layer-loop", default="auto", choices=LAYER_LOOPS,
      help="how the decode step runs the layers (GenerateConfig.layer_loop)")
    a("--compile-only", action="store_true",
      help="only compile generate per method and budget (the first --output-lens): compile seconds and "
           "Compiled.memory_analysis() temporaries, no timed runs")
    a("--dtype", choices=("float32", "bfloat16"), default=None, help="default: float32 (CPU), bfloat16 (GPU)")
    a("--batch", type=_batch, default=None, help="rows (default 4); --workload aime25: the largest that fits per "
      "method (default), N for every method, or LABEL=N,... (e.g. vase_dkv@2048=187,full=19; the others fit)")
    a("--prompt-len", type=int, default=None, help="random prompt tokens per row (default 128; aime25: 256)")
    a("--output-lens", type=ints, default=[1024], help="comma list: new tokens per row")
    a("--methods", default=None,
      help="default full,vase_attnv,vase_dkv (aime25: vase_dkv,vase_attnv,full); comma list (full and "
      "vj.eviction.METHODS: snapkv, rkv, rkv_official, curdkv, vase_attnv, vase_dkv, h2o, "
      "keydiff, ablations), 'paper' (full + the five) or 'all' (full + every policy)")
    a("--calibration", default=None, help="triattention's statistics file (default: the model folder's; random "
      "numbers of the model's shape for a named random model)")
    a("--budgets", type=ints, default=None, help="comma list of budgets N (eviction methods; default 512, aime25: "
      "2048)")
    a("--buffer", type=int, default=None, help="buffer B, the eviction period (default 64)")
    a("--attention-impl", default="auto", choices=("auto", "xla", "pallas"))
    a("--repeats", type=int, default=3, help="timed runs per figure (>= 3)")
    a("--warmup", type=int, default=1, help="untimed runs after compiling, before the timed ones")
    a("--micro-steps", type=int, default=8, help="decode steps per micro-benchmark call")
    a("--compare-hf", action="store_true", help="also time transformers generate on the same weights")
    a("--hf-caches", default="dynamic,static", help="HF cache implementations: dynamic, static")
    a("--bandwidth-mib", type=int, default=512, help="array size of the bandwidth measurement")
    a("--spread-samples", type=int, default=0,
      help="> 0: instead of the runs above, the spread workload: this many samples whose output lengths are "
           "drawn uniformly from [L/16, L] (L = the first --output-lens), on --batch rows, static (generate per "
           "chunk of --batch samples) vs continuous (vase_jax.batching), --repeats times alternating: median "
           "tokens/s, row utilization, evictions")
    a("--workload", choices=("aime25",), default=None,
      help="aime25: the AIME25 protocol's shape, measured per method for --seconds and projected (see above)")
    a("--scale", choices=("protocol", "tiny"), default="protocol",
      help="--workload aime25: the protocol (Qwen3-14B's shape) or its CPU-sized copy (tiny)")
    a("--seconds", type=float, default=120.0, help="--workload aime25: measuring time per method (default 120; "
      "the plan and the compile come on top)")
    a("--deadline", type=float, default=None, help="--workload aime25: a time (seconds since the epoch) by which "
      "each method's measuring ends: --seconds is shortened to what is left after the plan and the compile")
    a("--samples", type=int, default=None, help="--workload aime25: samples (default 480; tiny 24)")
    a("--device-gb", type=float, default=None, help="--workload aime25: device memory in GB (1e9 bytes) the batch "
      "must fit (default: the device's allocator limit; a CPU has none: give it or --batch)")
    a("--headroom", type=float, default=0.05, help="--workload aime25: share of the memory left free (default 0.05)")
    a("--queue", type=int, default=None, help="--workload aime25: samples prefilled per round (default: the rows, "
      "at most 64, as batching.run); fewer hold less memory (the staged prompts and the prefill's temporaries)")
    a("--kv-bits", default=None,
      help="instead of the runs above, the mixed-precision cache: a comma list of settings (bf16, K8V8, K8V4, "
           "K4V4, K<bits>V<bits>g<group>), each per method and budget at the first --output-lens, with the "
           "default Range protection and, where that protects slots, without (P = 0): bytes per token, cache "
           "bytes, the program's peak, decode tokens/s and the tokens that agree with bf16")
    a("--seed", type=int, default=0)
    a("--out", default=None, help="folder for results.json and results.md")
    a("--compile-cache", metavar="DIR", help="JAX's persistent compilation cache (default "
      "$VASE_JAX_COMPILATION_CACHE or ~/.cache/vase-jax/xla); off with --compile-only, whose figures are compiles")
    a("--no-compile-cache", action="store_true", help="compile every program anew")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[EvictionConfig]:
    """Every check that needs no model (ValueError naming the parameter); returns the configurations."""
    aime = WORKLOADS.get(args.workload)
    if aime is not None:
        if args.spread_samples or args.compile_only or args.compare_hf:
            raise ValueError("--workload aime25 runs alone: drop --spread-samples, --compile-only and --compare-hf")
        for name, value in aime[args.scale].items():
            if getattr(args, name) is None and not (name == "batch" and args.device_gb is not None):
                setattr(args, name, value)
        if not args.seconds > 0:
            raise ValueError(f"--seconds={args.seconds} must be > 0")
        if args.samples < 1:
            raise ValueError(f"--samples={args.samples} must be >= 1")
        if not 0 <= args.headroom < 1:
            raise ValueError(f"--headroom={args.headroom} must be in [0, 1)")
        if args.queue is not None and args.queue < 1:
            raise ValueError(f"--queue={args.queue} must be >= 1")
        if args.device_gb is not None and args.device_gb <= 0:
            raise ValueError(f"--device-gb={args.device_gb} must be > 0")
    elif args.scale != "protocol":
        raise ValueError("--scale applies to --workload aime25")
    if args.kv_bits is not None:
        if aime or args.spread_samples or args.compile_only or args.compare_hf:
            raise ValueError("--kv-bits runs alone: drop --workload, --spread-samples, --compile-only and "
                             "--compare-hf")
        args.kv_bits = kv_settings(args.kv_bits)
    defaults = {"model": DEFAULT_MODEL, "prompt_len": 128, "methods": "full,vase_attnv,vase_dkv", "budgets": [512],
                "buffer": 64} | ({} if aime else {"batch": 4})
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.spread_samples < 0:
        raise ValueError(f"--spread-samples={args.spread_samples} must be >= 0")
    if isinstance(args.batch, dict) and not aime:
        raise ValueError(f"--batch={args.batch}: rows per method apply to --workload aime25; give one int")
    if isinstance(args.batch, dict):
        bad = {k: v for k, v in args.batch.items() if v < 1}
        if bad:
            raise ValueError(f"--batch: {bad} must be >= 1")
    for name in ("batch", "prompt_len", "micro_steps", "bandwidth_mib"):
        if isinstance(getattr(args, name), int) and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.repeats < 3:
        raise ValueError(f"--repeats={args.repeats} must be >= 3 (each figure is a median of >= 3 runs)")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    bad = [n for n in args.output_lens if n < 2]
    if bad or not args.output_lens:
        raise ValueError(f"--output-lens={bad or args.output_lens}: each must be >= 2 (a prefill token and "
                         "at least one decode step)")
    args.output_lens = sorted(set(args.output_lens))
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    if names == ["paper"]:
        names = list(PAPER_METHODS)
    elif names == ["all"]:
        names = ["full"] + sorted(METHODS)
    unknown = [m for m in names if m not in METHODS and m != "full"]
    if unknown or not names:
        raise ValueError(f"--methods: unknown {unknown or names}; known: full, {', '.join(sorted(METHODS))}")
    configs = []
    for m in dict.fromkeys(names):
        if m == "full":
            configs.append(EvictionConfig("full").validate())
        elif not args.budgets:
            raise ValueError(f"--budgets is empty but method {m!r} needs a budget")
        elif "calibration" in METHODS[m].option_names:  # validated with the model (`with_calibration`)
            configs += [EvictionConfig(m, budget=n, buffer=args.buffer, calibration=args.calibration)
                        for n in args.budgets]
        else:
            configs += [EvictionConfig(m, budget=n, buffer=args.buffer).validate() for n in args.budgets]
    if args.calibration is not None and not any("calibration" in METHODS[m].option_names for m in names
                                                if m != "full"):
        raise ValueError("--calibration is for --methods triattention")
    if isinstance(args.batch, dict):
        labels = [method_label(ev.method, ev.evicts and ev.budget) for ev in configs]
        unknown = sorted(set(args.batch) - set(labels))
        if unknown:
            raise ValueError(f"--batch: {', '.join(unknown)} not among the methods ({', '.join(labels)})")
    args.hf_caches = [c.strip() for c in args.hf_caches.split(",") if c.strip()]
    if args.compare_hf and (not args.hf_caches or set(args.hf_caches) - {"dynamic", "static"}):
        raise ValueError(f"--hf-caches={','.join(args.hf_caches)!r}; allowed: dynamic, static")
    return configs


def with_calibration(configs: list[EvictionConfig], model: vj.Qwen3, args) -> list[EvictionConfig]:
    """The configurations validated, a method that takes a calibration given one: --calibration, the model
    folder's, or (a named random model) statistics of random numbers of its shape (speed does not depend on
    them)."""
    from vase_jax.calibration import random_statistics
    from vase_jax.eviction.triattention import save_calibration, stats_path

    out = []
    for ev in configs:
        if ev.evicts and "calibration" in ev.policy.option_names and ev.options.calibration is None:
            local = os.path.isdir(args.model) and os.path.isfile(stats_path(args.model))
            if local:
                path = stats_path(args.model)
            else:
                path = save_calibration(os.path.join(tempfile.mkdtemp(prefix="bench-stats-"), "random.npz"),
                                        random_statistics(model.cfg))
            ev = dataclasses.replace(ev, options=dataclasses.replace(ev.options, calibration=path))
        out.append(ev.validate())
        framework.check_model(ev, model.cfg)
    return out


def load_model(args: argparse.Namespace, dtype) -> tuple[vj.Qwen3, str]:
    """(model, description): a named random model, or a checkpoint folder / hub id."""
    named = named_configs()
    name = args.model.lower()
    if name in named:
        cfg = shrink(named[name], args.layers, args.vocab, args.hidden, args.intermediate)
        desc = (f"{name} (random weights, {cfg.num_layers} layers, hidden {cfg.hidden_size}, mlp "
                f"{cfg.intermediate_size}, vocab {cfg.vocab_size})")
        return vj.Qwen3(cfg, dtype=dtype, rngs=nnx.Rngs(args.seed)), desc
    if any(getattr(args, n) is not None for n in ("layers", "vocab", "hidden", "intermediate")):
        raise ValueError(f"--layers / --vocab / --hidden / --intermediate apply to named random models "
                         f"({', '.join(named)}) only, not to --model={args.model!r}")
    return vj.Qwen3.from_pretrained(args.model, dtype=dtype), args.model


# ---- measurements ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Bench:
    """What every measurement shares: the arguments, the model split for jit, the prompt, memoized figures."""

    args: argparse.Namespace
    model: vj.Qwen3
    memo: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        a = self.args
        self.graphdef, self.state = nnx.split(self.model)
        self.target = generate_target(self.model, self.generate_config(1))  # as generate picks it
        # [batch, bucket] int32: the prompt left-padded to its bucket as generate pads it (the prefill's input);
        # `raw`: the unpadded prompt that generate itself gets (it pads it, which sets its cache capacity)
        rows = a.batch if isinstance(a.batch, int) else 1  # the aime25 workload draws its own prompts and rows
        self.ids, self.mask = ds.random_prompt(self.model.cfg.vocab_size, rows, a.prompt_len, self.generate_config(2),
                                               a.seed)
        self.raw = (self.ids[:, -a.prompt_len:], self.mask[:, -a.prompt_len:])
        self.key = jax.random.key(a.seed)

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def bucket(self) -> int:
        return self.ids.shape[1]

    def generate_config(self, n: int) -> vj.GenerateConfig:
        return vj.GenerateConfig(max_new_tokens=n, temperature=0.0, eos_token_ids=(), pad_token_id=0,
                                 layer_loop=self.args.layer_loop, attention_impl=self.args.attention_impl)

    def program(self, config: vj.GenerateConfig, ev: EvictionConfig) -> tuple[functools.partial, float, int | None]:
        """`generate` compiled as it compiles itself, called on the unpadded prompt: (the call, compile seconds,
        the program's peak bytes: arguments + outputs + temporaries - aliased, from `memory_analysis`)."""
        graphdef = self.graphdef

        def generate(state, ids, mask, key):
            return vj.generate(nnx.merge(graphdef, state), ids, mask, key=key, config=config, eviction=ev)

        start = time.perf_counter()
        compiled = jax.jit(generate, compiler_options=self.target.compiler_options()).lower(
            self.state, *self.raw, self.key).compile()
        compile_s = time.perf_counter() - start
        mem = compiled.memory_analysis()
        peak = None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                         + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
        return functools.partial(compiled, self.state, *self.raw, self.key), compile_s, peak

    def prefill(self, capacity, ev: EvictionConfig) -> functools.partial:
        """A jitted copy of generate's prefill (prompt forward, a cache of `capacity`: slots or a tier layout)."""
        return functools.partial(ds.prefill, self.graphdef, self.state, self.ids, self.mask, capacity,
                                 query_window(ev), self.args.attention_impl, framework.slot_state(ev), self.target)

    def step_ms(self, capacity: int, window: int, length: int, state: tuple = ()) -> Stat:
        """Per-step milliseconds of `decode_steps` from `length` live slots (memoized); `state`: the policy's
        per-slot state arrays (their update is part of the step)."""
        steps = self.args.micro_steps
        length = max(1, min(length, capacity - steps))
        key = ("step", capacity, window, length, state)
        if key not in self.memo:
            cache = ds.filled_cache(self.model.cfg, self.batch, capacity, length, window, self.model.dtype,
                                    self.args.seed, state, self.target)
            self.memo[key] = ds.step_ms(self.graphdef, self.state, cache, jnp.int32(length), steps,
                                        self.args.repeats, self.args.attention_impl, self.target)
        return self.memo[key]

    def evict_ms(self, ev: EvictionConfig, capacity: int) -> Stat:
        """Milliseconds of one eviction event on a full cache (memoized per configuration)."""
        key = ("evict", ev, capacity)
        if key not in self.memo:
            cache = ds.filled_cache(self.model.cfg, self.batch, capacity, ev.budget + ev.buffer, query_window(ev),
                                    self.model.dtype, self.args.seed, framework.slot_state(ev), self.target)
            self.memo[key] = ds.evict_ms(cache, ev, max(self.args.repeats, 5), self.args.attention_impl,
                                         self.args.seed)
        return self.memo[key]

    def compile_only(self, ev: EvictionConfig, n: int) -> dict:
        """Compile seconds and memory analysis of generate for one configuration, without running it."""
        start = time.perf_counter()
        lowered = lower_generate(self.model, *self.raw, key=self.key, config=self.generate_config(n), eviction=ev)
        lower_s = time.perf_counter() - start
        compiled = lowered.compile()
        mem = compiled.memory_analysis()
        return {"method": ev.method, "budget": ev.budget if ev.evicts else None, "output_len": n,
                "capacity": framework.capacity_for(ev, self.bucket, n), "lower_s": lower_s,
                "compile_s": time.perf_counter() - start, "hlo_lines": len(compiled.as_text().splitlines()),
                "temp_bytes": None if mem is None else mem.temp_size_in_bytes,
                "argument_bytes": None if mem is None else mem.argument_size_in_bytes}

    def run(self, ev: EvictionConfig, n: int) -> tuple[dict, np.ndarray]:
        """Every figure of one (method, budget, output length); also returns the generated tokens."""
        args, b = self.args, self.batch
        capacity, window = framework.capacity_for(ev, self.bucket, n), query_window(ev)
        call, compile_s, program_bytes = self.program(self.generate_config(n), ev)
        last = {}

        def timed():
            last["out"] = call()
            return last["out"]

        total = time_runs(timed, args.repeats, args.warmup)
        out = last.pop("out")
        prefill = self.prefill(capacity, ev)
        prefill_s = time_runs(prefill, args.repeats, 1)
        reads, after, triggers = ds.row_replay(ev, args.prompt_len, n - 1)
        tok_s = decode_rate(total, prefill_s, b * (n - 1))
        state = framework.slot_state(ev)
        step_start = self.step_ms(capacity, window, args.prompt_len, state)
        step_end = self.step_ms(capacity, window, int(reads[-1]) - 1, state)
        evict = self.evict_ms(ev, capacity) if ev.evicts else None
        evict_per_step = evict.median / ev.buffer if evict is not None else 0.0
        decode_s = total.median - prefill_s.median
        overhead = None if decode_s <= 0 else len(triggers) * (evict.median if evict else 0.0) / 1e3 / decode_s
        result = {
            "engine": "vase_jax", "method": ev.method, "budget": ev.budget if ev.evicts else None,
            "buffer": ev.buffer if ev.evicts else None, "output_len": n, "capacity": capacity,
            "evictions": int(out.evictions), "evictions_expected": len(triggers),
            "cache_length_end": int(out.cache_length.max()), "cache_length_expected": int(after[-1]),
            "compile_s": compile_s, "total_s": total.as_dict(), "prefill_s": prefill_s.as_dict(),
            "decode_tok_s": _dict(tok_s), "step_ms_start": step_start.as_dict(), "step_ms_end": step_end.as_dict(),
            "evict_ms": _dict(evict), "tok_s_start": b / step_start.median * 1e3,
            "tok_s_end": b / (step_end.median + evict_per_step) * 1e3, "evict_overhead": overhead,
            "cache_bytes": cache_bytes(prefill()[1]), "program_bytes": program_bytes,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "device_peak_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
            # the bound is added in main, after the bandwidth probe
            "roofline": ds.roofline(self.model, ev, reads, len(triggers), b, np.dtype(self.model.dtype).itemsize),
        }
        if tok_s is None:
            print(f"bench.py: warning: {label(result)} n={n}: a run took no longer than the prefill, so no "
                  "decode tokens/s (use longer --output-lens)", file=sys.stderr)
        return result, np.asarray(out.tokens)

    def run_hf(self, hf, n: int, cache_impl: str) -> tuple[dict, np.ndarray]:
        """`transformers` generate on the same (unpadded) prompt, greedy, exactly n new tokens, on `hf`'s
        device (CUDA work is synchronized before each clock stop)."""
        import torch

        device = next(hf.parameters()).device
        ids, mask = (torch.tensor(np.asarray(x), dtype=torch.long, device=device) for x in self.raw)
        extra = {"cache_implementation": "static"} if cache_impl == "static" else {}

        def gen(m: int):
            out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=m, min_new_tokens=m,
                              eos_token_id=None, pad_token_id=0, **extra)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return out

        last = {}

        def call():
            last["out"] = gen(n)

        with torch.inference_mode():
            total = time_runs(call, self.args.repeats, self.args.warmup)
            prefill = time_runs(lambda: gen(1), self.args.repeats, 1)
        tok_s = decode_rate(total, prefill, self.batch * (n - 1))
        result = {"engine": "hf", "cache": cache_impl, "output_len": n, "total_s": total.as_dict(),
                  "prefill_s": prefill.as_dict(), "decode_tok_s": _dict(tok_s), "device": str(device),
                  "attn_implementation": getattr(hf.config, "_attn_implementation", None),
                  "torch_threads": torch.get_num_threads()}
        return result, last["out"][:, ids.shape[1]:].cpu().numpy()


def to_hf(model: vj.Qwen3, torch_dtype=None):
    """A `transformers.Qwen3ForCausalLM` holding `model`'s weights (eval mode), of the same shape."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from vase_jax import weights

    c = model.cfg
    hf = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=c.tie_word_embeddings, max_position_embeddings=c.max_position_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)).eval()
    exported = weights.hf_state_dict(weights.flat_params(model), c)
    hf.load_state_dict({k: torch.from_numpy(np.array(v, np.float32, copy=True)) for k, v in exported.items()},
                       strict=True)
    return hf.to(torch_dtype or torch.float32)


def _dict(stat: Stat | None) -> dict | None:
    return None if stat is None else stat.as_dict()


def _median(stat: dict | None) -> float | None:
    return None if stat is None else stat["median"]


def label(r: dict) -> str:
    return f"hf-{r['cache']}" if r.get("engine") == "hf" else method_label(r["method"], r["budget"])


def _by_label(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in runs:
        out.setdefault(label(r), []).append(r)
    return {k: sorted(v, key=lambda r: r["output_len"]) for k, v in out.items()}


def segments(runs: list[dict], batch: int) -> dict[str, list[dict]]:
    """Marginal decode tokens/s between consecutive output lengths, per (method, budget)."""
    out = {}
    for name, rs in _by_label(runs).items():
        segs = [{"from": 1, "to": rs[0]["output_len"], "tok_s": _median(rs[0]["decode_tok_s"])}]
        for a, c in zip(rs, rs[1:], strict=False):
            dt = c["total_s"]["median"] - a["total_s"]["median"]
            rate = batch * (c["output_len"] - a["output_len"]) / dt if dt > 0 else None
            segs.append({"from": a["output_len"], "to": c["output_len"], "tok_s": rate})
        out[name] = segs
    return out


def summary(runs: list[dict], segs: dict[str, list[dict]], prompt_len: int) -> list[dict]:
    """Per (method, budget): speed against full at the longest output length (measured, and predicted by the
    bytes moved), flatness, cache bytes per output length.

    Flatness: micro-benchmark tokens/s at the last step over the first; marginal tokens/s of the last segment
    over the first, and over the first "steady" segment, which starts after every eviction method of the run has
    filled its cache (output length >= budget + buffer - prompt), where an eviction method's speed must be flat.
    """
    full = {r["output_len"]: r for r in runs if r["method"] == "full"}
    steady = max([r["budget"] + r["buffer"] - prompt_len for r in runs if r["budget"] is not None], default=0)
    out = []
    for name, rs in _by_label(runs).items():
        last = rs[-1]
        row = {"label": name, "output_len": last["output_len"],
               "tok_s_end_over_start": last["tok_s_end"] / last["tok_s_start"],
               "cache_bytes_by_len": {r["output_len"]: r["cache_bytes"] for r in rs}}
        s = segs[name]
        if len(s) > 1 and s[0]["tok_s"] and s[-1]["tok_s"]:
            row["last_over_first_segment"] = s[-1]["tok_s"] / s[0]["tok_s"]
        first_steady = next((x for x in s if x["from"] >= steady), None)
        if first_steady is not None and first_steady is not s[-1] and first_steady["tok_s"] and s[-1]["tok_s"]:
            row["steady_segment"] = [first_steady["from"], first_steady["to"]]
            row["last_over_steady_segment"] = s[-1]["tok_s"] / first_steady["tok_s"]
        f = full.get(last["output_len"])
        if f is not None and last is not f:
            ours, theirs = _median(last["decode_tok_s"]), _median(f["decode_tok_s"])
            row["vs_full"] = ours / theirs if ours and theirs else None
            row["vs_full_bound"] = last["roofline"]["bound_tok_s"] / f["roofline"]["bound_tok_s"]
        out.append(row)
    return out


# ---- outputs -----------------------------------------------------------------------------------------------
def _fmt(stat: dict | None, scale: float = 1.0, spec: str = ".1f") -> str:
    if stat is None:
        return "-"
    return f"{stat['median'] * scale:{spec}} [{stat['min'] * scale:{spec}}-{stat['max'] * scale:{spec}}]"


def markdown(result: dict) -> str:
    meta, bw = result["meta"], result["bandwidth"]
    mib = 2**20
    lines = [
        f"Command: `{meta['command']}`", "",
        f"Machine: {meta['device']}, {meta['cpu_model']}, {meta['cpu_count']} CPUs, jax {meta['jax']}; load average "
        f"(1, 5, 15 min) at start {meta['load_start']}, at end {meta['load_end']}"
        f"{' (WARNING: busy machine)' if meta['load_warning'] else ''}; layer loop {meta['layer_loop']}. "
        f"Model: {meta['model']}, {meta['dtype']}, "
        f"{meta['param_bytes'] / mib:.0f} MiB of weights; batch {meta['batch']}, prompt {meta['prompt_len']} "
        f"tokens (bucket {meta['prompt_bucket']}); {meta['repeats']} timed runs after {meta['warmup']} "
        "warm-up.",
        f"Bandwidth (`timing.bandwidth`): read {bw['read'] / 1e9:.1f} GB/s (the roofline's), in-place copy "
        f"{bw['copy'] / 1e9:.1f} GB/s read + write.",
        "",
        "| method | out len | decode tok/s med [min-max] | tok/s start | tok/s end | step ms start "
        "| step ms end | prefill ms | compile s | evict ms/event | events | evict overhead | cache MiB "
        "| program MiB | bound tok/s | achieved/bound |",
        "|" + "---|" * 16,
    ]
    for r in result["runs"]:
        lines.append(
            f"| {label(r)} | {r['output_len']} | {_fmt(r['decode_tok_s'])} | {r['tok_s_start']:.1f} "
            f"| {r['tok_s_end']:.1f} | {_fmt(r['step_ms_start'], spec='.2f')} "
            f"| {_fmt(r['step_ms_end'], spec='.2f')} | {_fmt(r['prefill_s'], 1e3)} | {r['compile_s']:.1f} "
            f"| {_fmt(r['evict_ms'], spec='.2f')} | {r['evictions']} "
            f"| {num(r['evict_overhead'], '.1f', 100, '%')} | {r['cache_bytes'] / mib:.1f} "
            f"| {num(r['program_bytes'], '.0f', 1 / mib)} | {r['roofline']['bound_tok_s']:.1f} "
            f"| {num(r['roofline']['achieved_over_bound'], '.2f')} |")
    lines += ["", "Marginal decode tokens/s per output-length segment:", ""]
    for name, segs in result["segments"].items():
        lines.append(f"- {name}: " + ", ".join(f"{s['from']}-{s['to']}: {num(s['tok_s'])}" for s in segs))
    lines += ["", "Summary at the longest output length of each method:", ""]
    for s in result["summary"]:
        parts = [f"tok/s end/start {s['tok_s_end_over_start']:.2f}"]
        if "last_over_first_segment" in s:
            parts.append(f"last/first segment {s['last_over_first_segment']:.2f}")
        if "last_over_steady_segment" in s:
            a, c = s["steady_segment"]
            parts.append(f"last segment / segment {a}-{c} {s['last_over_steady_segment']:.2f}")
        if "vs_full" in s:
            parts.append(f"vs full {num(s['vs_full'], '.2f', suffix='x')} (bytes-moved bound "
                         f"{s['vs_full_bound']:.2f}x)")
        cache = ", ".join(f"{n}: {v / mib:.1f}" for n, v in s["cache_bytes_by_len"].items())
        parts.append(f"cache MiB by output length {{{cache}}}")
        lines.append(f"- {s['label']} (n={s['output_len']}): " + "; ".join(parts))
    if result["hf"]:
        lines += ["", "| engine | out len | decode tok/s med [min-max] | total s | prefill ms "
                      "| ours (full) / HF decode tok/s | HF / ours total time | tokens equal to ours |",
                  "|" + "---|" * 8]
        for h in result["hf"]:
            lines.append(
                f"| {label(h)} | {h['output_len']} | {_fmt(h['decode_tok_s'])} "
                f"| {_fmt(h['total_s'], spec='.2f')} "
                f"| {_fmt(h['prefill_s'], 1e3)} | {num(h.get('ratio_decode'), '.2f', suffix='x')} "
                f"| {num(h.get('ratio_total'), '.2f', suffix='x')} "
                f"| {num(h.get('tokens_equal_to_ours'), '.0f', 100, '%')} |")
    lines += ["", "How each figure is obtained:", ""] + [f"- `{k}`: {v}" for k, v in result["how"].items()]
    return "\n".join(lines) + "\n"


def compile_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """--compile-only: one line per configuration, and results.json / results.md under --out."""
    rows = [bench.compile_only(ev, args.output_lens[0]) for ev in configs]
    m = machine(load_start)
    lines = [f"Compile of generate: {model_desc}, {jnp.dtype(bench.model.dtype).name}, batch {args.batch}, prompt "
             f"{args.prompt_len}, {args.output_lens[0]} new tokens, layer loop {bench.target.layer_loop}; device "
             f"{m['device']}, host CPU {m['cpu_model']}, jax {m['jax']}, load {m['load_start'][0]} -> "
             f"{m['load_end'][0]}", "", "| method | budget | capacity | compile s (lower s) | HLO lines | "
             "temporaries MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['budget'] or '-'} | {r['capacity']} | {r['compile_s']:.1f} "
                     f"({r['lower_s']:.1f}) | {r['hlo_lines']} | {num(r['temp_bytes'], '.1f', 2**-20)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_results(args.out, {"meta": m | {"model": model_desc, "layers": bench.model.cfg.num_layers},
                             "compile": rows}, text)
    return 0


# ---- main --------------------------------------------------------------------------------------------------
def write_results(out_dir: str | None, result: dict, text: str) -> None:
    """results.json and results.md in `out_dir` (created), when one is given."""
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "results.json", result)
        (out / "results.md").write_text(text)


# ---- the spread workload: static vs continuous batching ------------------------------------------------------
def spread_caps(samples: int, longest: int, seed: int) -> np.ndarray:
    """Output lengths drawn uniformly from [L/16, L] (integers), one per sample."""
    return np.random.default_rng(seed).integers(max(2, longest // 16), longest + 1, samples).astype(np.int32)


def run_static(model, prompts, keys, caps, rows: int, config, ev) -> dict:
    """Chunks of `rows` samples, one `generate` call each (the last chunk padded with copies of its last sample,
    discarded): tokens, decode steps, eviction events, and the useful share of the row-steps."""
    useful = steps = events = tokens = 0
    for start in range(0, len(prompts), rows):
        idx = list(range(start, min(start + rows, len(prompts))))
        idx += [idx[-1]] * (rows - len(idx))
        ids = np.stack([prompts[i] for i in idx])
        out = vj.generate(model, ids, np.ones_like(ids), key=jnp.stack([keys[i] for i in idx]), config=config,
                          eviction=ev, row_ids=jnp.zeros((rows,), jnp.int32), max_new_tokens=caps[idx])
        n, s, e = jax.device_get((out.num_tokens, out.steps, out.evictions))
        real = len(set(idx))
        tokens += int(n[:real].sum())
        useful += int(n[:real].sum()) - real  # decode steps of real samples (token 0 is the prefill's)
        steps, events = steps + int(s), events + int(e)
    return {"tokens": tokens, "steps": steps, "events": events, "utilization": useful / max(rows * steps, 1)}


def run_continuous(model, prompts, keys, caps, rows: int, config, ev) -> dict:
    from vase_jax import batching

    reqs = [batching.Request(tuple(int(x) for x in p), k, 0, int(c)) for p, k, c in zip(prompts, keys, caps,
                                                                                         strict=True)]
    stats = batching.EngineStats()
    results = batching.run(model, reqs, rows=rows, config=config, eviction=ev, stats=stats)
    return {"tokens": sum(len(r.tokens) for r in results), "steps": stats.steps, "events": stats.events,
            "utilization": stats.utilization, "segments": stats.segments}


def spread_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """Static vs continuous batching on the spread workload, per method: results.json / results.md in --out."""
    model = bench.model
    longest = args.output_lens[0]
    caps = spread_caps(args.spread_samples, longest, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(0, model.cfg.vocab_size, args.prompt_len).astype(np.int32) for _ in caps]
    keys = [jax.random.fold_in(jax.random.key(args.seed), i) for i in range(len(caps))]
    config = vj.GenerateConfig(max_new_tokens=longest, eos_token_ids=(), attention_impl=args.attention_impl,
                               layer_loop=args.layer_loop)
    runs = []
    for ev in configs:
        row = {"engine": "vase_jax", "method": ev.method, "budget": ev.budget if ev.evicts else None}
        schedulers = (("static", run_static), ("continuous", run_continuous))
        k = min(args.batch, len(caps))
        for _, fn in schedulers:  # compile first (untimed), on the first chunk
            fn(model, prompts[:k], keys[:k], caps[:k], args.batch, config, ev)
        seconds: dict[str, list[float]] = {name: [] for name, _ in schedulers}
        for _ in range(args.repeats):  # alternating, so that a change of machine load hits both alike
            for name, fn in schedulers:
                start = time.perf_counter()
                row[name] = fn(model, prompts, keys, caps, args.batch, config, ev)
                seconds[name].append(time.perf_counter() - start)
        for name, _ in schedulers:
            r = row[name]
            r["seconds"] = Stat.of(seconds[name]).as_dict()
            r["tok_s"] = r["tokens"] / r["seconds"]["median"]
            r["events_per_1k_tokens"] = 1e3 * r["events"] / r["tokens"]
        # per repeat, continuous over the static run next to it
        row["speedup_runs"] = [a / b for a, b in zip(seconds["static"], seconds["continuous"], strict=True)]
        row["speedup"] = row["continuous"]["tok_s"] / row["static"]["tok_s"]
        # the speed-up at equal cost per step: what the schedules alone give, whatever the machine's load
        row["step_ratio"] = row["static"]["steps"] / row["continuous"]["steps"]
        runs.append(row)
        s, c = row["static"], row["continuous"]
        print(f"{label(row):>20} static {s['tok_s']:.1f} tok/s (util {s['utilization']:.2f}, {s['events']} events)"
              f" | continuous {c['tok_s']:.1f} tok/s (util {c['utilization']:.2f}, {c['events']} events) | "
              f"{row['speedup']:.2f}x (steps {row['step_ratio']:.2f}x)", flush=True)
    result = {"meta": machine(load_start) | {
        "command": args.command, "model": model_desc, "batch": args.batch, "prompt_len": args.prompt_len,
        "longest": longest, "samples": len(caps), "mean_output": float(caps.mean())}, "spread": runs}
    lines = ["| method | static tok/s | static util | continuous tok/s | continuous util | speed-up | step ratio | "
             "events/1k tok static | continuous |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s, c = r["static"], r["continuous"]
        lines.append(f"| {label(r)} | {s['tok_s']:.1f} | {s['utilization']:.2f} | {c['tok_s']:.1f} | "
                     f"{c['utilization']:.2f} | {r['speedup']:.2f}x | {r['step_ratio']:.2f}x | "
                     f"{s['events_per_1k_tokens']:.2f} | {c['events_per_1k_tokens']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_results(args.out, result, text)
    return 0


# ---- the AIME25 protocol: measured per method, projected whole ---------------------------------------------------
def aime25_markdown(result: dict) -> str:
    """The table of `aime25_report` (one row per method measured so far) and how its figures are obtained."""
    from vase_jax.planner import size

    meta = result["meta"]
    ln = meta["lengths"]
    lines = [f"AIME25 protocol's shape: {meta['model_desc']}, {meta['dtype']}, {meta['samples']} samples, prompts of "
             f"{meta['prompt_len']} tokens, at most {meta['total_tokens']} tokens per sample; output lengths "
             f"log-normal (median {ln['median']}, sigma {ln['sigma']}, seed {ln['seed']}; mean {ln['mean']:.0f}, "
             f"max {ln['max']}, {ln['at_cap']} at the cap, {ln['tokens']} tokens); device {meta['device']}; "
             f"{meta['seconds_per_method']:.0f} s measured per method.", "",
             "| method | rows | step ms | window tok/s | check s (predicted) | steps | utilization | tok/s "
             "| projected wall | peak memory | rows because |", "|" + "---|" * 11]
    for r in result["methods"]:
        if not r["rows"]:
            lines.append(f"| {r['label']} | 0 | - | - | - | - | - | - | - | - | {r['rows_reason']} |")
            continue
        p, c = r["protocol"], r["check"]
        peak = "-" if r["peak_bytes"] is None else f"{size(r['peak_bytes'])} ({r['peak_source'].split()[0]})"
        wall = f"{p['seconds'] / 60:.1f} min" if p["seconds"] >= 120 else f"{p['seconds']:.2f} s"
        lines.append(f"| {r['label']} | {r['rows']} | {p['step_ms']:.2f} | {r['window_tok_s']:.0f} | "
                     f"{c['seconds']:.2f} ({c['predicted_s']:.2f}) | {p['steps']} | {p['utilization']:.2f} | "
                     f"{p['tok_s']:.0f} | {wall} | {peak} | {r['rows_reason']} |")
    lines += ["", f"Projection: {meta['formula']}; slot_reads counted as the attention bounds a row here: "
              f"{meta['attention_reads']!r} ('own': each row up to its own length, the Pallas kernels; 'longest': "
              "every row up to the longest row's, the XLA path).", "",
              "Per method: the fitted seconds (round_s, step_s, slot_s, event_s), compile and plan seconds, and "
              "whether the simulated schedules equal the engine's:", ""]
    for r in result["methods"]:
        if r["rows"]:
            m = r["model"]
            lines.append(f"- {r['label']}: round {m['round_s'] * 1e3:.1f} ms, step {m['step_s'] * 1e3:.3f} ms, "
                         f"slot {m['slot_s'] * 1e9:.3f} ns, event {m['event_s'] * 1e3:.3f} ms; compile "
                         f"{r['compile_s']:.1f} s, plan {r['plan_s']:.1f} s; {len(r['windows'])} windows up to "
                         f"{r['windows'][-1]['length']} tokens"
                         f"{'' if r['steady'] else ' (none reached an eviction: event cost not measured)'}; "
                         f"schedules match the engine: {r['schedules_match_engine']}")
    lines += ["", "How each figure is obtained:", ""] + [f"- `{k}`: {v}" for k, v in AIME25_HOW.items()]
    return "\n".join(lines) + "\n"


AIME25_HOW = {
    "rows": "--batch, or planner.largest_batch on the device (its compiler, its allocator limit or --device-gb, less "
    "--headroom), at most the samples: the reason is in the last column",
    "step ms": "(T - rounds * round_s) / steps of the projected protocol: the mean decode step",
    "window tok/s": "rows * L / seconds of the longest lockstep window (rows samples of L tokens, one round)",
    "check s": "a continuous run of min(samples, 3 * rows) drawn samples, lengths scaled to the time left, "
    "measured (and predicted by the fitted model)",
    "steps, utilization": "the engine's schedule of the drawn lengths, simulated (workload.simulate_engine): decode "
    "steps, and the samples' decode row-steps / (rows * steps)",
    "tok/s, projected wall": "tokens / T and T, T from the projection's formula (results.json also holds T with "
    "slot_reads counted the other way: protocol.seconds_if_own / seconds_if_longest)",
    "peak memory": "the device's memory_stats() peak_bytes_in_use after the method (the process's peak so far), "
    "else the plan's total (planner.EnginePlan)",
}


def aime25_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """--workload aime25: `workload.aime25_workload`, writing results.json / results.md under --out after each
    method."""
    shape = wl.AIME25 if args.scale == "protocol" else wl.AIME25_TINY
    result = {"meta": {}, "methods": []}

    def write(so_far: dict):
        result.update(meta=so_far["meta"] | result["meta"], methods=so_far["methods"])
        write_results(args.out, result, aime25_markdown(result))

    kwargs = dict(seconds_per_method=args.seconds, batch=args.batch, samples=args.samples,
                  prompt_len=args.prompt_len, total_tokens=shape["total_tokens"], median=shape["median"],
                  sigma=shape["sigma"], seed=args.seed, headroom=args.headroom,
                  device_bytes=None if args.device_gb is None else int(args.device_gb * 1e9), queue=args.queue,
                  attention_impl=args.attention_impl, layer_loop=args.layer_loop, deadline=args.deadline)
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    result["meta"] = machine(load_start) | {
        "command": args.command, "model_desc": model_desc, "allocator_limit_bytes": (stats or {}).get("bytes_limit"),
        "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")}
    try:
        out = wl.aime25_workload(bench.model, configs, on_method=write, log=lambda m: print(m, flush=True), **kwargs)
    except ValueError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    result.update(meta=out["meta"] | result["meta"] | machine(load_start), methods=out["methods"])
    text = aime25_markdown(result)
    print(text)
    write_results(args.out, result, text)
    return 0


def kv_settings(text: str) -> list[str]:
    """--kv-bits as canonical `KVBits` names, bf16 first (ValueError naming the flag)."""
    names = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        try:
            names.append(KVBits.parse(item).validate().name)
        except ValueError as e:
            raise ValueError(f"--kv-bits: {e}") from None
    return list(dict.fromkeys(["K16V16", *names]))


def kv_variants(bench: Bench, ev: EvictionConfig, n: int) -> list[tuple[str, int | None, vj.GenerateConfig]]:
    """(setting, 16-bit slots P or None, config) per --kv-bits setting: the default protection, and P = 0 where
    that protects slots."""
    out = []
    for name in bench.args.kv_bits:
        kv, config = KVBits.parse(name), bench.generate_config(n)
        if not kv.quantizes:
            out.append((name, None, config))
            continue
        config = dataclasses.replace(config, key_bits=kv.key_bits, value_bits=kv.value_bits, kv_group=kv.key_group,
                                     kv_refine=kv.refine)
        protected = generate_tiers(bench.model.cfg, config, ev, bench.bucket).protected
        out.append((name, protected, config))
        if protected:
            out.append((name, 0, dataclasses.replace(config, kv_protected=0)))
    return out


def kv_rows(bench: Bench, ev: EvictionConfig, n: int) -> list[dict]:
    """One row per `kv_variants` entry: bytes of a cached token, of the cache and of the program's peak, decode
    tokens/s as `decode_tok_s` (the settings' runs interleaved, `--repeats` rounds: drift hits every setting
    alike) and the share of tokens equal to the 16-bit cache's."""
    cfg, itemsize, entries = bench.model.cfg, jnp.dtype(bench.model.dtype).itemsize, []
    for name, protected, config in kv_variants(bench, ev, n):
        call, compile_s, program_bytes = bench.program(config, ev)
        capacity = (generate_tiers(cfg, config, ev, bench.bucket) if KVBits.parse(name).quantizes else
                    framework.capacity_for(ev, bench.bucket, n))
        prefill = bench.prefill(capacity, ev)
        jax.block_until_ready((call(), prefill()))  # warm-up
        entries.append(dict(call=call, prefill=prefill, totals=[], prefills=[], row={
            "method": ev.method, "budget": ev.budget if ev.evicts else None, "kv_bits": name, "protected": protected,
            "output_len": n, "slots": getattr(capacity, "virtual_slots", capacity), "compile_s": compile_s,
            "token_bytes": token_bytes(cfg.head_dim, config.kv_bits_for(cfg.head_dim), itemsize),
            "cache_bytes": cache_bytes(jax.eval_shape(prefill)[1]), "program_bytes": program_bytes}))
    for _ in range(bench.args.repeats):
        for e in entries:
            e["totals"].append(time_runs(e["call"], 1).median)
            e["prefills"].append(time_runs(e["prefill"], 1).median)
    rows, reference = [], None
    for e in entries:
        tokens = np.asarray(e["call"]().tokens)
        reference = tokens if reference is None else reference
        rate = decode_rate(Stat.of(e["totals"]), Stat.of(e["prefills"]), bench.batch * (n - 1))
        r = e["row"] | {"total_s": float(np.median(e["totals"])), "prefill_s": float(np.median(e["prefills"])),
                        "decode_tok_s": None if rate is None else rate.median,
                        "tokens_agree_with_bf16": float((tokens == reference).mean())}
        rows.append(r)
        print(f"{label(r):>16} {r['kv_bits']:>7} P={num(r['protected'], '.0f'):<5} "
              f"{r['token_bytes']:4d} B/token, cache {r['cache_bytes'] / 2**20:8.2f} MiB, program "
              f"{num(r['program_bytes'], '.1f', 2**-20, ' MiB')}, decode {num(r['decode_tok_s'])} tok/s, "
              f"agree {100 * r['tokens_agree_with_bf16']:.0f}%", flush=True)
    return rows


def kv_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """--kv-bits: `kv_rows` per method and budget at the first --output-lens, results.json / results.md."""
    rows = []
    for ev in configs:
        rows += kv_rows(bench, ev, args.output_lens[0])
        release_programs_near_mapping_limit()
    result = {"meta": machine(load_start) | {
        "command": args.command, "model": model_desc, "dtype": jnp.dtype(bench.model.dtype).name,
        "batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_lens[0],
        "repeats": args.repeats, "attention_impl": args.attention_impl}, "kv": rows}
    text = kv_markdown(result)
    print(text)
    write_results(args.out, result, text)
    return 0


def kv_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Mixed-precision KV cache: {m['model']}, {m['dtype']}", "",
             f"batch {m['batch']}, prompt {m['prompt_len']}, {m['output_len']} new tokens (greedy), "
             f"{m['repeats']} interleaved runs per setting (medians); {m['device']}, host {m['cpu_model']}, load "
             f"{m['load_start'][0]} -> {m['load_end'][0]}."
             + (f" **{m['load_warning']}**" if m["load_warning"] else ""),
             "", "| method | cache | 16-bit slots P | bytes/token (K+V, one kv head) | cache MiB | x bf16 "
             "| program MiB | decode tok/s | x bf16 | tokens = bf16 |", "|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for r in result["kv"]:
        key = (r["method"], r["budget"])
        if r["kv_bits"] == "K16V16":
            base[key] = r
        b = base.get(key, r)
        ratio = (r["decode_tok_s"] / b["decode_tok_s"]) if r["decode_tok_s"] and b["decode_tok_s"] else None
        lines.append(f"| {label(r)} | {r['kv_bits']} | {num(r['protected'], '.0f')} | {r['token_bytes']} | "
                     f"{r['cache_bytes'] / 2**20:.2f} | {r['cache_bytes'] / b['cache_bytes']:.3f} | "
                     f"{num(r['program_bytes'], '.1f', 2**-20)} | {num(r['decode_tok_s'])} | "
                     f"{num(ratio, '.2f', suffix='x')} | {100 * r['tokens_agree_with_bf16']:.0f}% |")
    return "\n".join(lines) + "\n"


def decode_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """The default mode: `Bench.run` per method, budget and output length (and HF's generate with --compare-hf),
    the bandwidth roofline, segments and summary; results.json / results.md under --out."""
    model = bench.model
    print(f"model {model_desc}: {ds.param_bytes(model) / 2**20:.0f} MiB of weights", flush=True)
    runs, hf_runs, full_tokens = [], [], {}
    for ev in configs:
        for n in args.output_lens:
            r, tokens = bench.run(ev, n)
            release_programs_near_mapping_limit()  # XLA:CPU crashes at the process's mapping limit
            runs.append(r)
            if ev.method == "full":
                full_tokens[n] = (r, tokens)
            print(f"{label(r):>20} n={n:<6} decode {_fmt(r['decode_tok_s'])} tok/s; micro start "
                  f"{r['tok_s_start']:.1f} end {r['tok_s_end']:.1f}; {r['evictions']} evictions, overhead "
                  f"{num(r['evict_overhead'], '.1f', 100, '%')}; cache {r['cache_bytes'] / 2**20:.1f} MiB",
                  flush=True)
    if args.compare_hf:
        import torch

        hf = to_hf(model, getattr(torch, jnp.dtype(model.dtype).name))
        if jax.default_backend() == "gpu" and torch.cuda.is_available():
            hf = hf.to("cuda")
        for n in args.output_lens:
            for impl in args.hf_caches:
                h, tokens = bench.run_hf(hf, n, impl)
                if n in full_tokens:
                    ours, ours_tokens = full_tokens[n]
                    h["tokens_equal_to_ours"] = float((tokens == ours_tokens).mean())
                    a, c = _median(ours["decode_tok_s"]), _median(h["decode_tok_s"])
                    h["ratio_decode"] = a / c if a and c else None
                    h["ratio_total"] = h["total_s"]["median"] / ours["total_s"]["median"]
                hf_runs.append(h)
                print(f"{label(h):>20} n={n:<6} decode {_fmt(h['decode_tok_s'])} tok/s; ours / HF "
                      f"{num(h.get('ratio_decode'), '.2f', suffix='x')}", flush=True)

    bw = bandwidth(args.bandwidth_mib << 20, args.repeats)  # last, so that its arrays are not in the runs' peak RSS
    for r in runs:
        roof = r["roofline"]
        roof["bound_tok_s"] = args.batch * bw["read"] / roof["bytes_step_mean"]
        tok_s = _median(r["decode_tok_s"])
        roof["achieved_over_bound"] = None if tok_s is None else tok_s / roof["bound_tok_s"]
    segs = segments(runs, args.batch)
    meta = machine(load_start) | {
        "command": args.command, "model": model_desc, "config": dataclasses.asdict(model.cfg),
        "dtype": jnp.dtype(model.dtype).name, "param_bytes": ds.param_bytes(model), "batch": args.batch,
        "prompt_len": args.prompt_len, "prompt_bucket": bench.bucket, "repeats": args.repeats, "warmup": args.warmup,
        "micro_steps": args.micro_steps, "attention_impl": args.attention_impl,
        "layer_loop": bench.target.layer_loop}
    result = {"meta": meta, "bandwidth": bw, "how": HOW, "runs": runs, "hf": hf_runs, "segments": segs,
              "summary": summary(runs, segs, args.prompt_len)}
    text = markdown(result)
    print(text)
    write_results(args.out, result, text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.command = " ".join(["python", "-m", "benchmarks.bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        configs = check_args(args)
        if args.workload == "aime25":  # the batch fills the device: let JAX's allocator have most of it
            os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
            from vase_jax.planner import device_memory

            if (not isinstance(args.batch, int) and args.device_gb is None and
                    device_memory(jax.devices()[0]) is None):
                raise ValueError(f"--workload aime25: the {jax.devices()[0].platform} device reports no memory size "
                                 "to fit the batch to: give --batch or --device-gb")
        dtype = getattr(jnp, args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
        if args.compare_hf:
            import torch  # noqa: F401
            import transformers  # noqa: F401
        model, model_desc = load_model(args, dtype)
        configs = with_calibration(configs, model, args)
    except (ValueError, ImportError) as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2

    if not (args.no_compile_cache or args.compile_only):  # compile_s is then a compile or a cache load
        enable_compilation_cache(args.compile_cache)
    load_start = os.getloadavg()
    warning = load_warning(load_start[0])
    if warning:
        print(f"bench.py: warning: {warning}", file=sys.stderr, flush=True)
    bench = Bench(args, model)
    print(f"device {device_desc()}, load {load_start[0]:.2f}; layer loop {bench.target.layer_loop}", flush=True)
    report = (compile_report if args.compile_only else spread_report if args.spread_samples else
              aime25_report if args.workload == "aime25" else kv_report if args.kv_bits else decode_report)
    return report(args, bench, model_desc, configs, load_start)


if __name__ == "__main__":
    sys.exit(main())
