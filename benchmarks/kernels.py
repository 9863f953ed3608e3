"""The Pallas kernels against their pure-JAX (XLA) references on the current device, and a sweep of the Triton
decode kernel's launch parameters.

    python -m benchmarks.kernels --batches 1,16 --lengths 1024,4096 --out DIR   # the table
    python -m benchmarks.kernels --sweep-seconds 80 --out DIR                    # the sweep on SWEEP_SHAPES (GPU)

Table: decode attention and the window score, the XLA path against the platform's kernels (Triton on a GPU, Mosaic
on a TPU; on CPU the references only, or with --interpret both families in interpret mode, for checking), each
timed as ONE compiled program of many calls over data past the L2 (`time_op`): ms per call, GB/s, fractions of the
read and copy bandwidth (`timing.bandwidth` over --copy-mib MiB), TFLOP/s of the (compute-bound) window score.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import time
from collections import namedtuple
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.report import num, table, write_results
from benchmarks.timing import DEVICE_PROBE_BYTES, bandwidth, device_desc, time_runs
from pallas_kernels import decode_tuning, get_decode_attention
from pallas_kernels.decode_tuning import DecodeParams, DecodeTuning
from vase_jax.cli import Parser, at_least, comma_list
from vase_jax.eviction.window_score import window_score

# the device check's sweep: Qwen3-14B's heads (group 5) and 8B's (group 4), bf16; batches 128 and 64 in a cache of
# 2112 slots (2048 + the 64-slot buffer)
SWEEP_SHAPES = tuple((b, 8, g, 128, n, "bfloat16", cap) for g in (5, 4)
                     for b, n, cap in ((16, 4096, 0), (16, 16384, 0), (128, 2048, 2112), (64, 2080, 2112)))
L2_BYTES = 64 << 20  # at least an H200's L2 (50 MB): the stacked layers or key copies hold twice this
MAX_LAYERS, MAX_SCORE_COPIES, MIN_CALLS_PER_PASS = 32, 8, 4
TARGET_S, MIN_CALL_S = 0.02, 5e-6  # one timed program; a launch and its latency (no call is estimated shorter)
HEAD_DIM, WINDOW = 128, 64  # Qwen3's head_dim; the eviction score's window queries


# one decode call: `batch` rows, `kv_heads` kv heads of `group` query heads, `slots` used slots of `capacity` (0: slots)
DecodeShape = namedtuple("DecodeShape", "batch kv_heads group head_dim slots dtype capacity", defaults=("bfloat16", 0))


def time_op(op: str, fn: Callable, s: DecodeShape, read_bw: float, on_device: bool, repeats: int,
            fraction: float = 0.5) -> dict:
    """`fn` timed on `s` by one compiled program of passes of `calls` calls, about `TARGET_S` long at `fraction` of
    the read bandwidth (one pass off a device; dispatch and sync paid once): its best of `repeats` runs over its
    calls. "decode": `fn(q, k, v, pos, lengths, layer=l)` over `copies` layers (together 2x the L2: nothing served
    from it), a pass calling it on each in turn (unrolled), each call's output the next call's query; bytes: K, V,
    pos of the used slots, q and the output. "scores": `fn(q, query_valid, keys, valid)` over `copies` copies of the
    keys, each call's first query element shifted by 0 x a score of the previous call; bytes: keys and queries.
    Returns ms per call, GB/s, the fraction of the read bandwidth, copies, and TFLOP/s (scores: q.k per row, key)."""
    slots, size = s.capacity or s.slots, jnp.dtype(s.dtype).itemsize
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    if op == "decode":
        copies = math.ceil(2 * L2_BYTES / (s.batch * s.kv_heads * slots * (2 * s.head_dim * size + 4)))
        copies = int(min(MAX_LAYERS, max(2, copies))) if on_device else 2
        cache = (copies, s.batch, s.kv_heads, slots, s.head_dim)
        x = jax.random.normal(kq, (s.batch, s.kv_heads, s.group, s.head_dim), s.dtype)
        args = (jax.random.normal(kk, cache, s.dtype), jax.random.normal(kv, cache, s.dtype),
                jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), cache[:-1]), jnp.full(s.batch, s.slots, jnp.int32))
        calls, flops = max(copies, MIN_CALLS_PER_PASS) if on_device else copies, 0
        nbytes = s.batch * s.kv_heads * (s.slots * (2 * s.head_dim * size + 4) + 2 * s.group * s.head_dim * size)

        def step(q, c, *kv):
            return fn(q, *kv, layer=c % copies)
    else:
        x = jax.random.normal(kq, (s.batch, s.kv_heads, s.group, WINDOW, s.head_dim), s.dtype)
        keys = jax.random.normal(kk, (s.batch, s.kv_heads, s.slots, s.head_dim), s.dtype)
        copies = calls = int(min(MAX_SCORE_COPIES, max(2, math.ceil(2 * L2_BYTES / keys.nbytes)))) if on_device else 1
        args = ([keys + i for i in range(copies)], jnp.ones((s.batch, WINDOW), bool), jnp.ones(keys.shape[:3], bool))
        nbytes, flops = keys.nbytes + x.nbytes, 2 * s.batch * s.kv_heads * s.group * WINDOW * s.slots * s.head_dim

        def step(q, c, key_list, query_valid, valid):
            return q.at[0, 0, 0, 0, 0].add((fn(q, query_valid, key_list[c], valid)[0, 0, 0] * 0).astype(q.dtype))

    def one_pass(q, *a):
        for c in range(calls):
            q = step(q, c, *a)
        return q

    passes = min(10_000, math.ceil(TARGET_S / calls / max(nbytes / fraction / read_bw, MIN_CALL_S))) if on_device else 1
    program = jax.jit(lambda q, *a: lax.fori_loop(0, passes, lambda _, y: one_pass(y, *a), q))
    sec = time_runs(lambda: program(x, *args), repeats, warmup=1).min / (passes * calls)
    return dict(ms=sec * 1e3, gb_per_s=nbytes / sec / 1e9, fraction_of_read_bw=nbytes / sec / read_bw, copies=copies,
                **({"tflop_per_s": flops / sec / 1e12} if flops else {}))


def sweep_decode(shapes: Sequence, seconds: float, *, candidates: Sequence[tuple] | None = None,
                 read_bw: float | None = None, repeats: int = 3, on_result: Callable[[dict], None] | None = None,
                 log: Callable[[str], None] = print) -> dict:
    """Time `decode_tuning.TABLE` rows of the Triton decode kernel (interpret mode off a GPU) on `shapes` (each a
    `DecodeShape` or its tuple) for about `seconds` (the (head_dim, group, dtype) groups share it in turn; a timing
    begun runs to its end), and per group pick the row of least total time over its shapes. Rows, in order: the
    table's, then `candidates` ((block_size, num_warps, num_stages, programs_per_sm) set in it; default
    `SWEEP_LAUNCHES` x `SWEEP_PROGRAMS_PER_SM`), each launch timed once per shape with its splits explicit (the
    kernel's bound is then 1 block per split: the same splits where rows fill their capacity). `on_result(result)`
    after each timing.
    Returns (JSON-able) device_kind, table_kind, jax, interpret, read_bandwidth_gb_s, seconds, stopped (by the
    budget), shapes: [{shape, timings: [{params, ms, gb_per_s, fraction_of_read_bw, copies} or {params, error}],
    table (the table row's timing), best}], groups: [{key, best (a row), best_ms, table_ms (totals), text}] and
    table_text (the rows to paste)."""
    start, interpret, stopped = time.time(), jax.default_backend() != "gpu", False
    kind, device = decode_tuning.current_device_kind(), jax.devices()[0].device_kind
    sms, shapes = decode_tuning.sm_count(kind), [DecodeShape(*s) for s in shapes]
    read_bw = read_bw or bandwidth(64 << 20 if interpret else DEVICE_PROBE_BYTES)["read"]
    measured = f"swept on {device}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}"
    members, rows = {}, {}  # per (kind, head_dim, group, dtype): its shapes' indices, the table rows to time
    for i, s in enumerate(shapes):
        key = (decode_tuning.device_family(kind), s.head_dim, s.group, s.dtype)
        members.setdefault(key, []).append(i)
        base = decode_tuning.lookup(kind, s.head_dim, s.group, s.dtype)
        rows[key] = list(dict.fromkeys([base] + [dataclasses.replace(
            base, block_size=b, num_warps=w, num_stages=st, programs_per_sm=float(p)) for b, w, st, p in candidates
            or [(*launch, p) for launch in decode_tuning.SWEEP_LAUNCHES for p in decode_tuning.SWEEP_PROGRAMS_PER_SM]]))
    timed: list[dict[DecodeParams, dict]] = [{} for _ in shapes]

    def launch_of(e: DecodeTuning, i: int) -> DecodeParams:  # what row `e` runs shape i with (its split rule)
        splits = e.splits_for(shapes[i].batch, shapes[i].kv_heads, shapes[i].capacity or shapes[i].slots, sms)
        return DecodeParams(e.block_size, splits, e.num_warps, e.num_stages)

    def result() -> dict:
        out = dict(device_kind=device, table_kind=kind, sm_count=sms, jax=jax.__version__, interpret=interpret,
                   read_bandwidth_gb_s=read_bw / 1e9, seconds=time.time() - start, stopped=stopped, shapes=[],
                   groups=[])
        for i, s in enumerate(shapes):
            done = {p: dict(params=p.as_dict(), **r) for p, r in timed[i].items()}
            out["shapes"].append(dict(shape=s._asdict(), timings=list(done.values()), table=done.get(launch_of(
                decode_tuning.lookup(kind, s.head_dim, s.group, s.dtype), i)), best=min(
                (r for r in done.values() if "ms" in r), key=lambda r: r["ms"], default=None)))
        for key, idx in members.items():
            ms = {e: [timed[i].get(launch_of(e, i), {}).get("ms") for i in idx] for e in rows[key]}
            totals = {e: sum(t) for e, t in ms.items() if None not in t}
            best = min(totals, default=None, key=lambda e: (  # a tie (the same launches): the table's split rule
                totals[e], abs(math.log(e.programs_per_sm / rows[key][0].programs_per_sm))))
            mine = num(totals.get(rows[key][0]), ".3f")
            text = best and decode_tuning.entry_text(key, dataclasses.replace(best, measured=measured), (
                f"{totals[best]:.3f} ms over {len(idx)} shapes, the table's row {mine} ms"))
            out["groups"].append(dict(key=list(key), best=best and dataclasses.asdict(best), text=text or "",
                                      best_ms=totals.get(best), table_ms=totals.get(rows[key][0])))
        return dict(out, table_text="\n".join(g["text"] for g in out["groups"] if g["text"]))

    for g, (key, idx) in enumerate(members.items()):
        deadline = time.time() + (start + seconds - time.time()) / (len(members) - g)
        for entry, i in itertools.product(rows[key], idx):
            params = launch_of(entry, i)
            if params in timed[i]:
                continue
            if time.time() >= deadline:
                stopped = True
                break
            launch = {k: getattr(params, k) for k in ("block_size", "num_splits", "num_warps", "num_stages")}
            try:  # the library's Triton path: interpret mode off a GPU
                attend = get_decode_attention("pallas_gpu", **launch)
                r = timed[i][params] = time_op("decode", attend, shapes[i], read_bw, not interpret, repeats)
                log(f"{shapes[i]} {launch}: {r['ms']:.4f} ms, {100 * r['fraction_of_read_bw']:.0f}% of read bw")
            except Exception as e:  # a launch that does not compile or run: recorded, the sweep goes on
                timed[i][params] = dict(error=f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}")
            if on_result:
                on_result(result())
    return result()


def sweep_markdown(r: dict) -> str:
    """Per shape: the table row's and the best launch's time and fraction of the read bandwidth; the rows."""
    def pct(x: dict | None) -> str:
        return num((x or {}).get("fraction_of_read_bw"), ".0f", 100, "%")

    lines = [f"{r['device_kind']} (table kind {r['table_kind']}), jax {r['jax']}, read bandwidth "
             f"{r['read_bandwidth_gb_s']:.0f} GB/s, {r['seconds']:.0f} s{', stopped at its budget' * r['stopped']}", ""]
    lines += table(r["shapes"], {**{k: lambda e, k=k: e["shape"][k] for k in ("batch", "group", "slots", "capacity")},
                                 "table ms": lambda e: num((e["table"] or {}).get("ms"), ".4f"),
                                 "table % of read bw": lambda e: pct(e["table"]),
                                 "best ms": lambda e: num((e["best"] or {}).get("ms"), ".4f"),
                                 "best %": lambda e: pct(e["best"]), "best (block, splits, warps, stages)":
                                 lambda e: tuple(e["best"]["params"].values())[:4] if e["best"] else "-"})
    text = r["table_text"] or "(none: no row was timed on all of a group's shapes)"
    return "\n".join(lines + ["", "Rows for `decode_tuning.TABLE`:", "", "```python", text, "```"]) + "\n"


def main(argv: list[str] | None = None) -> dict:
    start, platform = time.time(), jax.default_backend()
    on_accel = platform in ("gpu", "tpu")
    p = Parser(prog="kernels.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--batches", type=at_least(1, comma_list(int)), default=None, help="default 1,4,16 (CPU: 1,4)")
    a("--lengths", type=at_least(1, comma_list(int)), default=None,
      help="used slots; default 1024,4096,16384,32768 (CPU: 256,1024)")
    a("--kv-heads", type=at_least(1), default=8)
    a("--group", type=at_least(1), default=4, help="query heads per kv head (Qwen3-8B: 4, 14B: 5)")
    a("--dtype", choices=["bfloat16", "float32"], default="bfloat16" if on_accel else "float32")
    a("--repeats", type=at_least(3), default=5, help="runs of each program (>= 3): the best counts")
    a("--interpret", action="store_true", help="on CPU: also run both kernel families in interpret mode")
    a("--copy-mib", type=at_least(1), default=DEVICE_PROBE_BYTES >> 20 if on_accel else 64, help="bandwidth probe MiB")
    a("--sweep-seconds", type=at_least(0, float), default=0.0, help="> 0: instead, `sweep_decode` on SWEEP_SHAPES "
      "(CPU: interpret mode on --batches x --lengths, which must be given) ending about this long after the start")
    a("--out", default=None, help="folder for results.json and results.md")
    args = p.parse_args(argv)
    explicit = args.batches is not None or args.lengths is not None
    shapes = [DecodeShape(b, args.kv_heads, args.group, HEAD_DIM, n, args.dtype)
              for b in args.batches or ([1, 4, 16] if on_accel else [1, 4])
              for n in args.lengths or ([1024, 4096, 16384, 32768] if on_accel else [256, 1024])]
    if args.sweep_seconds and (platform == "tpu" or platform == "cpu" and not explicit):
        p.error("--sweep-seconds times the Triton kernel: on a GPU, or on CPU with tiny --batches and --lengths")

    bw = bandwidth(args.copy_mib << 20, args.repeats)
    read_bw, copy_bw = bw["read"], bw["copy"]
    print(f"device: {device_desc()}, jax {jax.__version__}; bandwidth over "
          f"{args.copy_mib} MiB: read {read_bw / 1e9:.1f} GB/s, copy {copy_bw / 1e9:.1f} GB/s", flush=True)
    if args.sweep_seconds:
        result = sweep_decode(shapes if explicit else SWEEP_SHAPES, start + args.sweep_seconds - time.time(),
                              read_bw=read_bw, repeats=args.repeats, log=lambda m: print(m, flush=True),
                              on_result=lambda r: write_results(args.out, r, sweep_markdown(r)))
        write_results(args.out, result, text := sweep_markdown(result))
        print(text)
        return result

    meta = dict(vars(args), device=jax.devices()[0].device_kind, backend=platform, jax=jax.__version__,
                head_dim=HEAD_DIM, window=WINDOW, read_bandwidth_gb_per_s=read_bw / 1e9,
                copy_bandwidth_gb_per_s=copy_bw / 1e9, interpret=args.interpret and not on_accel)
    rows: list[dict] = []
    cols = {**{k: lambda r, k=k: r[k] for k in ("op", "impl", "batch", "length")}, "ms": lambda r: f"{r['ms']:.4f}",
            "GB/s": lambda r: f"{r['gb_per_s']:.0f}", **{f"% of {k} bw": lambda r, k=k: num(
                r[f"fraction_of_{k}_bw"], ".0f", 100, "%") for k in ("read", "copy")},
            "TFLOP/s": lambda r: num(r.get("tflop_per_s"), ".1f")}
    # the XLA path, then the platform's kernels as the library calls them (off a GPU or TPU: interpret mode)
    impls = {"gpu": ["pallas_gpu"], "tpu": ["pallas_tpu"]}.get(platform, ["pallas_gpu", "pallas_tpu"] * args.interpret)
    for s, op, impl in itertools.product(shapes, ("decode", "scores"), ["xla", *impls]):
        fn = get_decode_attention(impl) if op == "decode" else functools.partial(window_score, impl=impl)
        fraction = 0.02 if impl == "xla" else 0.5 if op == "decode" else 0.3  # XLA: 1.5% of an H200's read bw
        t = time_op(op, fn, s, read_bw, on_accel, args.repeats, fraction)
        rows.append(dict(op=op, impl=impl, batch=s.batch, length=s.slots, **t,
                         fraction_of_copy_bw=t["gb_per_s"] * 1e9 / copy_bw))
        print(table([rows[-1]], cols)[-1], flush=True)  # written as they come: a stopped run keeps its rows
        write_results(args.out, dict(meta=meta, results=rows), "\n".join(table(rows, cols)) + "\n")
    return dict(meta=meta, results=rows)


if __name__ == "__main__":
    main()
