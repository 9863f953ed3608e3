"""Decode speed, memory and cost of `vase_jax.generate` per eviction method, budget and output length, with a
memory-bandwidth roofline; and its workloads. One mode per run (default: decode):

    python -m benchmarks.bench --model tiny-1k --output-lens 64 --methods full,vase_dkv --budgets 32 --buffer 8
    python -m benchmarks.bench --model small --batch 2 --output-lens 2048,8192 --budgets 1024 --out bench_long
    python -m benchmarks.bench --compile-only ...           # compile seconds and temporaries of generate, no runs
    python -m benchmarks.bench --kv-bits K8V8,K4V4 ...     # the mixed-precision cache against the 16-bit one
    python -m benchmarks.bench --spread-samples 480 ...    # continuous against static batching
    python -m benchmarks.bench --workload aime25 --seconds 120 --out bench_aime25      # Qwen3-14B's shape, on a GPU
    python -m benchmarks.bench --workload aime25 --scale tiny --out bench_aime25_tiny  # the same code path, on a CPU

--workload aime25 measures each method for --seconds on the engine and projects the AIME25 protocol
(`benchmarks.workload.aime25_workload` says how), at the largest batch that fits the device unless --batch N (or
--batch vase_dkv@2048=N1,full=N2) is given; --scale tiny is its CPU-sized copy (tiny-1k, 24 samples, 6 rows).

`--model` is a hub id, a local HF folder, or a named random model (`vase_jax.random_model.named_configs`), shrunk
with `--layers`, `--vocab`, `--hidden`, `--intermediate`. Every generation is greedy and fixed-length (no end
token). How each figure is obtained: docs/BENCHMARKS.md, "How the figures are obtained".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import resource
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import vase_jax as vj
from benchmarks import decode_step as ds
from benchmarks import workload as wl
from benchmarks.report import ints, method_label, num, spread, table, write_results
from benchmarks.timing import Stat, bandwidth, decode_rate, device_desc, load_warning, machine, time_runs
from vase_jax import batching, planner
from vase_jax.cache import cache_bytes
from vase_jax.eviction import METHODS, EvictionConfig, framework
from vase_jax.generate import LAYER_LOOPS, MIN_PREFILL_CHUNK, generate_target, generate_tiers, query_window
from vase_jax.jit import enable_compilation_cache, release_programs_near_mapping_limit
from vase_jax.kvquant import KVBits, token_bytes
from vase_jax.random_model import named_configs, shrink

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
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", default=None, help="hub id, local HF folder, or named random model (default qwen3-0.6b; "
      "aime25: qwen3-14b, tiny)")
    for name in ("layers", "vocab", "hidden", "intermediate"):
        a(f"--{name}", type=int, default=None, help=f"named random models: {name} (heads unchanged)")
    a("--layer-loop", default="auto", choices=LAYER_LOOPS, help="GenerateConfig.layer_loop")
    a("--dtype", choices=("float32", "bfloat16"), default=None, help="default: float32 (CPU), bfloat16 (GPU)")
    a("--batch", type=_batch, default=None, help="rows (default 4); --workload aime25: the largest that fits per "
      "method (default), N for every method, or LABEL=N,... (e.g. vase_dkv@2048=187,full=19; the others fit)")
    a("--prompt-len", type=int, default=None, help="random prompt tokens per row (default 128; aime25: 256)")
    a("--output-lens", type=ints, default=[1024], help="comma list: new tokens per row")
    a("--methods", default=None, help="comma list of full and vase_jax.eviction.METHODS (default "
      "full,vase_attnv,vase_dkv; aime25: vase_dkv,vase_attnv,full), 'paper' (full + the five) or 'all'")
    a("--calibration", default=None, help="triattention's statistics file (default: the model folder's; random "
      "numbers of the model's shape for a named random model)")
    a("--budgets", type=ints, default=None, help="comma list of budgets N (default 512, aime25: 2048)")
    a("--buffer", type=int, default=None, help="buffer B, the eviction period (default 64)")
    a("--attention-impl", default="auto", choices=("auto", "xla", "pallas"))
    a("--prefill-chunk", type=int, default=vj.GenerateConfig.prefill_chunk, help="GenerateConfig.prefill_chunk: "
      "prompt tokens per prefill chunk past that many (default 256); 0: the dense prefill")
    a("--no-batch-invariant", action="store_true", help="GenerateConfig.batch_invariant=False: a batch smaller "
      "than the machine's invariant rows is not padded (the invariance's cost, against the default)")
    a("--repeats", type=int, default=3, help="timed runs per figure (>= 3)")
    a("--warmup", type=int, default=1, help="untimed runs after compiling, before the timed ones")
    a("--micro-steps", type=int, default=8, help="decode steps per micro-benchmark call")
    a("--bandwidth-mib", type=int, default=512, help="array size of the bandwidth measurement")
    a("--micro", action="store_true", help="the decode mode without generate runs: per output length (longest "
      "first) and method, a step at the run's last length and an eviction event timed alone, written as they come; "
      "rows past --deadline skipped; with --kv-bits, full's step on each mixed-precision cache too")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--compile-only", action="store_true", help="only compile generate per method and budget (the "
                      "first --output-lens): compile seconds, HLO lines, temporaries")
    mode.add_argument("--spread-samples", type=int, default=0, help="this many samples of output lengths uniform "
                      "over [L/16, L] (L: the first --output-lens) on --batch rows, static (generate per chunk) "
                      "against continuous (vase_jax.batching), alternating --repeats times")
    mode.add_argument("--kv-bits", default=None, help="comma list of mixed-precision settings (bf16, K8V8, K4V4, "
                      "K<bits>V<bits>g<group>) at the first --output-lens, default protection and P = 0: bytes, "
                      "the program's peak, decode tokens/s, tokens equal to bf16's")
    mode.add_argument("--workload", choices=("aime25",), default=None, help="the AIME25 protocol's shape, measured "
                      "per method for --seconds and projected")
    a("--scale", choices=("protocol", "tiny"), default="protocol", help="aime25: the protocol or its CPU copy")
    a("--seconds", type=float, default=120.0, help="aime25: measuring seconds per method (plan, compile on top)")
    a("--deadline", type=float, default=None, help="aime25, --micro: a time (seconds since the epoch) by which "
      "the measuring ends")
    a("--samples", type=int, default=None, help="aime25: samples (default 480; tiny 24)")
    a("--device-gb", type=float, default=None, help="aime25: device memory in GB the batch must fit (default: the "
      "device's allocator limit; a CPU has none: give it or --batch)")
    a("--headroom", type=float, default=0.05, help="aime25: share of the memory left free")
    a("--queue", type=int, default=None, help="aime25: samples prefilled per round (default: as batching.run)")
    a("--seed", type=int, default=0)
    a("--out", default=None, help="folder for results.json and results.md")
    a("--compile-cache", metavar="DIR", help="JAX's persistent compilation cache (default "
      "$VASE_JAX_COMPILATION_CACHE or ~/.cache/vase-jax/xla); off with --compile-only, whose figures are compiles")
    a("--no-compile-cache", action="store_true", help="compile every program anew")
    return p.parse_args(argv)


def _at_least(args, low, *names: str) -> None:
    """ValueError naming the first flag among `names` whose int value is below `low` (None: not given)."""
    for name in names:
        value = getattr(args, name)
        if isinstance(value, int) and value < low:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be >= {low}")


def check_args(args: argparse.Namespace) -> list[EvictionConfig]:
    """Every check that needs no model (ValueError naming the parameter); returns the configurations."""
    aime = WORKLOADS.get(args.workload)
    if aime is not None:
        for name, value in aime[args.scale].items():
            if getattr(args, name) is None and not (name == "batch" and args.device_gb is not None):
                setattr(args, name, value)
        total = (wl.AIME25 if args.scale == "protocol" else wl.AIME25_TINY)["total_tokens"]
        if args.prompt_len + 2 > total:
            raise ValueError(f"--prompt-len={args.prompt_len}: a sample holds at most {total} tokens, prompt included")
        if not args.seconds > 0:
            raise ValueError(f"--seconds={args.seconds} must be > 0")
        if not 0 <= args.headroom < 1:
            raise ValueError(f"--headroom={args.headroom} must be in [0, 1)")
        if args.device_gb is not None and args.device_gb <= 0:
            raise ValueError(f"--device-gb={args.device_gb} must be > 0")
    elif args.scale != "protocol":
        raise ValueError("--scale applies to --workload aime25")
    if args.micro and (args.compile_only or args.spread_samples or aime):
        raise ValueError("--micro is the decode mode's: drop --compile-only, --spread-samples and --workload")
    if args.kv_bits is not None:
        args.kv_bits = kv_settings(args.kv_bits)
    defaults = {"model": DEFAULT_MODEL, "prompt_len": 128, "methods": "full,vase_attnv,vase_dkv", "budgets": [512],
                "buffer": 64} | ({} if aime else {"batch": 4})
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if isinstance(args.batch, dict):
        if not aime:
            raise ValueError(f"--batch={args.batch}: rows per method apply to --workload aime25; give one int")
        if min(args.batch.values()) < 1:
            raise ValueError(f"--batch={args.batch}: rows must be >= 1")
    _at_least(args, 0, "spread_samples", "warmup")
    _at_least(args, 1, "batch", "prompt_len", "micro_steps", "bandwidth_mib", "samples", "queue")
    _at_least(args, 3, "repeats")
    if args.prefill_chunk and args.prefill_chunk < MIN_PREFILL_CHUNK:
        raise ValueError(f"--prefill-chunk={args.prefill_chunk}: 0 (the dense prefill) or at least "
                         f"{MIN_PREFILL_CHUNK}")
    if min(args.output_lens, default=0) < 2:
        raise ValueError(f"--output-lens={args.output_lens}: each must be >= 2 (a prefill token and a decode step)")
    args.output_lens = sorted(set(args.output_lens))
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    names = {"paper": list(PAPER_METHODS), "all": ["full", *sorted(METHODS)]}.get(",".join(names), names)
    unknown = [m for m in names if m not in METHODS and m != "full"]
    if unknown or not names:
        raise ValueError(f"--methods: unknown {unknown or names}; known: full, {', '.join(sorted(METHODS))}")
    configs = []
    for m in dict.fromkeys(names):
        if m == "full":
            configs.append(EvictionConfig("full").validate())
        elif not args.budgets:
            raise ValueError(f"--budgets is empty but method {m!r} needs a budget")
        else:  # a method that takes a calibration is validated with the model (`with_calibration`)
            calibrated = "calibration" in METHODS[m].option_names
            configs += [EvictionConfig(m, budget=n, buffer=args.buffer,
                                       **({"calibration": args.calibration} if calibrated else {}))
                        for n in args.budgets]
    if args.calibration is not None and not any(ev.evicts and "calibration" in ev.policy.option_names
                                                for ev in configs):
        raise ValueError("--calibration is for --methods triattention")
    configs = [ev if ev.evicts and "calibration" in ev.policy.option_names else ev.validate() for ev in configs]
    if isinstance(args.batch, dict):
        labels = [label(ev) for ev in configs]
        unknown = sorted(set(args.batch) - set(labels))
        if unknown:
            raise ValueError(f"--batch: {', '.join(unknown)} not among the methods ({', '.join(labels)})")
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
        self.itemsize = jnp.dtype(self.model.dtype).itemsize

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def bucket(self) -> int:
        return self.ids.shape[1]

    def generate_config(self, n: int) -> vj.GenerateConfig:
        return vj.GenerateConfig(max_new_tokens=n, temperature=0.0, eos_token_ids=(), pad_token_id=0,
                                 layer_loop=self.args.layer_loop, attention_impl=self.args.attention_impl,
                                 prefill_chunk=self.args.prefill_chunk or None,
                                 batch_invariant=not self.args.no_batch_invariant)

    def program(self, config: vj.GenerateConfig, ev: EvictionConfig) -> tuple[functools.partial, object, dict]:
        """`generate` compiled as it compiles itself, called on the unpadded prompt: (the call, the compiled
        program, {lower_s, compile_s (lowering included), program_bytes: arguments + outputs + temporaries - aliased
        (`memory_analysis`, the program's peak), temp_bytes})."""
        graphdef = self.graphdef

        def generate(state, ids, mask, key):
            return vj.generate(nnx.merge(graphdef, state), ids, mask, key=key, config=config, eviction=ev)

        start = time.perf_counter()
        lowered = jax.jit(generate, compiler_options=self.target.compiler_options()).lower(self.state, *self.raw,
                                                                                            self.key)
        lower_s = time.perf_counter() - start
        compiled = lowered.compile()
        mem = compiled.memory_analysis()
        info = {"lower_s": lower_s, "compile_s": time.perf_counter() - start, "program_bytes": None if mem is None
                else (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                      - mem.alias_size_in_bytes), "temp_bytes": None if mem is None else mem.temp_size_in_bytes}
        return functools.partial(compiled, self.state, *self.raw, self.key), compiled, info

    def prefill(self, capacity, ev: EvictionConfig) -> functools.partial:
        """A jitted copy of generate's prefill (prompt forward, a cache of `capacity`: slots or a tier layout)."""
        return functools.partial(ds.prefill, self.graphdef, self.state, self.ids, self.mask, capacity,
                                 query_window(ev), self.args.attention_impl, framework.slot_state(ev), self.target,
                                 self.args.prefill_chunk or None)

    def step_ms(self, capacity: int, window: int, length: int, state: tuple = ()) -> Stat:
        """Per-step milliseconds of `decode_steps` from `length` live slots (memoized); `state`: the policy's
        per-slot state arrays (their update is part of the step)."""
        key = ("step", capacity, window, length, state)
        if key not in self.memo:
            cache = ds.filled_cache(self.model.cfg, self.batch, capacity, length, window, self.model.dtype,
                                    self.args.seed, state, self.target)
            self.memo[key] = ds.step_ms(self.graphdef, self.state, cache, jnp.int32(length), self.args.micro_steps,
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

    def live(self, capacity: int, length: int) -> int:
        """`length` live slots, as many as a micro-benchmark call (which appends --micro-steps) can start from."""
        return max(1, min(length, capacity - self.args.micro_steps))

    def micro(self, ev: EvictionConfig, n: int) -> dict:
        """The figures of one (method, budget, output length) that time pieces of `generate` alone: a decode step on
        a cache filled to the run's first and last length (`step_ms_start`: only in the default mode), one
        eviction event, tokens/s of those steps (the end's with the eviction amortized over B steps) and the
        bytes a step reads (`decode_step.roofline` over the run's replayed schedule)."""
        b, micro_mode = self.batch, self.args.micro
        capacity, window, state = framework.capacity_for(ev, self.bucket, n), query_window(ev), framework.slot_state(ev)
        reads, after, triggers = ds.row_replay(ev, self.args.prompt_len, n - 1)
        live = self.live(capacity, int(reads[-1]) - 1)
        end = self.step_ms(capacity, window, live, state)
        evict = self.evict_ms(ev, capacity) if ev.evicts else None
        evict_ms = evict.median if evict else 0.0
        r = {"method": ev.method, "budget": ev.budget if ev.evicts else None, "buffer": ev.buffer if ev.evicts
             else None, "output_len": n, "capacity": capacity, "live_slots_end": live, "step_ms_end": end.as_dict(),
             "evict_ms": evict and evict.as_dict(), "tok_s_end": b / (end.median + evict_ms / ev.buffer) * 1e3,
             "eviction_share": evict_ms / (ev.buffer * end.median) if evict else None,
             "evictions_expected": len(triggers), "cache_length_expected": int(after[-1]),
             # the bounds are added after the bandwidth probe
             "roofline": ds.roofline(self.model, ev, reads, len(triggers), b, self.itemsize)}
        if not micro_mode:
            start = self.step_ms(capacity, window, self.live(capacity, self.args.prompt_len), state)
            r |= {"step_ms_start": start.as_dict(), "tok_s_start": b / start.median * 1e3}
        for name in self.args.kv_bits or () if micro_mode and not ev.evicts else ():  # K16V16 is the row itself
            if KVBits.parse(name).quantizes:
                r.setdefault("kv", []).append(self.tiered_step(name, n, live, end.median))
        return r

    def tiered_step(self, name: str, n: int, live: int, bf16_step_ms: float) -> dict:
        """`full`'s decode step from `live` tokens on a mixed-precision cache of setting `name` (its default
        protection), against the 16-bit cache's step; the bytes it reads: the weights, the 16-bit slots and the
        quantized ones at their bits."""
        cfg, kv = self.model.cfg, KVBits.parse(name)
        config = dataclasses.replace(self.generate_config(n), key_bits=kv.key_bits, value_bits=kv.value_bits,
                                     kv_group=kv.key_group)
        layout = generate_tiers(cfg, config, EvictionConfig("full", buffer=self.args.buffer), self.bucket)
        cache = ds.filled_tiered_cache(cfg, self.batch, layout, live, 0, self.model.dtype, target=self.target)
        ms = ds.step_ms(self.graphdef, self.state, cache, None, self.args.micro_steps, self.args.repeats,
                        self.args.attention_impl, self.target).median
        n16, per_slot = min(live, layout.protected + layout.buffer), ds.slot_bytes(cfg, self.batch, self.itemsize)
        quantized = per_slot * token_bytes(cfg.head_dim, config.kv_bits_for(cfg.head_dim), self.itemsize) / (
            token_bytes(cfg.head_dim, KVBits(), self.itemsize))
        return {"kv_bits": name, "protected": layout.protected, "quantized_slots": live - n16, "step_ms": ms,
                "x_bf16_step": ms / bf16_step_ms, "tok_s": self.batch / ms * 1e3, "bytes_per_step":
                ds.weight_bytes_per_step(self.model) + n16 * per_slot + (live - n16) * quantized}

    def run(self, ev: EvictionConfig, n: int) -> tuple[dict, np.ndarray]:
        """Every figure of one (method, budget, output length): `generate` compiled and timed, its prefill timed
        alone, and `micro`'s; also returns the generated tokens."""
        args, b = self.args, self.batch
        call, _, info = self.program(self.generate_config(n), ev)
        last = {}

        def timed():
            last["out"] = call()
            return last["out"]

        total = time_runs(timed, args.repeats, args.warmup)
        out = last.pop("out")
        prefill = self.prefill(framework.capacity_for(ev, self.bucket, n), ev)
        prefill_s = time_runs(prefill, args.repeats, 1)
        tok_s = decode_rate(total, prefill_s, b * (n - 1))
        r = self.micro(ev, n)
        decode_s = total.median - prefill_s.median
        r |= {"evictions": int(out.evictions), "cache_length_end": int(out.cache_length.max()),
              "compile_s": info["compile_s"], "program_bytes": info["program_bytes"], "total_s": total.as_dict(),
              "prefill_s": prefill_s.as_dict(), "decode_tok_s": tok_s and tok_s.as_dict(),
              "evict_overhead": None if decode_s <= 0 else
              r["evictions_expected"] * (r["evict_ms"] or {"median": 0.0})["median"] / 1e3 / decode_s,
              "cache_bytes": cache_bytes(prefill()[1]),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "device_peak_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")}
        if tok_s is None:
            print(f"bench.py: warning: {label(r)} n={n}: a run took no longer than the prefill, so no decode "
                  "tokens/s (use longer --output-lens)", file=sys.stderr)
        return r, np.asarray(out.tokens)


def label(r: dict | EvictionConfig) -> str:
    """A row's or a configuration's method label: "full", "vase_dkv@2048"."""
    if isinstance(r, EvictionConfig):
        return method_label(r.method, r.evicts and r.budget)
    return method_label(r["method"], r["budget"])


def segments(runs: list[dict], batch: int) -> dict[str, list[dict]]:
    """Marginal decode tokens/s between consecutive output lengths, per (method, budget): batch * delta(length)
    / delta(median total seconds); the first segment is the shortest run's decode tokens/s."""
    by_label: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: r["output_len"]):
        by_label.setdefault(label(r), []).append(r)
    out = {}
    for name, rs in by_label.items():
        segs = [{"from": 1, "to": rs[0]["output_len"], "tok_s": (rs[0]["decode_tok_s"] or {}).get("median")}]
        for a, c in itertools.pairwise(rs):
            dt = c["total_s"]["median"] - a["total_s"]["median"]
            segs.append({"from": a["output_len"], "to": c["output_len"],
                         "tok_s": batch * (c["output_len"] - a["output_len"]) / dt if dt > 0 else None})
        out[name] = segs
    return out


# ---- the modes: each writes results.json and results.md under --out -----------------------------------------
def header(meta: dict, model_desc: str, extra: str = "") -> str:
    """The line every mode's table starts with: the command, the machine and the load, the model."""
    return (f"Command: `{meta['command']}`\n\nMachine: {meta['device']}, {meta['cpu_model']}, "
            f"{meta['cpu_count']} CPUs, jax {meta['jax']}; load average (1, 5, 15 min) at start "
            f"{meta['load_start']}, at end {meta['load_end']}"
            + (f" (**{meta['load_warning']}**)" if meta["load_warning"] else "") + f". Model: {model_desc}. {extra}")


DECODE_COLUMNS = {
    "method": label, "out len": lambda r: r["output_len"], "decode tok/s med [min-max]": lambda r:
    spread(r["decode_tok_s"]), "tok/s start": lambda r: f"{r['tok_s_start']:.1f}", "tok/s end": lambda r:
    f"{r['tok_s_end']:.1f}", "step ms start": lambda r: spread(r["step_ms_start"], spec=".2f"), "step ms end":
    lambda r: spread(r["step_ms_end"], spec=".2f"), "prefill ms": lambda r: spread(r["prefill_s"], 1e3),
    "compile s": lambda r: f"{r['compile_s']:.1f}", "evict ms/event": lambda r: spread(r["evict_ms"], spec=".2f"),
    "events": lambda r: r["evictions"], "evict overhead": lambda r: num(r["evict_overhead"], ".1f", 100, "%"),
    "cache MiB": lambda r: f"{r['cache_bytes'] / 2**20:.1f}", "program MiB": lambda r:
    num(r["program_bytes"], ".0f", 2**-20), "bound tok/s": lambda r: f"{r['roofline']['bound_tok_s']:.1f}",
    "achieved/bound": lambda r: num(r["roofline"]["achieved_over_bound"], ".2f")}
MICRO_COLUMNS = {
    "method": label, "out len": lambda r: r["output_len"], "live slots": lambda r: r.get("live_slots_end", "-"),
    "step ms": lambda r: num(r.get("step_ms_end", {}).get("median"), ".2f"), "evict ms/event": lambda r:
    num((r.get("evict_ms") or {}).get("median"), ".2f"), "event / (B steps)": lambda r:
    num(r.get("eviction_share"), ".1f", 100, "%"), "tok/s": lambda r: num(r.get("tok_s_end"), ".0f"),
    "bound tok/s": lambda r: num(r.get("roofline", {}).get("bound_tok_s_end"), ".0f"), "achieved/bound": lambda r:
    num(r.get("roofline", {}).get("achieved_over_bound_end"), ".2f") + (f" ({r['skipped']})" if "skipped" in r
                                                                         else "")}
KV_STEP_COLUMNS = {"cache": lambda r: r["kv_bits"], "16-bit slots P": lambda r: r["protected"], "quantized slots":
                   lambda r: r["quantized_slots"], "step ms": lambda r: f"{r['step_ms']:.2f}", "x bf16 step": lambda
                   r: f"{r['x_bf16_step']:.2f}", "MB/step": lambda r: f"{r['bytes_per_step'] / 1e6:.1f}"}


def add_bounds(runs: list[dict], batch: int, read_bw: float) -> None:
    """The roofline's tokens/s bounds at read bandwidth `read_bw`: over the run (batch * bw / mean bytes of a step)
    and at its end state (the last step's bytes, the eviction's amortized over B), and the measured tokens/s over
    each."""
    for r in runs:
        roof = r["roofline"]
        roof["bound_tok_s"] = batch * read_bw / roof["bytes_step_mean"]
        roof["bound_tok_s_end"] = batch * read_bw / (roof["bytes_step_end"]
                                                     + roof["bytes_per_eviction"] / (r["buffer"] or 1))
        roof["achieved_over_bound_end"] = r["tok_s_end"] / roof["bound_tok_s_end"]
        tok_s = (r.get("decode_tok_s") or {}).get("median")
        roof["achieved_over_bound"] = tok_s and tok_s / roof["bound_tok_s"]


def decode_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """The default mode: `Bench.run` per method, budget and output length, the bandwidth roofline and the segments.
    --micro: `Bench.micro` alone, the longest output length first, the results written after every row, rows
    past --deadline skipped."""
    model, micro_mode = bench.model, args.micro
    print(f"model {model_desc}: {ds.param_bytes(model) / 2**20:.0f} MiB of weights", flush=True)
    meta = {"command": args.command, "model": model_desc, "config": dataclasses.asdict(model.cfg),
            "dtype": jnp.dtype(model.dtype).name, "param_bytes": ds.param_bytes(model), "batch": args.batch,
            "prompt_len": args.prompt_len, "prompt_bucket": bench.bucket, "repeats": args.repeats,
            "warmup": args.warmup, "micro_steps": args.micro_steps, "attention_impl": args.attention_impl,
            "prefill_chunk": args.prefill_chunk or None, "batch_invariant": not args.no_batch_invariant,
            "layer_loop": bench.target.layer_loop}
    result = {"meta": meta, "runs": []}

    def probe():  # in the default mode last, so that its arrays are not in the runs' peak RSS
        result["bandwidth"] = bandwidth(args.bandwidth_mib << 20, args.repeats)

    def write() -> str:
        runs = [r for r in result["runs"] if "skipped" not in r]
        add_bounds(runs, bench.batch, result["bandwidth"]["read"])
        result["meta"] = meta | machine(load_start)
        text = decode_markdown(result, runs, model_desc)
        write_results(args.out, result, text)
        return text

    if micro_mode:
        probe()
    pairs = ([(n, ev) for n in sorted(args.output_lens, reverse=True) for ev in configs] if micro_mode else
             [(n, ev) for ev in configs for n in args.output_lens])
    for n, ev in pairs:
        if micro_mode and args.deadline is not None and time.time() > args.deadline:
            result["runs"].append({"method": ev.method, "budget": ev.budget if ev.evicts else None,
                                   "output_len": n, "skipped": "deadline"})
            continue
        r = bench.micro(ev, n) if micro_mode else bench.run(ev, n)[0]
        release_programs_near_mapping_limit()  # XLA:CPU crashes at the process's mapping limit
        result["runs"].append(r)
        print(f"{label(r):>20} n={n:<6} step {spread(r['step_ms_end'], spec='.2f')} ms, tok/s end "
              f"{r['tok_s_end']:.1f}" + ("" if micro_mode else f", decode {spread(r['decode_tok_s'])} tok/s"),
              flush=True)
        if micro_mode:
            write()
    if not micro_mode:
        probe()
        result["segments"] = segments(result["runs"], bench.batch)
    text = write()
    print(text)
    return 0


def decode_markdown(result: dict, runs: list[dict], model_desc: str) -> str:
    """The decode mode's table (--micro: the micro figures, and each full row's mixed-precision steps; else every
    figure and the segments)."""
    m, bw = result["meta"], result["bandwidth"]
    text = [header(m, model_desc, f"{m['dtype']}, {m['param_bytes'] / 2**20:.0f} MiB of weights; batch {m['batch']}, "
                   f"prompt {m['prompt_len']} (bucket {m['prompt_bucket']}); {m['repeats']} timed runs; layer loop "
                   f"{m['layer_loop']}. Read bandwidth {bw['read'] / 1e9:.1f} GB/s, in-place copy "
                   f"{bw['copy'] / 1e9:.1f} GB/s."), ""]
    if "segments" not in result:
        text += table(result["runs"], MICRO_COLUMNS)
        for r in (r for r in runs if r.get("kv")):
            text += ["", f"{label(r)} at {r['output_len']} tokens, mixed-precision caches ({r['live_slots_end']} "
                     f"live slots; the 16-bit cache's step {r['step_ms_end']['median']:.2f} ms):", ""]
            text += table(r["kv"], KV_STEP_COLUMNS)
    else:
        text += table(runs, DECODE_COLUMNS) + ["", "Marginal decode tokens/s per output-length segment:", ""]
        text += [f"- {name}: " + ", ".join(f"{s['from']}-{s['to']}: {num(s['tok_s'])}" for s in segs)
                 for name, segs in result["segments"].items()]
    return "\n".join(text) + "\n"


def compile_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """--compile-only: `Bench.program` per configuration, not run: compile seconds, HLO lines, temporaries."""
    rows = []
    for ev in configs:
        n = args.output_lens[0]
        _, compiled, info = bench.program(bench.generate_config(n), ev)
        rows.append({"method": ev.method, "budget": ev.budget if ev.evicts else None, "output_len": n,
                     "capacity": framework.capacity_for(ev, bench.bucket, n),
                     "hlo_lines": len(compiled.as_text().splitlines())} | info)
    m = machine(load_start) | {"command": args.command, "model": model_desc, "layers": bench.model.cfg.num_layers}
    text = "\n".join([header(m, model_desc, f"{jnp.dtype(bench.model.dtype).name}, batch {args.batch}, prompt "
                             f"{args.prompt_len}, {args.output_lens[0]} new tokens, layer loop "
                             f"{bench.target.layer_loop}."), "", *table(rows, {
        "method": label, "capacity": lambda r: r["capacity"], "compile s (lower s)": lambda r:
        f"{r['compile_s']:.1f} ({r['lower_s']:.1f})", "HLO lines": lambda r: r["hlo_lines"], "temporaries MiB":
        lambda r: num(r["temp_bytes"], ".1f", 2**-20)})]) + "\n"
    print(text)
    write_results(args.out, {"meta": m, "compile": rows}, text)
    return 0


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
    reqs = [batching.Request(tuple(int(x) for x in p), k, 0, int(c)) for p, k, c in zip(prompts, keys, caps,
                                                                                         strict=True)]
    stats = batching.EngineStats()
    results = batching.run(model, reqs, rows=rows, config=config, eviction=ev, stats=stats)
    return {"tokens": sum(len(r.tokens) for r in results), "steps": stats.steps, "events": stats.events,
            "utilization": stats.utilization, "segments": stats.segments}


def spread_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """Static vs continuous batching on the spread workload, per method, alternating --repeats times (a change of
    the machine's load hits both alike): tokens/s, utilization, events, and the step ratio (static steps over
    continuous ones: the speed-up at equal cost per step)."""
    model, longest = bench.model, args.output_lens[0]
    caps = spread_caps(args.spread_samples, longest, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    prompts = [rng.integers(0, model.cfg.vocab_size, args.prompt_len).astype(np.int32) for _ in caps]
    keys = [jax.random.fold_in(jax.random.key(args.seed), i) for i in range(len(caps))]
    config = vj.GenerateConfig(max_new_tokens=longest, eos_token_ids=(), attention_impl=args.attention_impl,
                               layer_loop=args.layer_loop)
    schedulers = {"static": run_static, "continuous": run_continuous}
    runs = []
    for ev in configs:
        row = {"method": ev.method, "budget": ev.budget if ev.evicts else None}
        k = min(args.batch, len(caps))
        for fn in schedulers.values():  # compile first (untimed), on the first chunk
            fn(model, prompts[:k], keys[:k], caps[:k], args.batch, config, ev)
        seconds: dict[str, list[float]] = {name: [] for name in schedulers}
        for _ in range(args.repeats):
            for name, fn in schedulers.items():
                start = time.perf_counter()
                row[name] = fn(model, prompts, keys, caps, args.batch, config, ev)
                seconds[name].append(time.perf_counter() - start)
        for name in schedulers:
            r = row[name]
            r["seconds"] = Stat.of(seconds[name]).as_dict()
            r["tok_s"] = r["tokens"] / r["seconds"]["median"]
            r["events_per_1k_tokens"] = 1e3 * r["events"] / r["tokens"]
        row |= {"speedup_runs": [a / b for a, b in zip(seconds["static"], seconds["continuous"], strict=True)],
                "speedup": row["continuous"]["tok_s"] / row["static"]["tok_s"],
                "step_ratio": row["static"]["steps"] / row["continuous"]["steps"]}
        runs.append(row)
        print(f"{label(row):>20} {row['speedup']:.2f}x (steps {row['step_ratio']:.2f}x)", flush=True)
    result = {"meta": machine(load_start) | {
        "command": args.command, "model": model_desc, "batch": args.batch, "prompt_len": args.prompt_len,
        "longest": longest, "samples": len(caps), "mean_output": float(caps.mean())}, "spread": runs}
    text = "\n".join(table(runs, {
        "method": label, "static tok/s": lambda r: f"{r['static']['tok_s']:.1f}", "static util": lambda r:
        f"{r['static']['utilization']:.2f}", "continuous tok/s": lambda r: f"{r['continuous']['tok_s']:.1f}",
        "continuous util": lambda r: f"{r['continuous']['utilization']:.2f}", "speed-up": lambda r:
        f"{r['speedup']:.2f}x", "step ratio": lambda r: f"{r['step_ratio']:.2f}x", "events/1k tok static": lambda r:
        f"{r['static']['events_per_1k_tokens']:.2f}", "continuous": lambda r:
        f"{r['continuous']['events_per_1k_tokens']:.2f}"})) + "\n"
    print(text)
    write_results(args.out, result, text)
    return 0


# ---- the AIME25 protocol: measured per method, projected whole ---------------------------------------------------
AIME25_COLUMNS = {
    "method": lambda r: r["label"], "rows": lambda r: r["rows"], "step ms": lambda r:
    f"{r['protocol']['step_ms']:.2f}", "window tok/s": lambda r: f"{r['window_tok_s']:.0f}", "check s (predicted)":
    lambda r: f"{r['check']['seconds']:.2f} ({r['check']['predicted_s']:.2f})", "steps": lambda r:
    r["protocol"]["steps"], "utilization": lambda r: f"{r['protocol']['utilization']:.2f}", "tok/s": lambda r:
    f"{r['protocol']['tok_s']:.0f}", "projected wall": lambda r: f"{r['protocol']['seconds'] / 60:.1f} min",
    "peak GiB": lambda r: num(r["peak_bytes"], ".2f", 2**-30), "planned GiB": lambda r:
    num((r.get("plan") or {}).get("total"), ".2f", 2**-30), "rows because": lambda r: r["rows_reason"]}


def aime25_markdown(result: dict) -> str:
    """The table of `aime25_report` (one row per method measured so far; a method without rows says why)."""
    meta = result["meta"]
    ln = meta["lengths"]
    lines = [f"AIME25 protocol's shape: {meta['model_desc']}, {meta['dtype']}, {meta['samples']} samples, prompts of "
             f"{meta['prompt_len']} tokens, at most {meta['total_tokens']} tokens per sample; output lengths "
             f"log-normal (median {ln['median']}, sigma {ln['sigma']}, seed {ln['seed']}; mean {ln['mean']:.0f}, "
             f"max {ln['max']}, {ln['at_cap']} at the cap, {ln['tokens']} tokens); device {meta['device']}; "
             f"{meta['seconds_per_method']:.0f} s measured per method.", ""]
    lines += table([r for r in result["methods"] if r["rows"]], AIME25_COLUMNS)
    lines += [f"- {r['label']}: no rows ({r['rows_reason']})" for r in result["methods"] if not r["rows"]]
    lines += ["", f"Projection: {meta['formula']}; slot_reads counted as {meta['attention_reads']!r}. Fitted seconds "
              "per method (round_s, step_s, slot_s, event_s):", ""]
    lines += [f"- {r['label']}: " + ", ".join(f"{k} {v:.3g}" for k, v in r["model"].items() if k != "reads")
              + f"; compile {r['compile_s']:.1f} s, plan {r['plan_s']:.1f} s; {len(r['windows'])} windows up to "
              f"{r['windows'][-1]['length']} tokens; schedules match the engine: {r['schedules_match_engine']}"
              for r in result["methods"] if r["rows"]]
    return "\n".join(lines) + "\n"


def aime25_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """--workload aime25: `workload.aime25_workload`, writing results.json / results.md under --out after each
    method."""
    shape = wl.AIME25 if args.scale == "protocol" else wl.AIME25_TINY
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    meta = machine(load_start) | {
        "command": args.command, "model_desc": model_desc, "allocator_limit_bytes": (stats or {}).get("bytes_limit"),
        "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")}

    def write(so_far: dict):
        result = {"meta": so_far["meta"] | meta | machine(load_start), "methods": so_far["methods"]}
        write_results(args.out, result, aime25_markdown(result))
        return result

    try:
        out = wl.aime25_workload(
            bench.model, configs, seconds_per_method=args.seconds, batch=args.batch, samples=args.samples,
            prompt_len=args.prompt_len, total_tokens=shape["total_tokens"], median=shape["median"],
            sigma=shape["sigma"], seed=args.seed, headroom=args.headroom,
            device_bytes=None if args.device_gb is None else int(args.device_gb * 1e9), queue=args.queue,
            attention_impl=args.attention_impl, layer_loop=args.layer_loop, deadline=args.deadline, on_method=write,
            log=lambda m: print(m, flush=True))
    except ValueError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    print(aime25_markdown(write(out)))
    return 0


# ---- the mixed-precision cache ----------------------------------------------------------------------------------
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
    cfg, entries = bench.model.cfg, []
    for name, protected, config in kv_variants(bench, ev, n):
        call, _, info = bench.program(config, ev)
        capacity = (generate_tiers(cfg, config, ev, bench.bucket) if KVBits.parse(name).quantizes else
                    framework.capacity_for(ev, bench.bucket, n))
        prefill = bench.prefill(capacity, ev)
        jax.block_until_ready((call(), prefill()))  # warm-up
        entries.append(dict(call=call, prefill=prefill, totals=[], prefills=[], row={
            "method": ev.method, "budget": ev.budget if ev.evicts else None, "kv_bits": name, "protected": protected,
            "output_len": n, "slots": getattr(capacity, "virtual_slots", capacity), "compile_s": info["compile_s"],
            "token_bytes": token_bytes(cfg.head_dim, config.kv_bits_for(cfg.head_dim), bench.itemsize),
            "cache_bytes": cache_bytes(jax.eval_shape(prefill)[1]), "program_bytes": info["program_bytes"]}))
    for _ in range(bench.args.repeats):
        for e in entries:
            e["totals"].append(time_runs(e["call"], 1).median)
            e["prefills"].append(time_runs(e["prefill"], 1).median)
    rows, reference = [], None
    for e in entries:
        tokens = np.asarray(e["call"]().tokens)
        reference = tokens if reference is None else reference
        rate = decode_rate(Stat.of(e["totals"]), Stat.of(e["prefills"]), bench.batch * (n - 1))
        rows.append(e["row"] | {"total_s": float(np.median(e["totals"])), "prefill_s": float(np.median(e["prefills"])),
                                "decode_tok_s": None if rate is None else rate.median,
                                "tokens_agree_with_bf16": float((tokens == reference).mean())})
    base = rows[0]
    for r in rows:
        r["x_bf16_cache"] = r["cache_bytes"] / base["cache_bytes"]
        r["x_bf16_decode"] = r["decode_tok_s"] / base["decode_tok_s"] if r["decode_tok_s"] and base[
            "decode_tok_s"] else None
    return rows


def kv_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """--kv-bits: `kv_rows` per method and budget at the first --output-lens."""
    rows = []
    for ev in configs:
        rows += kv_rows(bench, ev, args.output_lens[0])
        release_programs_near_mapping_limit()
    m = machine(load_start) | {"command": args.command, "model": model_desc, "dtype": jnp.dtype(bench.model.dtype).name,
                               "batch": args.batch, "prompt_len": args.prompt_len, "output_len": args.output_lens[0],
                               "repeats": args.repeats, "attention_impl": args.attention_impl}
    text = "\n".join([f"# Mixed-precision KV cache: {model_desc}, {m['dtype']}", "", header(
        m, model_desc, f"Batch {args.batch}, prompt {args.prompt_len}, {args.output_lens[0]} new tokens (greedy), "
        f"{args.repeats} interleaved runs per setting (medians)."), "", *table(rows, {
            "method": label, "cache": lambda r: r["kv_bits"], "16-bit slots P": lambda r: num(r["protected"], ".0f"),
            "bytes/token (K+V, one kv head)": lambda r: r["token_bytes"], "cache MiB": lambda r:
            f"{r['cache_bytes'] / 2**20:.2f}", "x bf16": lambda r: f"{r['x_bf16_cache']:.3f}", "program MiB": lambda r:
            num(r["program_bytes"], ".1f", 2**-20), "decode tok/s": lambda r: num(r["decode_tok_s"]), "decode x bf16":
            lambda r: num(r["x_bf16_decode"], ".2f", suffix="x"), "tokens = bf16": lambda r:
            f"{100 * r['tokens_agree_with_bf16']:.0f}%"})]) + "\n"
    print(text)
    write_results(args.out, {"meta": m, "kv": rows}, text)
    return 0


# ---- main --------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.command = " ".join(["python", "-m", "benchmarks.bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        configs = check_args(args)
        if args.workload == "aime25":  # the batch fills the device: let JAX's allocator have most of it
            os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
            if (not isinstance(args.batch, int) and args.device_gb is None and
                    planner.device_memory(jax.devices()[0]) is None):
                raise ValueError(f"--workload aime25: the {jax.devices()[0].platform} device reports no memory size "
                                 "to fit the batch to: give --batch or --device-gb")
        dtype = getattr(jnp, args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
        model, model_desc = load_model(args, dtype)
        configs = with_calibration(configs, model, args)
    except ValueError as e:
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
              aime25_report if args.workload == "aime25" else kv_report if args.kv_bits and not args.micro else
              decode_report)
    return report(args, bench, model_desc, configs, load_start)


if __name__ == "__main__":
    sys.exit(main())
