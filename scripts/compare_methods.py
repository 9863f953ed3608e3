#!/usr/bin/env python
"""Side-by-side table of the eviction methods on one model: kept-set overlap with SnapKV at the same eviction,
eviction time per event, and tokens/s of whole `generate` calls (prefill included) with periodic eviction.

    python scripts/compare_methods.py --config qwen3-0.6b --layers 4 --budget 1024 --buffer 64 --out runs/methods

With a named config the weights are random (no download): the attention patterns are then those of a random
network, so the overlaps describe the policies' mechanics, not a trained model's choices. Pass `--model` (hub id or
folder) for a real model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `benchmarks` (not installed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="hub id or local folder (default: random weights of --config)")
    p.add_argument("--config", default="qwen3-0.6b",
                   help="named config for random weights (tiny, small, qwen3-0.6b, ...)")
    p.add_argument("--layers", type=int, default=4, help="keep only this many layers of the named config")
    p.add_argument("--methods", default="", help="comma list (default: full and every registered method; those "
                   "that read --calibration only when it is given)")
    p.add_argument("--calibration", help="TriAttention's statistics file or model folder (scripts/calibrate.py)")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--buffer", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=768, help="decode length for tokens/s")
    p.add_argument("--prompt-len", type=int, default=1000,
                   help="prompt tokens for the tokens/s run (near the budget, so that eviction runs from the start)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--out", default="runs/methods")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    import vase_jax as vj
    from benchmarks.timing import load_warning, time_runs
    from vase_jax.eviction import METHODS, framework
    from vase_jax.generate import prefill
    from vase_jax.jit import host_cpu
    from vase_jax.random_model import named_configs, named_or_pretrained

    def takes_calibration(m: str) -> bool:
        return m in METHODS and "calibration" in METHODS[m].option_names

    methods = [m for m in args.methods.split(",") if m] or ["full"] + sorted(
        m for m in METHODS if args.calibration or not takes_calibration(m))
    try:
        configs = [vj.EvictionConfig(m, budget=args.budget, buffer=args.buffer,
                                     **({"calibration": args.calibration} if takes_calibration(m) else {})).validate()
                   for m in methods]
    except ValueError as e:
        print(f"compare_methods.py: error: {e}", file=sys.stderr)
        return 2
    if not args.model and args.config.lower() not in named_configs():
        print(f"compare_methods.py: error: --config {args.config!r}; allowed: {', '.join(named_configs())}",
              file=sys.stderr)
        return 2
    model, name = named_or_pretrained(args.model or args.config, getattr(jnp, args.dtype),
                                      layers=None if args.model else args.layers)
    cfg = model.cfg
    load_start = os.getloadavg()
    warning = load_warning(load_start[0])
    if warning:
        print(f"compare_methods.py: warning: {warning}", file=sys.stderr, flush=True)

    # ---- one eviction moment: a real-text prompt of N + B tokens, prefilled with its queries --------------------
    tok = vj.load_tokenizer()
    text = " ".join(json.loads(line)["problem"] for line in
                    (Path(vj.__file__).parent / "data" / "tasks" / "math" / "test.jsonl").open())
    ids = np.asarray(tok(text)["input_ids"][: args.budget + args.buffer], np.int32)[None].repeat(args.batch, 0)
    mask = np.ones_like(ids)
    state = tuple(dict.fromkeys(s for c in configs if c.evicts for s in c.policy.state))  # every method's state
    _, cache = jax.jit(prefill, static_argnums=(3, 4, 5, 6))(model, jnp.asarray(ids), jnp.asarray(mask),
                                                               ids.shape[1] + 64, args.buffer,  # every method's queries
                                                               "auto", state)
    row_ids = jnp.arange(args.batch, dtype=jnp.int32)
    key = jax.random.key(0)
    kept_by = {}
    for ev in (c for c in configs if c.evicts):
        kept_by[ev.method] = [np.asarray(framework.select_layer(cache, layer, ev, jax.random.fold_in(key, layer),
                                                                jax.random.fold_in(key, 100 + layer), row_ids))
                              for layer in range(cfg.num_layers)]
    ref_name = "snapkv" if "snapkv" in kept_by else next(iter(kept_by), "snapkv")

    num_candidates = ids.shape[1] - args.buffer  # every candidate slot is valid here (no padding)

    def overlap(a, b, evicted: bool = False):
        """Mean over (layer, row, kv head) of |A & B| / |A|, A and B the kept (or the evicted) slot sets."""
        out = []
        for la, lb in zip(a, b, strict=True):
            for x, y in zip(la.reshape(-1, la.shape[-1]), lb.reshape(-1, lb.shape[-1]), strict=True):
                x, y = set(x.tolist()), set(y.tolist())
                if evicted:
                    x, y = set(range(num_candidates)) - x, set(range(num_candidates)) - y
                out.append(len(x & y) / len(x))
        return float(np.mean(out))

    rows = []
    prompt_ids = ids[:, : args.prompt_len]
    gen = vj.GenerateConfig(max_new_tokens=args.new_tokens, temperature=0.0, eos_token_ids=())
    for ev in configs:
        t_evict = None
        if ev.evicts:
            evict = jax.jit(lambda c, ev=ev: framework.evict(c, ev, key, row_ids))
            t_evict = 1e3 * time_runs(lambda ev_fn=evict: ev_fn(cache), args.repeats, warmup=1).median
        run = lambda ev=ev: vj.generate(model, prompt_ids, np.ones_like(prompt_ids),  # noqa: E731
                                        key=key, config=gen, eviction=ev).tokens.block_until_ready()
        t0 = time.perf_counter()
        run()
        compile_and_run = time.perf_counter() - t0
        t_gen = time_runs(run, args.repeats).median
        both = ev.method in kept_by and ref_name in kept_by
        same = overlap(kept_by[ev.method], kept_by[ref_name]) if both else None
        same_evicted = overlap(kept_by[ev.method], kept_by[ref_name], evicted=True) if both else None
        rows.append({"method": ev.method, "overlap_with_" + ref_name: same,
                     "evicted_overlap_with_" + ref_name: same_evicted, "evict_ms": t_evict,
                     "tokens_per_s": args.batch * args.new_tokens / t_gen, "first_call_s": compile_and_run})
        print(json.dumps(rows[-1]), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": name, "budget": args.budget, "buffer": args.buffer, "batch": args.batch,
            "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "dtype": args.dtype, "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "cpu_model": host_cpu()["model name"], "repeats": args.repeats,
            "load_start": [round(x, 2) for x in load_start], "load_end": [round(x, 2) for x in os.getloadavg()]}
    (out / "methods.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"Model: {name}, {args.dtype}; N={args.budget}, B={args.buffer}, batch {args.batch}, "
             f"{args.prompt_len}-token prompt, {args.new_tokens} greedy tokens; median of {args.repeats}. Device "
             f"{meta['device']}, host CPU {meta['cpu_model']}, jax {jax.__version__}; load average (1, 5, 15 min) "
             f"at start {meta['load_start']}, at end {meta['load_end']}"
             f"{' (WARNING: busy machine)' if warning else ''}.", "",
             f"| method | kept-set overlap with {ref_name} | evicted-set overlap with {ref_name} | eviction ms/event "
             "| generate tokens/s (prefill included) |",
             "|---|---|---|---|---|"]
    def fmt(x, spec):
        return "–" if x is None else format(x, spec)

    lines += [f"| {r['method']} | {fmt(r['overlap_with_' + ref_name], '.3f')} | "
              f"{fmt(r['evicted_overlap_with_' + ref_name], '.3f')} | {fmt(r['evict_ms'], '.1f')} | "
              f"{r['tokens_per_s']:.1f} |" for r in rows]
    (out / "methods.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
