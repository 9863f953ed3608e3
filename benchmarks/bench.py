"""Decode speed, memory and cost of `vase_jax.generate` per eviction method, budget and output length, with a
memory-bandwidth roofline (default), the same pieces timed alone (--micro), the mixed-precision cache (--kv-bits) and
the AIME25 protocol measured and projected (--workload aime25, `benchmarks.workload`; --scale tiny: its CPU copy):

    python -m benchmarks.bench --model small --batch 2 --output-lens 2048,8192 --budgets 1024 --out bench_long

`--model`: a hub id, an HF folder or a named random model (`vase_jax.random_model.named_configs`, shrunk by --layers,
--vocab, --hidden, --intermediate). Generations are greedy and fixed-length. How each figure is obtained:
docs/BENCHMARKS.md, "How the figures are obtained"."""

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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import vase_jax as vj
from benchmarks import decode_step as ds
from benchmarks import workload as wl
from benchmarks.report import ints, method_label, num, spread, table, write_results
from benchmarks.timing import Stat, bandwidth, decode_rate, device_desc, load_warning, machine, time_runs
from vase_jax import planner
from vase_jax.cache import cache_bytes
from vase_jax.eviction import METHODS, EvictionConfig, framework
from vase_jax.generate import LAYER_LOOPS, MIN_PREFILL_CHUNK, generate_target, generate_tiers, query_window
from vase_jax.jit import enable_compilation_cache, release_programs_near_mapping_limit
from vase_jax.kvquant import KVBits, token_bytes
from vase_jax.random_model import named_configs, shrink

PAPER_METHODS = ("full", "snapkv", "rkv", "curdkv", "vase_attnv", "vase_dkv")
DEFAULTS = {"model": "qwen3-0.6b", "prompt_len": 128, "methods": "full,vase_attnv,vase_dkv", "budgets": [512],
            "buffer": 64, "batch": 4}
