#!/usr/bin/env python
"""Per-device memory of generating on a mesh, before renting the devices: weights, KV cache and the compiled
program's temporaries (`vase_jax.planner`), from the target's own compiler without the device.

    python scripts/plan.py --model qwen3-32b --mesh data=1,model=8 --batch 16 --budget 4096 --target h200

--target: h200 (XLA:GPU; needs `pip install "jax[cuda13-local]==<jax>"`), v5p (XLA:TPU; `pip install "jax[tpu]==<jax>"`)
or cpu (XLA:CPU on simulated host devices).

--model: a packaged real config (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b, qwen3-32b, or tiny /
small) or a local checkpoint folder (its config.json). Nothing is downloaded or allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

PROG = "plan.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="qwen3-0.6b ... qwen3-32b, tiny, small, or a local folder")
    p.add_argument("--mesh", default="data=1,model=1", help="data=D,model=M (default data=1,model=1)")
    p.add_argument("--batch", type=int, required=True, help="rows generated together (global batch)")
    p.add_argument("--method", default="vase_attnv", help="eviction method, or 'full' (default vase_attnv)")
    p.add_argument("--budget", type=int, default=4096, help="KV budget N (default 4096)")
    p.add_argument("--buffer", type=int, default=64, help="eviction buffer B (default 64)")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--max-new-tokens", type=int, default=32768, help="output tokens per row (default 32768)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--target", default="h200", choices=("h200", "v5p", "cpu"),
                   help="whose compiler plans the program: an H200's (default), a TPU v5p's, or XLA:CPU's")
    p.add_argument("--no-compile", action="store_true", help="weights and cache only (no compile)")
    p.add_argument("--device-gb", type=float, help="device memory in GB: say whether the plan fits")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def fail(message: str):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from vase_jax.sharding import parse_mesh  # imports jax, which reads XLA_FLAGS once: set them first

    try:
        sizes = parse_mesh(args.mesh)
    except ValueError as e:
        fail(str(e))
    for name in ("batch", "budget", "buffer", "prompt", "max_new_tokens"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    devices = sizes["data"] * sizes["model"]
    if args.target == "h200":  # the H200 plugin's checks need a driver: compile only (before jax starts)
        from vase_jax.aot import deviceless_environment

        os.environ.update(deviceless_environment())
    import jax

    jax.config.update("jax_platforms", "cpu")  # the programs run nowhere; a device target's plugin only compiles
    if args.target == "cpu" or args.no_compile:  # simulated host devices (before the backend starts); a device
        jax.config.update("jax_num_cpu_devices", devices)  # target's devices come from its topology
    import jax.numpy as jnp

    from vase_jax import aot
    from vase_jax.bench import named_configs
    from vase_jax.config import Qwen3Config
    from vase_jax.eviction.config import EvictionConfig
    from vase_jax.planner import plan_memory
    from vase_jax.sharding import check_mesh, make_mesh

    named = named_configs()
    if args.model.lower() in named:
        cfg = named[args.model.lower()]
    elif (Path(args.model) / "config.json").exists():
        cfg = Qwen3Config.from_json_file(Path(args.model) / "config.json")
    else:
        fail(f"--model={args.model!r} is neither a known config ({', '.join(named)}) nor a folder with config.json")
    try:  # the mesh against the model and the batch, before anything else
        check_mesh(cfg, jax.sharding.AbstractMesh((sizes["data"], sizes["model"]), ("data", "model")), args.batch)
    except ValueError as e:
        fail(str(e))
    if args.target != "cpu" and not args.no_compile and aot.missing(args.target):
        fail(f"--target {args.target}: {aot.missing(args.target)}; or plan with --target cpu (XLA:CPU's figures)")
    try:
        target_devices = None if args.target == "cpu" or args.no_compile else aot.TARGETS[args.target].devices(devices)
        mesh = make_mesh(sizes["data"], sizes["model"], target_devices)
        check_mesh(cfg, mesh, args.batch)
        eviction = (EvictionConfig("full") if args.method == "full" else
                    EvictionConfig(args.method, budget=args.budget, buffer=args.buffer))
        plan = plan_memory(cfg, mesh, args.batch, eviction, prompt_len=args.prompt,
                           max_new_tokens=args.max_new_tokens, dtype=getattr(jnp, args.dtype),
                           compile_program=not args.no_compile)
    except ValueError as e:
        fail(str(e))
    out = {"model": args.model, "target": args.target, "mesh": sizes, "batch": args.batch, "method": args.method,
           "budget": args.budget,
           "capacity": plan.capacity, "per_device_bytes": {
               "weights": plan.weights, "cache": plan.cache, "temporaries": plan.temporaries,
               "arguments": plan.arguments, "outputs": plan.outputs,
               "total": plan.total if plan.temporaries is not None else plan.weights + plan.cache}}
    if args.device_gb:
        out["fits"] = out["per_device_bytes"]["total"] <= args.device_gb * 1e9
    if args.json:
        print(json.dumps(out))
        return 0
    compiler = {"h200": "XLA:GPU for an H200", "v5p": "XLA:TPU for a v5p", "cpu": "XLA:CPU"}[args.target]
    print(f"{args.model} on mesh data={sizes['data']},model={sizes['model']}: batch {args.batch}, {args.method} "
          f"budget {args.budget} ({plan.capacity} cache slots), per device ({compiler}):")
    for name, value in out["per_device_bytes"].items():
        print(f"  {name:12s} {'-' if value is None else f'{value / 2**30:9.3f} GiB'}")
    if "fits" in out:
        print(f"  fits in {args.device_gb} GB: {'yes' if out['fits'] else 'NO'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
