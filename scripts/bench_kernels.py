"""Time the Pallas kernels against their pure-JAX references on the current device.

For each batch size and cache length: decode attention (one query token per row over `length` cache slots) and
the VaSE window-attention score (a window of queries over `length` candidates). Each timing is the median of
`--repeats` runs after `--warmup` runs, each ended by `block_until_ready`. Achieved bandwidth is the bytes the
operation must read at least once (decode: K and V and pos of the used slots; scores: the keys and the window
queries) divided by the time, printed next to the device's copy bandwidth measured here with a large array
copy ((read + write) bytes / time).

On CPU only the references run, unless `--interpret` is given (then the kernels run through the Pallas
interpreter: very slow, for checking only).

    python scripts/bench_kernels.py                     # small defaults on CPU, full sweep on GPU
    python scripts/bench_kernels.py --lengths 1024,8192 --batches 1,8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.eviction_scores import window_scores, window_scores_reference


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def time_fn(fn, args, *, warmup: int, repeats: int) -> float:
    """Median wall time in seconds of fn(*args), synchronized with block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int, *, warmup: int, repeats: int) -> float:
    """Device copy bandwidth in bytes/s: (read + write) bytes of `x + 1` over a large float32 array.

    The input is donated, so each run rewrites the same buffer (no fresh allocation, no page faults)."""
    fn = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    size = x.nbytes
    for _ in range(warmup + 1):
        x = jax.block_until_ready(fn(x))
    times = []
    for _ in range(max(repeats, 3)):
        start = time.perf_counter()
        x = jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return 2 * size / statistics.median(times)


def decode_case(batch, length, args, dtype, key):
    capacity = max(args.capacity, length)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, args.kv_heads, args.group, args.head_dim), dtype)
    k = jax.random.normal(kk, (batch, args.kv_heads, capacity, args.head_dim), dtype)
    v = jax.random.normal(kv, (batch, args.kv_heads, capacity, args.head_dim), dtype)
    pos = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (batch, args.kv_heads, capacity))
    n = jnp.int32(length)
    itemsize = jnp.dtype(dtype).itemsize
    num_bytes = batch * args.kv_heads * length * (2 * args.head_dim * itemsize + 4) + q.nbytes
    return (q, k, v, pos, n), num_bytes


def scores_case(batch, length, args, dtype, key):
    kq, kk = jax.random.split(key)
    queries = jax.random.normal(kq, (batch, args.kv_heads, args.group, args.window, args.head_dim), dtype)
    keys = jax.random.normal(kk, (batch, args.kv_heads, length, args.head_dim), dtype)
    valid = jnp.ones((batch, args.kv_heads, length), bool)
    query_valid = jnp.ones((batch, args.window), bool)
    return (queries, keys, valid, query_valid), keys.nbytes + queries.nbytes


def main(argv=None) -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", type=_ints, default=[1024, 4096, 8192, 16384, 32768] if on_gpu else [1024, 4096]
    )
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16] if on_gpu else [1, 4])
    parser.add_argument("--capacity", type=int, default=0, help="cache capacity (default: the length itself)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=2, help="query heads per kv head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=64, help="window queries of the eviction score")
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16" if on_gpu else "float32"
    )
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--num-splits", type=int, default=16)
    parser.add_argument("--which", default="decode,scores", help="comma list of: decode, scores")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--interpret", action="store_true", help="off GPU: also run the kernels in interpret mode"
    )
    parser.add_argument("--copy-mib", type=int, default=1024 if on_gpu else 256)
    parser.add_argument("--json", dest="json_out", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats} must be >= 3")

    dtype = jnp.dtype(args.dtype)
    run_kernels = on_gpu or args.interpret
    interpret = not on_gpu
    bw = copy_bandwidth(args.copy_mib << 20, warmup=args.warmup, repeats=args.repeats)
    device = jax.devices()[0]
    print(
        f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, dtype {args.dtype}"
    )
    print(f"copy bandwidth: {bw / 1e9:.1f} GB/s ((read + write) bytes of a {args.copy_mib} MiB float32 copy)")

    impls = {
        "decode": [
            ("xla", jax.jit(lambda *a: decode_attention_reference(*a, block_size=args.block_size))),
            (
                "pallas",
                jax.jit(
                    lambda *a: decode_attention(
                        *a, block_size=args.block_size, num_splits=args.num_splits, interpret=interpret
                    )
                ),
            ),
        ],
        "scores": [
            ("xla", jax.jit(window_scores_reference)),
            ("pallas", jax.jit(lambda *a: window_scores(*a, interpret=interpret))),
        ],
    }
    makers = {"decode": decode_case, "scores": scores_case}
    rows = []
    header = f"{'op':<7} {'impl':<7} {'batch':>5} {'length':>7} {'ms':>9} {'GB/s':>8} {'% copy bw':>9}"
    print(header)
    print("-" * len(header))
    key = jax.random.key(0)
    for op in [w for w in args.which.split(",") if w]:
        if op not in makers:
            parser.error(f"--which has {op!r}; allowed: decode, scores")
        for batch in args.batches:
            for length in args.lengths:
                inputs, num_bytes = makers[op](batch, length, args, dtype, key)
                for impl, fn in impls[op]:
                    if impl == "pallas" and not run_kernels:
                        continue
                    seconds = time_fn(fn, inputs, warmup=args.warmup, repeats=args.repeats)
                    gbs = num_bytes / seconds / 1e9
                    row = dict(
                        op=op,
                        impl=impl,
                        batch=batch,
                        length=length,
                        ms=seconds * 1e3,
                        gb_per_s=gbs,
                        fraction_of_copy_bw=num_bytes / seconds / bw,
                        bytes=num_bytes,
                    )
                    rows.append(row)
                    print(
                        f"{op:<7} {impl:<7} {batch:>5} {length:>7} {seconds * 1e3:>9.3f} {gbs:>8.2f} "
                        f"{100 * row['fraction_of_copy_bw']:>8.1f}%"
                    )
    if args.json_out:
        meta = dict(
            device=device.device_kind,
            backend=jax.default_backend(),
            jax=jax.__version__,
            dtype=args.dtype,
            copy_bandwidth_gb_per_s=bw / 1e9,
            kv_heads=args.kv_heads,
            group=args.group,
            head_dim=args.head_dim,
            window=args.window,
            block_size=args.block_size,
            num_splits=args.num_splits,
            interpret=bool(run_kernels and interpret),
        )
        with open(args.json_out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=2)
        print(f"wrote {args.json_out}")
    return rows


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