# --workload aime25 --scale S: the protocol's shape and S's defaults (before DEFAULTS; flags given win)
AIME25_SCALES = {"protocol": (wl.AIME25, {"model": "qwen3-14b", "dtype": "bfloat16", "budgets": [2048]}),
                 "tiny": (wl.AIME25_TINY, {"model": "tiny-1k", "budgets": [32], "buffer": 8, "batch": 6})}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit status 2, before anything compiles
        print(f"bench.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def _checked(conv: Callable[[str], object], ok: Callable, want: str) -> Callable[[str], object]:
    """An argparse type: `conv(text)`, its every value (one, or a list's) passing `ok`, else "'TEXT': WANT"."""
    def parse(text: str):
        value = conv(text)
        values = value if isinstance(value, list) else [value]
        if not values or not all(ok(v) for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: {want}")
        return value

    parse.__name__ = conv.__name__  # argparse's "invalid <name> value" when `conv` raises
    return parse


def _at_least(low: float, conv: Callable = int) -> Callable[[str], object]:
    return _checked(conv, lambda v: v >= low, f"must be >= {low}")


def kv_settings(text: str) -> list[str]:
    """--kv-bits: canonical `KVBits` names, bf16 first."""
    try:
        names = [KVBits.parse(t.strip()).validate().name for t in text.split(",") if t.strip()]
        return list(dict.fromkeys(["K16V16", *names]))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, each checked by its type; `check_args` checks what spans flags."""
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a, positive, above_0 = p.add_argument, _at_least(1), _checked(float, lambda v: v > 0, "must be > 0")
    a("--model", help="hub id, HF folder or named random model (default qwen3-0.6b; aime25: qwen3-14b, tiny-1k)")
    for name in ("layers", "vocab", "hidden", "intermediate"):
        a(f"--{name}", type=int, help=f"named random models: {name} (heads unchanged)")
    a("--layer-loop", default="auto", choices=LAYER_LOOPS, help="GenerateConfig.layer_loop")
    a("--dtype", choices=("float32", "bfloat16"), help="default: float32 (CPU), bfloat16 (GPU)")
    a("--batch", type=positive, help="rows (default 4; aime25: the most that fit the device, per method)")
    a("--prompt-len", type=positive, help="random prompt tokens per row (default 128; aime25: 256)")
    a("--output-lens", type=_at_least(2, ints), default=[1024], help="comma list: new tokens per row")
    a("--methods", help="comma list of full and eviction METHODS (default full,vase_attnv,vase_dkv), paper or all")
    a("--budgets", type=ints, help="comma list of budgets N (default 512, aime25: 2048)")
    a("--buffer", type=int, help="buffer B, the eviction period (default 64)")
    a("--attention-impl", default="auto", choices=("auto", "xla", "pallas"))
    a("--prefill-chunk", type=_checked(int, lambda v: v == 0 or v >= MIN_PREFILL_CHUNK, f"0 (dense) or >= "
      f"{MIN_PREFILL_CHUNK}"), default=vj.GenerateConfig.prefill_chunk, help="GenerateConfig.prefill_chunk; 0: dense")
    a("--no-batch-invariant", action="store_true", help="GenerateConfig.batch_invariant=False (the invariance's cost)")
    a("--repeats", type=_at_least(3), default=3, help="timed runs per figure")
    a("--warmup", type=_at_least(0), default=1, help="untimed runs after compiling, before the timed ones")
    a("--micro-steps", type=positive, default=8, help="decode steps per micro-benchmark call")
    a("--bandwidth-mib", type=positive, default=512, help="array size of the bandwidth measurement")
    a("--micro", action="store_true", help="a step at each run's last length and an eviction event alone, no generate")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--kv-bits", type=kv_settings, help="comma list of caches (bf16, K8V8, K4V4, K<b>V<b>g<group>)")
    mode.add_argument("--workload", choices=("aime25",), help="the AIME25 protocol, measured and projected")
    a("--scale", choices=tuple(AIME25_SCALES), default="protocol", help="aime25: the protocol or its CPU copy")
    a("--seconds", type=above_0, default=120.0, help="aime25: measuring seconds per method (plan, compile on top)")
    a("--deadline", type=float, help="aime25, --micro: when the measuring ends (seconds since the epoch)")
    a("--samples", type=positive, help="aime25: samples (default 480; tiny 24)")
    a("--device-gb", type=above_0, help="aime25: device GB the batch must fit (default: the allocator's limit)")
    a("--headroom", type=_checked(float, lambda v: 0 <= v < 1, "must be in [0, 1)"), default=0.05)  # aime25
    a("--queue", type=positive, help="aime25: samples prefilled per round (default: as batching.run)")
    a("--seed", type=int, default=0)
    a("--out", help="folder for results.json and results.md")
    a("--compile-cache", metavar="DIR", help="JAX's persistent compilation cache (default ~/.cache/vase-jax/xla)")
    a("--no-compile-cache", action="store_true", help="compile every program anew")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[EvictionConfig]:
    """The checks that span flags (ValueError naming the flag), the defaults filled in (--workload aime25: its
    scale's); returns the configurations (one that takes a calibration is validated with the model)."""
    if args.workload:
        if args.micro:
            raise ValueError("--micro is the decode mode's: drop --workload")
        shape, defaults = AIME25_SCALES[args.scale]
        for name, value in (defaults | {"methods": "vase_dkv,vase_attnv,full", "prompt_len": shape["prompt_len"],
                                        "samples": shape["samples"]}).items():
            if getattr(args, name) is None and not (name == "batch" and args.device_gb is not None):
                setattr(args, name, value)
        if args.prompt_len + 2 > shape["total_tokens"]:
            raise ValueError(f"--prompt-len={args.prompt_len}: a sample holds {shape['total_tokens']} tokens at most")
    elif args.scale != "protocol":
        raise ValueError("--scale applies to --workload aime25")
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None and not (name == "batch" and args.workload):
            setattr(args, name, value)
    args.output_lens = sorted(set(args.output_lens))
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    names = list(dict.fromkeys({"paper": PAPER_METHODS, "all": ["full", *sorted(METHODS)]}.get(",".join(names),
                                                                                                  names)))
    if not names or set(names) - {"full", *METHODS}:
        raise ValueError(f"--methods: unknown {sorted(set(names) - {'full', *METHODS}) or names}; known: full, "
                         f"{', '.join(sorted(METHODS))}")
    if not args.budgets and set(names) - {"full"}:
        raise ValueError(f"--budgets is empty but {sorted(set(names) - {'full'})} need a budget")
    configs = [EvictionConfig(m) if m == "full" else EvictionConfig(m, budget=n, buffer=args.buffer)
               for m in names for n in ([None] if m == "full" else args.budgets)]
    configs = [ev if ev.evicts and "calibration" in ev.policy.option_names else ev.validate() for ev in configs]
    if args.workload:  # the batch fills the device: JAX's allocator may take most of it (set before JAX starts)
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
        if args.batch is None and args.device_gb is None and planner.device_memory(jax.devices()[0]) is None:
            raise ValueError(f"--workload aime25: the {jax.devices()[0].platform} device reports no memory size to "
                             "fit the batch to: give --batch or --device-gb")
    return configs


def with_calibration(configs: list[EvictionConfig], model: vj.Qwen3, args) -> list[EvictionConfig]:
    """The configurations validated against the model, one that takes a calibration (triattention) given the model
    folder's statistics, else (a named random model) random ones of its shape (speed does not depend on them)."""
    from vase_jax.calibration import random_statistics
    from vase_jax.eviction.triattention import save_calibration, stats_path

    out = []
    for ev in configs:
        if ev.evicts and "calibration" in ev.policy.option_names:
            path = stats_path(args.model) if os.path.isdir(args.model) and os.path.isfile(stats_path(args.model)) \
                else save_calibration(tempfile.mkdtemp(prefix="bench-stats-"), random_statistics(model.cfg))
            ev = dataclasses.replace(ev, options=dataclasses.replace(ev.options, calibration=path)).validate()
        framework.check_model(ev, model.cfg)
        out.append(ev)
    return out


def load_model(args: argparse.Namespace, dtype) -> tuple[vj.Qwen3, str]:
    """(model, description): a named random model, or a checkpoint folder / hub id."""
    named, name = named_configs(), args.model.lower()
    if name in named:
        cfg = shrink(named[name], args.layers, args.vocab, args.hidden, args.intermediate)
        return vj.Qwen3(cfg, dtype=dtype, rngs=nnx.Rngs(args.seed)), (
            f"{name} (random weights, {cfg.num_layers} layers, hidden {cfg.hidden_size}, mlp {cfg.intermediate_size}, "
            f"vocab {cfg.vocab_size})")
    if any(getattr(args, n) is not None for n in ("layers", "vocab", "hidden", "intermediate")):
        raise ValueError(f"--layers / --vocab / --hidden / --intermediate apply to named random models "
                         f"({', '.join(named)}) only, not to --model={args.model!r}")
    return vj.Qwen3.from_pretrained(args.model, dtype=dtype), args.model


def label(r: dict | EvictionConfig) -> str:
    """A row's or a configuration's method label: "full", "vase_dkv@2048"."""
    return method_label(r.method, r.evicts and r.budget) if isinstance(r, EvictionConfig) else method_label(
        r["method"], r["budget"])


# ---- measurements ------------------------------------------------------------------------------------------
class Bench:
    """What every measurement shares: the arguments, the model split for jit, the prompt, memoized figures."""

    def __init__(self, args: argparse.Namespace, model: vj.Qwen3):
        self.args, self.model, a = args, model, args
        self.graphdef, self.state = nnx.split(model)
        self.step_ms, self.evict_ms = functools.cache(self._step_ms), functools.cache(self._evict_ms)  # once each
        self.target = generate_target(model, self.generate_config(1))  # as generate picks it
        # [batch, bucket] int32: the prompt left-padded as generate pads it (the prefill's input); `raw`: the
        # unpadded prompt generate gets (its padding sets the cache's capacity). aime25 draws its own prompts.
        self.ids, self.mask = ds.random_prompt(model.cfg.vocab_size, a.batch or 1, a.prompt_len,
                                               self.generate_config(2), a.seed)
        self.raw = (self.ids[:, -a.prompt_len:], self.mask[:, -a.prompt_len:])
        self.key, self.itemsize = jax.random.key(a.seed), jnp.dtype(model.dtype).itemsize
        self.batch, self.bucket = self.ids.shape

    def generate_config(self, n: int, kv_bits: str = "K16V16") -> vj.GenerateConfig:
        """The runs' settings for `n` new tokens, the cache at `kv_bits` (a `KVBits` name)."""
        a, kv = self.args, KVBits.parse(kv_bits)
        return vj.GenerateConfig(max_new_tokens=n, temperature=0.0, eos_token_ids=(), pad_token_id=0,
                                 layer_loop=a.layer_loop, attention_impl=a.attention_impl,
                                 prefill_chunk=a.prefill_chunk or None, batch_invariant=not a.no_batch_invariant,
                                 key_bits=kv.key_bits, value_bits=kv.value_bits, kv_group=kv.key_group,
                                 kv_refine=kv.refine)

    def program(self, config: vj.GenerateConfig, ev: EvictionConfig) -> tuple[functools.partial, dict]:
        """`generate` compiled as it compiles itself, called on the unpadded prompt: (the call, {compile_s (lowering
        included), program_bytes: arguments + outputs + temporaries - aliased (`memory_analysis`: its peak)})."""
        graphdef, start = self.graphdef, time.perf_counter()

        def generate(state, ids, mask, key):
            return vj.generate(nnx.merge(graphdef, state), ids, mask, key=key, config=config, eviction=ev)

        compiled = jax.jit(generate, compiler_options=self.target.compiler_options()).lower(
            self.state, *self.raw, self.key).compile()
        info, mem = {"compile_s": time.perf_counter() - start}, compiled.memory_analysis()
        info["program_bytes"] = None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                                          + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
        return functools.partial(compiled, self.state, *self.raw, self.key), info

    def prefill(self, capacity, ev: EvictionConfig) -> functools.partial:
        """A jitted copy of generate's prefill (prompt forward, a cache of `capacity`: slots or a tier layout)."""
        return functools.partial(ds.prefill, self.graphdef, self.state, self.ids, self.mask, capacity,
                                 query_window(ev), self.args.attention_impl, framework.slot_state(ev), self.target,
                                 self.args.prefill_chunk or None)

    def _step_ms(self, capacity: int, window: int, length: int, state: tuple = ()) -> Stat:
        """Per-step milliseconds of `decode_steps` from `length` live slots (`step_ms`: memoized); `state`: the
        policy's per-slot state arrays (their update is part of the step)."""
        a = self.args
        cache = ds.filled_cache(self.model.cfg, self.batch, capacity, length, window, self.model.dtype, a.seed, state,
                                self.target)
        return ds.step_ms(self.graphdef, self.state, cache, jnp.int32(length), a.micro_steps, a.repeats,
                          a.attention_impl, self.target)

    def _evict_ms(self, ev: EvictionConfig, capacity: int) -> Stat:
        """Milliseconds of one eviction event on a full cache (`evict_ms`: memoized)."""
        a = self.args
        cache = ds.filled_cache(self.model.cfg, self.batch, capacity, ev.budget + ev.buffer, query_window(ev),
                                self.model.dtype, a.seed, framework.slot_state(ev), self.target)
        return ds.evict_ms(cache, ev, max(a.repeats, 5), a.attention_impl, a.seed)

    def micro(self, ev: EvictionConfig, n: int) -> dict:
        """The figures of one (method, budget, output length) that time pieces of `generate` alone: a decode step on
        a cache filled to the run's last length (and its first, `step_ms_start`, but with --micro), one eviction
        event, tokens/s of those steps (the end's with the eviction amortized over B steps) and the bytes a step
        reads (`decode_step.roofline` of the run's replayed schedule); --micro --kv-bits: `full`'s tiered steps."""
        b, a = self.batch, self.args
        capacity, window, state = framework.capacity_for(ev, self.bucket, n), query_window(ev), framework.slot_state(ev)
        reads, after, triggers = ds.row_replay(ev, a.prompt_len, n - 1)
        live = max(1, min(int(reads[-1]) - 1, capacity - a.micro_steps))  # a call appends --micro-steps slots
        end = self.step_ms(capacity, window, live, state)
        evict = self.evict_ms(ev, capacity) if ev.evicts else None
        evict_ms = evict.median if evict else 0.0
        r = {"method": ev.method, "budget": ev.budget if ev.evicts else None, "buffer": ev.buffer if ev.evicts
             else None, "output_len": n, "capacity": capacity, "live_slots_end": live, "step_ms_end": end.as_dict(),
             "evict_ms": evict and evict.as_dict(), "tok_s_end": b / (end.median + evict_ms / ev.buffer) * 1e3,
             "eviction_share": evict_ms / (ev.buffer * end.median) if evict else None,
             "evictions_expected": len(triggers), "cache_length_expected": int(after[-1]),
             "roofline": ds.roofline(self.model, ev, reads, len(triggers), b, self.itemsize)}  # + `add_bounds`
        if not a.micro:
            start = self.step_ms(capacity, window, max(1, min(a.prompt_len, capacity - a.micro_steps)), state)
            r |= {"step_ms_start": start.as_dict(), "tok_s_start": b / start.median * 1e3}
        elif kv := [self.tiered_step(name, n, live, end.median) for name in a.kv_bits or ()
                    if not ev.evicts and KVBits.parse(name).quantizes]:
            r["kv"] = kv
        return r

    def tiered_step(self, name: str, n: int, live: int, bf16_step_ms: float) -> dict:
        """`full`'s decode step from `live` tokens on a mixed-precision cache of setting `name` (its default
        protection) against the 16-bit cache's; the bytes it reads: weights, 16-bit slots, quantized ones."""
        cfg, config = self.model.cfg, self.generate_config(n, name)
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

    def run(self, ev: EvictionConfig, n: int) -> dict:
        """Every figure of one (method, budget, output length): `generate` compiled and timed, its prefill timed
        alone, and `micro`'s."""
        call, info = self.program(self.generate_config(n), ev)
        last = [None]  # the last call's output

        def timed():
            last[0] = call()
            return last[0]

        total, out = time_runs(timed, self.args.repeats, self.args.warmup), last[0]
        prefill = self.prefill(framework.capacity_for(ev, self.bucket, n), ev)
        prefill_s = time_runs(prefill, self.args.repeats, 1)
        tok_s = decode_rate(total, prefill_s, self.batch * (n - 1))
        r, decode_s = self.micro(ev, n), total.median - prefill_s.median
        r |= {"evictions": int(out.evictions), "cache_length_end": int(out.cache_length.max()), **info,
              "total_s": total.as_dict(), "prefill_s": prefill_s.as_dict(), "decode_tok_s": tok_s and tok_s.as_dict(),
              "evict_overhead": None if decode_s <= 0 else
              r["evictions_expected"] * (r["evict_ms"] or {"median": 0.0})["median"] / 1e3 / decode_s,
              "cache_bytes": cache_bytes(prefill()[1]),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "device_peak_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")}
        if tok_s is None:
            print(f"bench.py: warning: {label(r)} n={n}: a run took no longer than the prefill, so no decode "
                  "tokens/s (use longer --output-lens)", file=sys.stderr)
        return r


def segments(runs: list[dict], batch: int) -> dict[str, list[dict]]:
    """Marginal decode tokens/s between consecutive output lengths, per (method, budget): batch * delta(length)
    / delta(median total seconds); the first segment is the shortest run's decode tokens/s."""
    out: dict[str, list[dict]] = {}
    for r in sorted(runs, key=lambda r: r["output_len"]):
        out.setdefault(label(r), []).append(r)
    return {name: [{"from": 1, "to": rs[0]["output_len"], "tok_s": (rs[0]["decode_tok_s"] or {}).get("median")}] + [
        {"from": a["output_len"], "to": c["output_len"], "tok_s": batch * (c["output_len"] - a["output_len"]) / dt
         if (dt := c["total_s"]["median"] - a["total_s"]["median"]) > 0 else None} for a, c in itertools.pairwise(rs)]
        for name, rs in out.items()}


def add_bounds(runs: list[dict], batch: int, read_bw: float) -> None:
    """The roofline's tokens/s bounds at read bandwidth `read_bw`: over the run (batch * bw / mean bytes of a step)
    and at its end state (the last step's bytes, the eviction's amortized over B), and the measured tokens/s over
    each."""
    for r in runs:
        roof, tok_s = r["roofline"], (r.get("decode_tok_s") or {}).get("median")
        roof["bound_tok_s"] = batch * read_bw / roof["bytes_step_mean"]
        roof["bound_tok_s_end"] = batch * read_bw / (roof["bytes_step_end"] + roof["bytes_per_eviction"] / (
            r["buffer"] or 1))
        roof["achieved_over_bound_end"] = r["tok_s_end"] / roof["bound_tok_s_end"]
        roof["achieved_over_bound"] = tok_s and tok_s / roof["bound_tok_s"]


# ---- the modes: each writes results.json and results.md under --out -----------------------------------------
def col(key: str, spec: str = ".1f", scale: float = 1.0, suffix: str = "") -> Callable[[dict], object]:
    """A table column: a row's figure at `key` ("a.b": nested) as "median [min-max]" for a `Stat` dict, `num` for a
    number or None (times `scale`, in `spec`, then `suffix`), as it is otherwise."""
    def cell(r: dict) -> object:
        v = functools.reduce(lambda d, k: d[k], key.split("."), r)
        return (spread(v, scale, spec) if isinstance(v, dict) else num(v, spec, scale, suffix)
                if v is None or isinstance(v, int | float) else v)

    return cell


COLUMNS = {  # the decode mode's table; --micro's has MICRO_COLUMNS
    "method": label, "out len": col("output_len", ".0f"), "live slots": col("live_slots_end", ".0f"),
    "decode tok/s med [min-max]": col("decode_tok_s"), "tok/s start": col("tok_s_start"), "tok/s end": col("tok_s_end"),
    "step ms start": col("step_ms_start", ".2f"), "step ms end": col("step_ms_end", ".2f"),
    "prefill ms": col("prefill_s", ".1f", 1e3), "compile s": col("compile_s"), "evict ms/event": col("evict_ms", ".2f"),
    "event / (B steps)": col("eviction_share", ".1f", 100, "%"), "events": col("evictions", ".0f"),
    "evict overhead": col("evict_overhead", ".1f", 100, "%"), "cache MiB": col("cache_bytes", ".1f", 2**-20),
    "program MiB": col("program_bytes", ".0f", 2**-20), "bound tok/s": col("roofline.bound_tok_s"),
    "achieved/bound": col("roofline.achieved_over_bound", ".2f"),
    "bound tok/s end": col("roofline.bound_tok_s_end", ".0f"),
    "achieved/bound end": col("roofline.achieved_over_bound_end", ".2f")}
MICRO_COLUMNS = ("method", "out len", "live slots", "step ms end", "evict ms/event", "event / (B steps)",
                 "tok/s end", "bound tok/s end", "achieved/bound end")
KV_STEP_COLUMNS = {"cache": col("kv_bits"), "16-bit slots P": col("protected", ".0f"),
                   "quantized slots": col("quantized_slots", ".0f"), "step ms": col("step_ms", ".2f"),
                   "x bf16 step": col("x_bf16_step", ".2f"), "MB/step": col("bytes_per_step", ".1f", 1e-6)}
KV_COLUMNS = {
    "method": label, "cache": col("kv_bits"), "16-bit slots P": col("protected", ".0f"),
    "bytes/token (K+V, one kv head)": col("token_bytes", ".0f"), "cache MiB": col("cache_bytes", ".2f", 2**-20),
    "x bf16": col("x_bf16_cache", ".3f"), "program MiB": col("program_bytes", ".1f", 2**-20),
    "decode tok/s": col("decode_tok_s"), "decode x bf16": col("x_bf16_decode", ".2f", suffix="x"),
    "tokens = bf16": col("tokens_agree_with_bf16", ".0f", 100, "%")}
AIME25_COLUMNS = {
    "method": col("label"), "rows": col("rows", ".0f"), "step ms": col("protocol.step_ms", ".2f"),
    "window tok/s": col("window_tok_s", ".0f"),
    "check s (predicted)": lambda r: f"{r['check']['seconds']:.2f} ({r['check']['predicted_s']:.2f})",
    "steps": col("protocol.steps", ".0f"), "utilization": col("protocol.utilization", ".2f"),
    "tok/s": col("protocol.tok_s", ".0f"), "projected wall": col("protocol.seconds", ".1f", 1 / 60, " min"),
    "peak GiB": col("peak_bytes", ".2f", 2**-30),
    "planned GiB": lambda r: num((r.get("plan") or {}).get("total"), ".2f", 2**-30), "rows because": col("rows_reason")}


def header(meta: dict, model_desc: str, extra: str = "") -> str:
    """The line every mode's table starts with: the command, the machine and the load, the model."""
    return (f"Command: `{meta['command']}`\n\nMachine: {meta['device']}, {meta['cpu_model']}, "
            f"{meta['cpu_count']} CPUs, jax {meta['jax']}; load average (1, 5, 15 min) at start "
            f"{meta['load_start']}, at end {meta['load_end']}"
            + (f" (**{meta['load_warning']}**)" if meta["load_warning"] else "") + f". Model: {model_desc}. {extra}")


def decode_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """The default mode: `Bench.run` per method, budget and output length, the bandwidth roofline and the segments.
    --micro: `Bench.micro` alone, the longest output length first, the results written after every row, rows
    past --deadline skipped."""
    model, micro = bench.model, args.micro
    print(f"model {model_desc}: {ds.param_bytes(model) / 2**20:.0f} MiB of weights", flush=True)
    meta = {k: getattr(args, k) for k in ("command", "batch", "prompt_len", "repeats", "warmup", "micro_steps",
                                          "attention_impl")} | {
        "model": model_desc, "config": dataclasses.asdict(model.cfg), "dtype": jnp.dtype(model.dtype).name,
        "param_bytes": ds.param_bytes(model), "prompt_bucket": bench.bucket, "layer_loop": bench.target.layer_loop,
        "prefill_chunk": args.prefill_chunk or None, "batch_invariant": not args.no_batch_invariant}
    result: dict = {"meta": meta, "runs": []}

    def write() -> str:
        add_bounds([r for r in result["runs"] if "skipped" not in r], bench.batch, result["bandwidth"]["read"])
        result["meta"] = meta | machine(load_start)
        write_results(args.out, result, text := decode_markdown(result, model_desc))
        return text

    if micro:  # else last, so that its arrays are not in the runs' peak RSS
        result["bandwidth"] = bandwidth(args.bandwidth_mib << 20, args.repeats)
    for n, ev in ([(n, ev) for n in args.output_lens[::-1] for ev in configs] if micro else
                  [(n, ev) for ev in configs for n in args.output_lens]):
        if micro and args.deadline is not None and time.time() > args.deadline:
            result["runs"].append({"method": ev.method, "budget": ev.budget if ev.evicts else None,
                                   "output_len": n, "skipped": "deadline"})
            continue
        result["runs"].append(r := bench.micro(ev, n) if micro else bench.run(ev, n))
        release_programs_near_mapping_limit()  # XLA:CPU crashes at the process's mapping limit
        print(f"{label(r):>20} n={n:<6} step {spread(r['step_ms_end'], spec='.2f')} ms, tok/s end "
              f"{r['tok_s_end']:.1f}" + ("" if micro else f", decode {spread(r['decode_tok_s'])} tok/s"), flush=True)
        if micro:
            write()
    if not micro:
        result["bandwidth"] = bandwidth(args.bandwidth_mib << 20, args.repeats)
        result["segments"] = segments(result["runs"], bench.batch)
    print(write())
    return 0


def decode_markdown(result: dict, model_desc: str) -> str:
    """The decode mode's table (--micro: the micro figures, the rows skipped, and each full row's mixed-precision
    steps; else every figure and the segments)."""
    m, bw, runs = result["meta"], result["bandwidth"], [r for r in result["runs"] if "skipped" not in r]
    text = [header(m, model_desc, f"{m['dtype']}, {m['param_bytes'] / 2**20:.0f} MiB of weights; batch {m['batch']}, "
                   f"prompt {m['prompt_len']} (bucket {m['prompt_bucket']}); {m['repeats']} timed runs; layer loop "
                   f"{m['layer_loop']}. Read bandwidth {bw['read'] / 1e9:.1f} GB/s, in-place copy "
                   f"{bw['copy'] / 1e9:.1f} GB/s."), ""]
    if "segments" in result:
        text += table(runs, COLUMNS) + ["", "Marginal decode tokens/s per output-length segment:", ""] + [
            f"- {name}: " + ", ".join(f"{s['from']}-{s['to']}: {num(s['tok_s'])}" for s in segs)
            for name, segs in result["segments"].items()]
        return "\n".join(text) + "\n"
    text += table(runs, {name: COLUMNS[name] for name in MICRO_COLUMNS})
    text += [f"- {label(r)} n={r['output_len']}: skipped ({r['skipped']})" for r in result["runs"] if "skipped" in r]
    for r in (r for r in runs if r.get("kv")):
        text += ["", f"{label(r)} at {r['output_len']} tokens, mixed-precision caches ({r['live_slots_end']} live "
                 f"slots; the 16-bit cache's step {r['step_ms_end']['median']:.2f} ms):", ""]
        text += table(r["kv"], KV_STEP_COLUMNS)
    return "\n".join(text) + "\n"


def aime25_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """--workload aime25: `workload.aime25_workload`, writing results.json / results.md after each method."""
    meta = {"command": args.command, "model_desc": model_desc, "mem_fraction":
            os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "allocator_limit_bytes": (jax.devices()[0].memory_stats() or {}).get("bytes_limit")}

    def write(so_far: dict) -> str:
        """The results so far: a table row per method measured (a method without rows says why), the fits."""
        m = so_far["meta"] | meta | machine(load_start)
        ln, done = m["lengths"], [r for r in so_far["methods"] if r["rows"]]
        text = "\n".join([
            f"AIME25 protocol's shape: {m['model_desc']}, {m['dtype']}, {m['samples']} samples, prompts of "
            f"{m['prompt_len']} tokens, at most {m['total_tokens']} tokens per sample; output lengths log-normal "
            f"(median {m['median']}, sigma {m['sigma']}, seed {ln['seed']}; mean {ln['mean']:.0f}, max {ln['max']}, "
            f"{ln['at_cap']} at the cap, {ln['tokens']} tokens); device {m['device']}; {m['seconds_per_method']:.0f} "
            "s measured per method.", "", *table(done, AIME25_COLUMNS),
            *[f"- {r['label']}: no rows ({r['rows_reason']})" for r in so_far["methods"] if not r["rows"]], "",
            f"Projection: {m['formula']}; slot_reads counted as {m['attention_reads']!r}. Fitted seconds per method "
            "(round_s, step_s, slot_s, event_s):", "",
            *[f"- {r['label']}: " + ", ".join(f"{k} {v:.3g}" for k, v in r["model"].items() if k != "reads")
              + f"; compile {r['compile_s']:.1f} s, plan {r['plan_s']:.1f} s; {len(r['windows'])} windows up to "
              f"{r['windows'][-1]['length']} tokens; schedules match the engine: {r['schedules_match_engine']}"
              for r in done]]) + "\n"
        write_results(args.out, {"meta": m, "methods": so_far["methods"]}, text)
        return text

    try:
        out = wl.aime25_workload(
            bench.model, configs, shape=AIME25_SCALES[args.scale][0] | {"samples": args.samples,
                                                                        "prompt_len": args.prompt_len},
            seconds_per_method=args.seconds, batch=args.batch, seed=args.seed, headroom=args.headroom,
            device_bytes=None if args.device_gb is None else int(args.device_gb * 1e9), queue=args.queue,
            attention_impl=args.attention_impl, layer_loop=args.layer_loop, deadline=args.deadline, on_method=write,
            log=lambda m: print(m, flush=True))
    except ValueError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    print(write(out))
    return 0


def kv_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """--kv-bits, per method and budget at the first --output-lens, a row per setting (its default protection, and
    P = 0 where that protects slots): bytes of a cached token, of the cache and of the program's peak, decode
    tokens/s as `decode_tok_s` (the settings' runs interleaved, `--repeats` rounds: drift hits every setting alike)
    and the share of tokens equal to bf16's."""
    rows, n, cfg = [], args.output_lens[0], bench.model.cfg
    for ev in configs:
        entries = []
        for name in args.kv_bits:
            config, quantized = bench.generate_config(n, name), KVBits.parse(name).quantizes
            protected = generate_tiers(cfg, config, ev, bench.bucket).protected if quantized else None
            variants = [(protected, config)] + ([(0, dataclasses.replace(config, kv_protected=0))] if protected else [])
            for p, c in variants:
                call, info = bench.program(c, ev)
                capacity = generate_tiers(cfg, c, ev, bench.bucket) if quantized else framework.capacity_for(
                    ev, bench.bucket, n)
                prefill = bench.prefill(capacity, ev)
                jax.block_until_ready((call(), prefill()))  # warm-up
                entries.append(dict(call=call, prefill=prefill, totals=[], prefills=[], row={
                    "method": ev.method, "budget": ev.budget if ev.evicts else None, "kv_bits": name, "protected": p,
                    "output_len": n, "slots": getattr(capacity, "virtual_slots", capacity), **info,
                    "token_bytes": token_bytes(cfg.head_dim, c.kv_bits_for(cfg.head_dim), bench.itemsize),
                    "cache_bytes": cache_bytes(jax.eval_shape(prefill)[1])}))
        for _ in range(args.repeats):
            for e in entries:
                e["totals"].append(time_runs(e["call"], 1).median)
                e["prefills"].append(time_runs(e["prefill"], 1).median)
        tokens = [np.asarray(e["call"]().tokens) for e in entries]
        for e, t in zip(entries, tokens, strict=True):
            rate = decode_rate(Stat.of(e["totals"]), Stat.of(e["prefills"]), bench.batch * (n - 1))
            e["row"] |= {"total_s": float(np.median(e["totals"])), "prefill_s": float(np.median(e["prefills"])),
                         "decode_tok_s": None if rate is None else rate.median,
                         "tokens_agree_with_bf16": float((t == tokens[0]).mean())}
        for r, bf16 in ((e["row"], entries[0]["row"]) for e in entries):
            rows.append(r | {"x_bf16_cache": r["cache_bytes"] / bf16["cache_bytes"], "x_bf16_decode": r["decode_tok_s"]
                             / bf16["decode_tok_s"] if r["decode_tok_s"] and bf16["decode_tok_s"] else None})
        release_programs_near_mapping_limit()
    m = machine(load_start) | {"command": args.command, "model": model_desc, "dtype": jnp.dtype(bench.model.dtype).name,
                               "batch": args.batch, "prompt_len": args.prompt_len, "output_len": n,
                               "repeats": args.repeats, "attention_impl": args.attention_impl}
    text = "\n".join([f"# Mixed-precision KV cache: {model_desc}, {m['dtype']}", "", header(
        m, model_desc, f"Batch {args.batch}, prompt {args.prompt_len}, {n} new tokens (greedy), {args.repeats} "
        "interleaved runs per setting (medians)."), "", *table(rows, KV_COLUMNS)]) + "\n"
    print(text)
    write_results(args.out, {"meta": m, "kv": rows}, text)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Check the flags (a bad one: a one-line error, exit 2, before anything compiles), load the model, run the
    mode; the exit status."""
    args = parse_args(argv)
    args.command = " ".join(["python", "-m", "benchmarks.bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        configs = check_args(args)
        dtype = getattr(jnp, args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
        model, model_desc = load_model(args, dtype)
        configs = with_calibration(configs, model, args)
    except ValueError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    if not args.no_compile_cache:  # compile_s is then a compile or a cache load
        enable_compilation_cache(args.compile_cache)
    load_start = os.getloadavg()
    if warning := load_warning(load_start[0]):
        print(f"bench.py: warning: {warning}", file=sys.stderr, flush=True)
    bench = Bench(args, model)
    print(f"device {device_desc()}, load {load_start[0]:.2f}; layer loop {bench.target.layer_loop}", flush=True)
    report = aime25_report if args.workload else kv_report if args.kv_bits and not args.micro else decode_report
    return report(args, bench, model_desc, configs, load_start)


if __name__ == "__main__":
    sys.exit(main())
