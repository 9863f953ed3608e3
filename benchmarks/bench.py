"""Decode speed, memory and cost of `vase_jax.generate` per eviction method, budget, output length and cache
setting, against a memory-bandwidth roofline:

    python -m benchmarks.bench --model small --batch 2 --output-lens 2048,8192 --budgets 1024 --out bench_long

--kv-bits adds a row per mixed-precision cache (and `full`'s step on each); --micro times the pieces alone (a decode
step, an eviction event), no `generate`; --workload aime25 measures and projects the AIME25 protocol (--scale tiny:
its CPU copy). `--model`: a hub id, an HF folder or a named random model (`random_model.named_or_pretrained`, shrunk
by --layers, --vocab, --hidden, --intermediate). Generations are greedy and fixed-length. How each figure is obtained:
docs/BENCHMARKS.md, "How the figures are obtained"."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
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
from benchmarks.report import names, num, spread, table, write_results
from benchmarks.timing import bandwidth, decode_rate, device_desc, load_warning, machine, time_turns
from vase_jax import planner
from vase_jax.cache import cache_bytes
from vase_jax.cli import Parser, at_least, checked, comma_list
from vase_jax.eviction import METHODS, EvictionConfig, framework
from vase_jax.generate import MIN_PREFILL_CHUNK, generate_target, generate_tiers, query_window
from vase_jax.jit import enable_compilation_cache, release_programs_near_mapping_limit
from vase_jax.kvquant import BF16, KVBits, kv_name, token_bytes
from vase_jax.random_model import named_or_pretrained

PAPER_METHODS = ("full", "snapkv", "rkv", "curdkv", "vase_attnv", "vase_dkv")
DEFAULTS = {"model": "qwen3-0.6b", "prompt_len": 128, "methods": "full,vase_attnv,vase_dkv", "budgets": [512],
            "buffer": 64, "batch": 4}
# --workload aime25 --scale S: the protocol's shape and S's defaults (before DEFAULTS; flags given win)
AIME25_SCALES = {"protocol": (wl.AIME25, {"model": "qwen3-14b", "dtype": "bfloat16", "budgets": [2048]}),
                 "tiny": (wl.AIME25_TINY, {"model": "tiny-1k", "budgets": [32], "buffer": 8, "batch": 6})}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, each checked by its type; `check_args` checks what spans flags."""
    p = Parser(prog="bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a, positive, above_0 = p.add_argument, at_least(1), checked(float, lambda v: v > 0, "must be > 0")
    a("--model", help="hub id, HF folder or named random model (default qwen3-0.6b; aime25: qwen3-14b, tiny-1k)")
    for name in ("layers", "vocab", "hidden", "intermediate"):
        a(f"--{name}", type=int, help=f"named random models: {name} (heads unchanged)")
    a("--dtype", choices=("float32", "bfloat16"), help="default: float32 (CPU), bfloat16 (GPU)")
    a("--batch", type=positive, help="rows (default 4; aime25: the most that fit the device, per method)")
    a("--prompt-len", type=positive, help="random prompt tokens per row (default 128; aime25: 256)")
    a("--output-lens", type=at_least(2, comma_list(int)), default=[1024], help="comma list: new tokens per row")
    a("--methods", help="comma list of full and eviction METHODS (default full,vase_attnv,vase_dkv), paper or all")
    a("--budgets", type=at_least(1, comma_list(int)), help="comma list of budgets N (default 512, aime25: 2048)")
    a("--buffer", type=int, help="buffer B, the eviction period (default 64)")
    a("--prefill-chunk", type=checked(int, lambda v: v == 0 or v >= MIN_PREFILL_CHUNK, f"0 (dense) or >= "
      f"{MIN_PREFILL_CHUNK}"), default=vj.GenerateConfig.prefill_chunk, help="GenerateConfig.prefill_chunk; 0: dense")
    a("--no-batch-invariant", action="store_true", help="GenerateConfig.batch_invariant=False (the invariance's cost)")
    a("--repeats", type=at_least(3), default=3, help="timed runs per figure")
    a("--warmup", type=at_least(0), default=1, help="untimed runs after compiling, before the timed ones")
    a("--micro-steps", type=positive, default=8, help="decode steps per micro-benchmark call")
    a("--bandwidth-mib", type=positive, default=512, help="array size of the bandwidth measurement")
    a("--micro", action="store_true", help="a step at each run's last length and an eviction event alone, no generate")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--kv-bits", type=comma_list(str), help="comma list of caches: bf16, K8V8, K4V4, K<b>V<b>g<g>")
    mode.add_argument("--workload", choices=("aime25",), help="the AIME25 protocol, measured and projected")
    a("--scale", choices=tuple(AIME25_SCALES), default="protocol", help="aime25: the protocol or its CPU copy")
    a("--seconds", type=above_0, default=120.0, help="aime25: measuring seconds per method (plan, compile on top)")
    a("--deadline", type=float, help="aime25, --micro: when the measuring ends (seconds since the epoch)")
    a("--device-gb", type=above_0, help="aime25: device GB the batch must fit (default: the allocator's limit)")
    a("--out", help="folder for results.json and results.md")
    a("--no-compile-cache", action="store_true", help="no persistent compilation cache (default ~/.cache/vase-jax/xla)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> list[EvictionConfig]:
    """The checks that span flags (ValueError naming the flag), the defaults filled in (--workload aime25: its
    scale's); returns the configurations (one that takes a calibration is validated with the model)."""
    shape, scale = AIME25_SCALES[args.scale] if args.workload else (None, {})
    if args.workload and args.micro:
        raise ValueError("--micro is the decode mode's: drop --workload")
    if not args.workload and args.scale != "protocol":
        raise ValueError("--scale applies to --workload aime25")
    if shape:
        scale = scale | {"methods": "vase_dkv,vase_attnv,full", "prompt_len": shape["prompt_len"]}
    defaults = DEFAULTS | scale
    if shape and (args.device_gb is not None or "batch" not in scale):
        del defaults["batch"]  # aime25's batch, unless its scale gives one: the most that fit (the device, --device-gb)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if shape and args.prompt_len + 2 > shape["total_tokens"]:
        raise ValueError(f"--prompt-len={args.prompt_len}: a sample holds {shape['total_tokens']} tokens at most")
    args.output_lens = sorted(set(args.output_lens))
    if args.kv_bits:  # canonical names, the 16-bit cache's first
        args.kv_bits = list(dict.fromkeys([BF16, *map(kv_name, args.kv_bits)]))
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    names = list(dict.fromkeys({"paper": PAPER_METHODS, "all": ["full", *sorted(METHODS)]}.get(",".join(names),
                                                                                                  names)))
    if not names or set(names) - {"full", *METHODS}:
        raise ValueError(f"--methods: unknown {sorted(set(names) - {'full', *METHODS}) or names}; known: full, "
                         f"{', '.join(sorted(METHODS))}")
    configs = [EvictionConfig(m, buffer=args.buffer) if m == "full" else EvictionConfig(m, budget=n, buffer=args.buffer)
               for m in names for n in ([None] if m == "full" else args.budgets)]  # full: B, the tiers' period
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


def row(ev: EvictionConfig, n: int, kv_bits: str = BF16, protected: int | None = None) -> dict:
    """What names a decode-mode row: its label ("full", "vase_dkv@2048", on a mixed-precision cache "full K4V4
    P=544"), method, budget, buffer, output length, cache setting and its 16-bit slots P."""
    setting = "" if kv_bits == BF16 else f" {kv_bits} P={protected}"
    return names(ev) | {"label": ev.label + setting, "output_len": n, "kv_bits": kv_bits, "protected": protected}


# ---- measurements ------------------------------------------------------------------------------------------
class Bench:
    """What every measurement shares: the arguments, the model split for jit, the prompt, memoized figures."""

    def __init__(self, args: argparse.Namespace, model: vj.Qwen3):
        self.args, self.model = args, model
        self.graphdef, self.state = nnx.split(model)
        self.step_ms, self.evict_ms = functools.cache(self._step_ms), functools.cache(self._evict_ms)  # once each
        self.target = generate_target(model, self.generate_config(1))  # as generate picks it
        # [batch, bucket] int32: the prompt left-padded as generate pads it (the prefill's input); `raw`: the
        # unpadded prompt generate gets (its padding sets the cache's capacity)
        self.ids, self.mask = ds.random_prompt(model.cfg.vocab_size, args.batch or 1, args.prompt_len,
                                               self.generate_config(2))
        self.raw = (self.ids[:, -args.prompt_len:], self.mask[:, -args.prompt_len:])
        self.key, self.itemsize = jax.random.key(0), jnp.dtype(model.dtype).itemsize
        self.batch, self.bucket = self.ids.shape

    def generate_config(self, n: int, kv_bits: str = BF16, protected: int | None = None) -> vj.GenerateConfig:
        """The runs' settings for `n` new tokens, the cache at `kv_bits` (a `KVBits` name) with `protected` 16-bit
        slots (None: the default)."""
        a, kv = self.args, KVBits.parse(kv_bits)
        return vj.GenerateConfig(max_new_tokens=n, temperature=0.0, eos_token_ids=(), pad_token_id=0,
                                 prefill_chunk=a.prefill_chunk or None, batch_invariant=not a.no_batch_invariant,
                                 key_bits=kv.key_bits, value_bits=kv.value_bits, kv_group=kv.key_group,
                                 kv_refine=kv.refine, kv_protected=protected)

    def capacity(self, ev: EvictionConfig, config: vj.GenerateConfig):
        """The cache `generate` allocates for `config`: its slots, or a mixed-precision cache's tier layout."""
        if config.kv_bits.quantizes:
            return generate_tiers(self.model.cfg, config, ev, self.bucket)
        return framework.capacity_for(ev, self.bucket, config.max_new_tokens)

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

    @functools.cached_property
    def bandwidth(self) -> dict[str, float]:
        """The device's read and copy bandwidth (`timing.bandwidth` over --bandwidth-mib), measured once, at the
        first `micro`: after the first `generate` run, whose device peak its array thus leaves alone."""
        return bandwidth(self.args.bandwidth_mib << 20, self.args.repeats)

    def _step_ms(self, capacity: int, window: int, length: int, state: tuple = ()) -> dict:
        """Per-step milliseconds of `decode_steps` from `length` live slots (`step_ms`: memoized); `state`: the
        policy's per-slot state arrays (their update is part of the step)."""
        a = self.args
        cache = ds.filled_cache(self.model.cfg, self.batch, capacity, length, window, self.model.dtype, state=state,
                                target=self.target)
        return ds.step_ms(self.graphdef, self.state, cache, jnp.int32(length), a.micro_steps, a.repeats, "auto",
                          self.target).as_dict()

    def _evict_ms(self, ev: EvictionConfig, capacity: int) -> dict:
        """Milliseconds of one eviction event on a full cache (`evict_ms`: memoized)."""
        a = self.args
        cache = ds.filled_cache(self.model.cfg, self.batch, capacity, ev.budget + ev.buffer, query_window(ev),
                                self.model.dtype, state=framework.slot_state(ev), target=self.target)
        return ds.evict_ms(cache, ev, max(a.repeats, 5)).as_dict()

    def micro(self, ev: EvictionConfig, n: int) -> dict:
        """The figures of one (method, budget, output length) that time pieces of `generate` alone on the 16-bit
        cache: a decode step on a cache filled to the run's last length, one eviction event, tokens/s of those steps
        (the eviction amortized over B steps); the bytes a step reads (`decode_step.roofline` of the replayed run)
        and the tokens/s they allow at the read bandwidth, over the run (batch * bw / mean bytes) and at its end (the
        eviction amortized); with --kv-bits, `full`'s step on each mixed-precision cache (`tiered_step`)."""
        b, a, read_bw = self.batch, self.args, self.bandwidth["read"]
        capacity, window, state = framework.capacity_for(ev, self.bucket, n), query_window(ev), framework.slot_state(ev)
        reads, after, triggers = ds.row_replay(ev, a.prompt_len, n - 1)
        live = max(1, min(int(reads[-1]) - 1, capacity - a.micro_steps))  # a call appends --micro-steps slots
        step = self.step_ms(capacity, window, live, state)
        evict = self.evict_ms(ev, capacity) if ev.evicts else None
        evict_ms = evict["median"] if evict else 0.0
        tok_s_end, roof = b / (step["median"] + evict_ms / ev.buffer) * 1e3, ds.roofline(
            self.model, ev, reads, len(triggers), b, self.itemsize)
        roof["bound_tok_s"] = b * read_bw / roof["bytes_step_mean"]
        roof["bound_tok_s_end"] = b * read_bw / (roof["bytes_step_end"] + roof["bytes_per_eviction"] / ev.buffer)
        roof["achieved_over_bound_end"] = tok_s_end / roof["bound_tok_s_end"]
        r = row(ev, n) | {
            "capacity": capacity, "live_slots_end": live, "step_ms_end": step, "evict_ms": evict,
            "tok_s_end": tok_s_end, "eviction_share": evict_ms / (ev.buffer * step["median"]) if evict else None,
            "evictions_expected": len(triggers), "cache_length_expected": int(after[-1]), "roofline": roof}
        kv = [self.tiered_step(ev, name, n, live, step["median"]) for name in a.kv_bits or ()
              if not ev.evicts and KVBits.parse(name).quantizes]
        return r | ({"kv": kv} if kv else {})

    def tiered_step(self, ev: EvictionConfig, name: str, n: int, live: int, bf16_step_ms: float) -> dict:
        """`full`'s decode step from `live` tokens on a mixed-precision cache of setting `name` (its default
        protection) against the 16-bit cache's; the bytes it reads: weights, 16-bit slots, quantized ones."""
        cfg, config = self.model.cfg, self.generate_config(n, name)
        layout = self.capacity(ev, config)
        cache = ds.filled_tiered_cache(cfg, self.batch, layout, live, 0, self.model.dtype, target=self.target)
        ms = ds.step_ms(self.graphdef, self.state, cache, None, self.args.micro_steps, self.args.repeats, "auto",
                        self.target).median
        n16, per_slot = min(live, layout.protected + layout.buffer), ds.slot_bytes(cfg, self.batch, self.itemsize)
        quantized = per_slot * token_bytes(cfg.head_dim, config.kv_bits_for(cfg.head_dim), self.itemsize) / (
            token_bytes(cfg.head_dim, KVBits(), self.itemsize))
        return {"kv_bits": name, "protected": layout.protected, "quantized_slots": live - n16, "step_ms": ms,
                "x_bf16_step": ms / bf16_step_ms, "tok_s": self.batch / ms * 1e3, "bytes_per_step":
                ds.weight_bytes_per_step(self.model) + n16 * per_slot + (live - n16) * quantized}

    def run(self, ev: EvictionConfig, n: int) -> list[dict]:
        """Every figure of one (method, budget, output length), a row per cache setting: the 16-bit cache, then each
        of --kv-bits at its default 16-bit slots P and, where that protects slots, at P = 0. `generate` compiled,
        and its prefill alone, timed in --repeats rounds that take the settings in turn (drift hits each alike);
        the 16-bit row with `micro`'s figures; each row's bytes and decode tokens/s against the 16-bit cache's,
        and the share of its tokens equal to the 16-bit cache's."""
        cfg, rows, calls, settings = self.model.cfg, [], [], []
        for name in self.args.kv_bits or [BF16]:
            config = self.generate_config(n, name)
            default = self.capacity(ev, config).protected if config.kv_bits.quantizes else None
            settings += [(name, default)] + ([(name, 0)] if default else [])
        for name, protected in settings:
            config = self.generate_config(n, name, protected)
            call, info = self.program(config, ev)
            prefill = functools.partial(ds.prefill, self.graphdef, self.state, self.ids, self.mask,  # generate's own
                                        self.capacity(ev, config), query_window(ev), "auto", framework.slot_state(ev),
                                        self.target, self.args.prefill_chunk or None)
            rows.append(row(ev, n, name, protected) | info | {
                "cache_bytes": cache_bytes(jax.block_until_ready(prefill())[1]),  # and the prefill compiled
                "token_bytes": token_bytes(cfg.head_dim, config.kv_bits_for(cfg.head_dim), self.itemsize)})
            calls += [call, lambda prefill=prefill: prefill()[0]]  # its token: no cache held between calls
        stats, outputs = time_turns(calls, self.args.repeats, self.args.warmup)
        totals, prefills, outputs = stats[::2], stats[1::2], outputs[::2]
        rates = [decode_rate(t, p, self.batch * (n - 1)) for t, p in zip(totals, prefills, strict=True)]
        for r, total, prefill_s, rate, out in zip(rows, totals, prefills, rates, outputs, strict=True):
            r |= {"total_s": total.as_dict(), "prefill_s": prefill_s.as_dict(), "decode_tok_s": rate and rate.as_dict(),
                  "evictions": int(out.evictions), "cache_length_end": int(out.cache_length.max()),
                  "tokens_agree_with_bf16": float((np.asarray(out.tokens) == np.asarray(outputs[0].tokens)).mean()),
                  "x_bf16_cache": r["cache_bytes"] / rows[0]["cache_bytes"],
                  "x_bf16_decode": rate and rates[0] and rate.median / rates[0].median,
                  "device_peak_bytes": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")}
        bf16, decode_s = rows[0] | self.micro(ev, n), rates[0] and self.batch * (n - 1) / rates[0].median
        evict_s = bf16["evictions_expected"] * (bf16["evict_ms"] or {"median": 0.0})["median"] / 1e3
        bf16["evict_overhead"] = decode_s and evict_s / decode_s  # of the decode time: events x an event's seconds
        bf16["roofline"]["achieved_over_bound"] = rates[0] and rates[0].median / bf16["roofline"]["bound_tok_s"]
        return [bf16, *rows[1:]]


# ---- the modes: each writes results.json and results.md under --out -----------------------------------------
def col(key: str, spec: str = ".1f", scale: float = 1.0, suffix: str = "") -> Callable[[dict], object]:
    """A table column: a row's figure at `key` ("a.b": nested) as "median [min-max]" for a `Stat` dict, `num` for a
    number or None (times `scale`, in `spec`, then `suffix`; a figure the row lacks: "-"), as it is otherwise."""
    def cell(r: dict) -> object:
        v = functools.reduce(lambda d, k: (d or {}).get(k), key.split("."), r)
        return (spread(v, scale, spec) if isinstance(v, dict) else num(v, spec, scale, suffix)
                if v is None or isinstance(v, int | float) else v)

    return cell


COLUMNS = {  # the decode mode's table; `columns` picks them per mode
    "method": col("label"), "out len": col("output_len", ".0f"), "live slots": col("live_slots_end", ".0f"),
    "decode tok/s med [min-max]": col("decode_tok_s"), "tok/s end": col("tok_s_end"),
    "step ms end": col("step_ms_end", ".2f"), "prefill ms": col("prefill_s", ".1f", 1e3), "compile s": col("compile_s"),
    "evict ms/event": col("evict_ms", ".2f"), "event / (B steps)": col("eviction_share", ".1f", 100, "%"),
    "events": col("evictions", ".0f"), "evict overhead": col("evict_overhead", ".1f", 100, "%"),
    "cache MiB": col("cache_bytes", ".2f", 2**-20), "program MiB": col("program_bytes", ".1f", 2**-20),
    "bound tok/s": col("roofline.bound_tok_s"), "achieved/bound": col("roofline.achieved_over_bound", ".2f"),
    "bound tok/s end": col("roofline.bound_tok_s_end", ".0f"),
    "achieved/bound end": col("roofline.achieved_over_bound_end", ".2f"),
    "bytes/token (K+V, one kv head)": col("token_bytes", ".0f"), "cache x bf16": col("x_bf16_cache", ".3f"),
    "decode x bf16": col("x_bf16_decode", ".2f", suffix="x"),
    "tokens = bf16": col("tokens_agree_with_bf16", ".0f", 100, "%")}
MICRO_COLUMNS = ("method", "out len", "live slots", "step ms end", "evict ms/event", "event / (B steps)",
                 "tok/s end", "bound tok/s end", "achieved/bound end")
KV_COLUMNS = ("bytes/token (K+V, one kv head)", "cache x bf16", "decode x bf16", "tokens = bf16")
AIME25_COLUMNS = {
    "method": col("label"), "rows": col("rows", ".0f"), "step ms": col("protocol.step_ms", ".2f"),
    "window tok/s": col("window_tok_s", ".0f"),
    "check s (predicted)": lambda r: f"{r['check']['seconds']:.2f} ({r['check']['predicted_s']:.2f})",
    "steps": col("protocol.steps", ".0f"), "utilization": col("protocol.utilization", ".2f"),
    "tok/s": col("protocol.tok_s", ".0f"), "projected wall": col("protocol.seconds", ".1f", 1 / 60, " min"),
    "peak GiB": col("peak_bytes", ".2f", 2**-30), "planned GiB": col("plan.total", ".2f", 2**-30),
    "rows because": col("rows_reason")}


def columns(meta: dict) -> dict[str, Callable[[dict], object]]:
    """The decode mode's columns: --micro's; else all but the mixed-precision ones, which come with --kv-bits."""
    names = MICRO_COLUMNS if meta["micro"] else [c for c in COLUMNS if meta["kv_bits"] or c not in KV_COLUMNS]
    return {name: COLUMNS[name] for name in names}


def decode_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """The default mode: `Bench.run` per method, budget and output length. --micro: `Bench.micro` alone, the
    longest output length first, the results written after every row, rows past --deadline skipped."""
    model, micro = bench.model, args.micro
    meta = vars(args) | {"model": model_desc, "config": dataclasses.asdict(model.cfg), "prompt_bucket": bench.bucket,
                         "dtype": jnp.dtype(model.dtype).name, "param_bytes": ds.param_bytes(model),
                         "layer_loop": bench.target.layer_loop}
    result: dict = {"meta": meta, "runs": []}

    def write() -> str:
        result.update(meta=meta | machine(load_start), bandwidth=bench.bandwidth)
        write_results(args.out, result, text := decode_markdown(result, model_desc))
        return text

    for n, ev in ([(n, ev) for n in args.output_lens[::-1] for ev in configs] if micro else
                  [(n, ev) for ev in configs for n in args.output_lens]):
        if micro and args.deadline is not None and time.time() > args.deadline:
            result["runs"].append(row(ev, n) | {"skipped": "deadline"})
            continue
        rows = [bench.micro(ev, n)] if micro else bench.run(ev, n)
        result["runs"] += rows
        release_programs_near_mapping_limit()  # XLA:CPU crashes at the process's mapping limit
        print("\n".join(table(rows, columns(meta))[2:]), flush=True)  # the table's rows
        if micro:
            write()
    print(write())
    return 0


def decode_markdown(result: dict, model_desc: str) -> str:
    """The decode mode's table (`columns`), the rows skipped and `full`'s steps on the mixed-precision caches
    (--kv-bits)."""
    m, bw = result["meta"], result["bandwidth"]
    runs = [r for r in result["runs"] if "skipped" not in r]
    text = [f"Command: `{m['command']}`", "",
            f"Machine: {m['device']}, {m['cpu_model']}, {m['cpu_count']} CPUs, jax {m['jax']}; load average (1, 5, "
            f"15 min) at start {m['load_start']}, at end {m['load_end']}"
            + (f" (**{m['load_warning']}**)" if m["load_warning"] else "")
            + f". Model: {model_desc}, {m['dtype']}, {m['param_bytes'] / 2**20:.0f} MiB of weights; batch "
            f"{m['batch']}, prompt {m['prompt_len']} (bucket {m['prompt_bucket']}); {m['repeats']} timed runs "
            f"(settings in turns); layer loop {m['layer_loop']}. Read bandwidth {bw['read'] / 1e9:.1f} GB/s, "
            f"in-place copy {bw['copy'] / 1e9:.1f} GB/s.", "", *table(runs, columns(m))]
    text += [f"- {r['label']} n={r['output_len']}: skipped ({r['skipped']})" for r in result["runs"] if "skipped" in r]
    steps = [(r, kv) for r in runs for kv in r.get("kv", [])]
    text += [""] * bool(steps) + [
        f"- {r['label']} at {r['output_len']} tokens on {kv['kv_bits']} (P = {kv['protected']}, "
        f"{kv['quantized_slots']} of {r['live_slots_end']} live slots quantized): step {kv['step_ms']:.2f} ms, "
        f"{kv['x_bf16_step']:.2f}x the 16-bit cache's, {kv['bytes_per_step'] / 1e6:.1f} MB read" for r, kv in steps]
    return "\n".join(text) + "\n"


def aime25_report(args, bench: Bench, model_desc: str, configs: list[EvictionConfig], load_start) -> int:
    """--workload aime25: `workload.aime25_workload`, writing results.json / results.md after each method."""
    def write(so_far: dict) -> str:
        """The results so far: a table row per method measured (a method without rows says why), the projection."""
        m = so_far["meta"] | {"command": args.command, "model_desc": model_desc} | machine(load_start)
        ln, done = m["lengths"], [r for r in so_far["methods"] if r["rows"]]
        text = "\n".join([
            f"AIME25 protocol's shape: {model_desc}, {m['dtype']}, {m['samples']} samples, prompts of "
            f"{m['prompt_len']} tokens, at most {m['total_tokens']} tokens per sample; output lengths log-normal "
            f"(median {m['median']}, sigma {m['sigma']}, seed {ln['seed']}; mean {ln['mean']:.0f}, max {ln['max']}, "
            f"{ln['at_cap']} at the cap, {ln['tokens']} tokens); device {m['device']}; {m['seconds_per_method']:.0f} "
            "s measured per method.", "", *table(done, AIME25_COLUMNS),
            *[f"- {r['label']}: no rows ({r['rows_reason']})" for r in so_far["methods"] if not r["rows"]], "",
            f"Projection: {m['formula']}; slot_reads counted as {m['attention_reads']!r}. The fitted seconds, the "
            "windows, the compile and plan times: results.json."]) + "\n"
        write_results(args.out, {"meta": m, "methods": so_far["methods"]}, text)
        return text

    try:
        out = wl.aime25_workload(
            bench.model, configs, shape=AIME25_SCALES[args.scale][0] | {"prompt_len": args.prompt_len},
            seconds_per_method=args.seconds, batch=args.batch,
            device_bytes=None if args.device_gb is None else int(args.device_gb * 1e9), deadline=args.deadline,
            on_method=write, log=lambda m: print(m, flush=True))
    except ValueError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    print(write(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Check the flags (a bad one: a one-line error, exit 2, before anything compiles), load the model, run the
    mode; the exit status."""
    args = parse_args(argv)
    args.command = " ".join(["python", "-m", "benchmarks.bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        configs = check_args(args)
        dtype = getattr(jnp, args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
        model, model_desc = named_or_pretrained(args.model, dtype, layers=args.layers, vocab=args.vocab,
                                                hidden=args.hidden, intermediate=args.intermediate)
        configs = with_calibration(configs, model, args)
    except ValueError as e:
        print(f"bench.py: error: {e}", file=sys.stderr)
        return 2
    if not args.no_compile_cache:  # compile_s is then a compile or a cache load
        enable_compilation_cache()
    load_start = os.getloadavg()
    if warning := load_warning(load_start[0]):
        print(f"bench.py: warning: {warning}", file=sys.stderr, flush=True)
    bench = Bench(args, model)
    print(f"device {device_desc()}, load {load_start[0]:.2f}; layer loop {bench.target.layer_loop}", flush=True)
    report = aime25_report if args.workload else decode_report
    return report(args, bench, model_desc, configs, load_start)


if __name__ == "__main__":
    sys.exit(main())
