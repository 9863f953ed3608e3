"""Time the Pallas kernels against their pure-JAX references on the current device.

For each batch size and cache length: decode attention (one query token per row over `length` cache slots) and
the VaSE window-attention score (a window of queries over `length` candidates). Each timing is the median of
`--repeats` runs after `--warmup` runs, each ended by `block_until_ready`. Achieved bandwidth is the bytes the
operation must read at least once (decode: K and V and pos of the used slots; scores: the keys and the window
queries) divided by the time, printed next to the device's copy bandwidth measured here with a large array
copy ((read + write) bytes / time).

Kernels: the Triton kernels on a GPU, the Mosaic TPU kernels on a TPU. On CPU only the references run, unless
`--interpret` is given (then both kernel families run in interpret mode: very slow, for checking only).

    python scripts/bench_kernels.py                     # small defaults on CPU, full sweep on GPU / TPU
    python scripts/bench_kernels.py --lengths 1024,8192 --batches 1,8 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.decode_attention_tpu import decode_attention_tpu
from vase_jax.eviction.window_score import window_score


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
    return (queries, query_valid, keys, valid), keys.nbytes + queries.nbytes


def kernel_impls(args, platform: str) -> dict[str, list[tuple[str, object]]]:
    """op -> [(label, jitted function)]: the XLA path, then the kernels this platform runs (interpret on CPU)."""
    gpu_interpret = platform != "gpu"
    tpu_interpret = dispatch.tpu_interpret_params() if platform != "tpu" else False
    triton_decode = functools.partial(
        decode_attention, block_size=args.block_size, num_splits=args.num_splits, interpret=gpu_interpret
    )
    tpu_decode = functools.partial(decode_attention_tpu, block_size=args.tpu_block_size, interpret=tpu_interpret)
    triton_scores = functools.partial(window_score, impl="pallas_gpu", block_keys=args.score_block_keys)
    tpu_scores = functools.partial(window_score, impl="pallas_tpu", block_keys=args.tpu_score_block_keys)
    families = {"gpu": ["triton"], "tpu": ["tpu"]}.get(platform, ["triton", "tpu"] if args.interpret else [])
    impls = {
        "decode": [("xla", jax.jit(functools.partial(decode_attention_reference, block_size=args.block_size)))],
        "scores": [("xla", jax.jit(functools.partial(window_score, impl="xla")))],
    }
    suffix = "" if platform in ("gpu", "tpu") else "-interp"
    for family in families:
        decode_fn, scores_fn = (triton_decode, triton_scores) if family == "triton" else (tpu_decode, tpu_scores)
        impls["decode"].append((family + suffix, jax.jit(decode_fn)))
        impls["scores"].append((family + suffix, jax.jit(scores_fn)))
    return impls


def main(argv=None) -> list[dict]:
    platform = jax.default_backend()
    on_accel = platform in ("gpu", "tpu")  # an accelerator: full sweep, bfloat16, compiled kernels
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", type=_ints, default=[1024, 4096, 8192, 16384, 32768] if on_accel else [1024, 4096]
    )
    parser.add_argument("--batches", type=_ints, default=[1, 4, 16] if on_accel else [1, 4])
    parser.add_argument("--capacity", type=int, default=0, help="cache capacity (default: the length itself)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per kv head (Qwen3-8B: 4)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=64, help="window queries of the eviction score")
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16" if on_accel else "float32"
    )
    parser.add_argument("--block-size", type=int, default=64, help="Triton decode kernel: slots per block")
    parser.add_argument("--num-splits", type=int, default=16, help="Triton decode kernel: splits per row")
    parser.add_argument("--tpu-block-size", type=int, default=1024, help="TPU decode kernel: slots per block")
    parser.add_argument("--score-block-keys", type=int, default=64, help="Triton score kernel: keys per block")
    parser.add_argument("--tpu-score-block-keys", type=int, default=512, help="TPU score kernel: keys per block")
    parser.add_argument("--which", default="decode,scores", help="comma list of: decode, scores")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--interpret", action="store_true", help="on CPU: also run both kernel families in interpret mode"
    )
    parser.add_argument("--copy-mib", type=int, default=1024 if on_accel else 256)
    parser.add_argument("--json", dest="json_out", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error(f"--repeats={args.repeats} must be >= 3")

    dtype = jnp.dtype(args.dtype)
    bw = copy_bandwidth(args.copy_mib << 20, warmup=args.warmup, repeats=args.repeats)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({platform}), jax {jax.__version__}, dtype {args.dtype}")
    print(f"copy bandwidth: {bw / 1e9:.1f} GB/s ((read + write) bytes of a {args.copy_mib} MiB float32 copy)")

    impls = kernel_impls(args, platform)
    makers = {"decode": decode_case, "scores": scores_case}
    rows = []
    header = f"{'op':<7} {'impl':<13} {'batch':>5} {'length':>7} {'ms':>9} {'GB/s':>8} {'% copy bw':>9}"
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
                        f"{op:<7} {impl:<13} {batch:>5} {length:>7} {seconds * 1e3:>9.3f} {gbs:>8.2f} "
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
            tpu_block_size=args.tpu_block_size,
            score_block_keys=args.score_block_keys,
            tpu_score_block_keys=args.tpu_score_block_keys,
            interpret=platform not in ("gpu", "tpu") and args.interpret,
        )
        with open(args.json_out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=2)
        print(f"wrote {args.json_out}")
    return rows


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
