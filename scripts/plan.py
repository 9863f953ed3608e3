#!/usr/bin/env python
"""Per-device memory of generating on a mesh, before renting the devices: weights, KV cache and the compiled
program's temporaries (`vase_jax.planner`), from the target's own compiler without the device; and the largest
batch the continuous engine (`vase_jax.batching.run`) can run on one device.

    python scripts/plan.py --model qwen3-32b --mesh data=1,model=8 --batch 16 --budget 4096 --target h200
    python scripts/plan.py --model qwen3-14b --batch auto --method vase_dkv --budget 2048 --prompt 256 \
        --max-new-tokens 32512 --samples 480 --target h200

--batch N plans `generate` (a static batch of N rows, on the mesh); with --engine it plans the continuous engine
on N rows instead (one device). --batch auto plans the engine: the most rows whose plan fits --device-gb (default
per target: 139 GiB for an H200, 95 GiB for a v5p; required for cpu) less --headroom, at most --max-rows or
--samples. The engine, since it is what runs a protocol of many samples at the batch eviction makes possible:
its rows hold a fixed cache and take the next sample when one ends; a static `generate` batch would wait for its
longest row. The search compiles the engine at two small sizes, fits the temporaries as a + b * rows, solves,
and compiles the answer (`planner.largest_batch`): a few compiles, each a minute or more for a 40-layer model.

--target: h200 (XLA:GPU; needs `pip install "jax[cuda13-local]==<jax>"`), v5p (XLA:TPU; `pip install "jax[tpu]==<jax>"`)
or cpu (XLA:CPU on simulated host devices).

--model: a packaged real config (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b, qwen3-32b, or tiny /
small) or a local checkpoint folder (its config.json). Nothing is downloaded or allocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

PROG = "plan.py"


def build_parser() -> argparse.ArgumentParser:
    from vase_jax.cli import int_or_auto  # jax is imported, not started: the target's environment is set later

    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="qwen3-0.6b ... qwen3-32b, tiny, small, or a local folder")
    p.add_argument("--mesh", default="data=1,model=1", help="data=D,model=M (default data=1,model=1)")
    p.add_argument("--batch", type=int_or_auto, required=True,
                   help="rows generated together (global batch), or 'auto': the most the engine fits on one device")
    p.add_argument("--engine", action="store_true",
                   help="plan the continuous engine (vase_jax.batching.run) on --batch rows, not generate")
    p.add_argument("--queue", type=int, help="engine: samples prefilled per round (default: the rows, at most 64, "
                   "as run)")
    p.add_argument("--samples", type=int, help="--batch auto: the samples to run (the batch is at most this)")
    p.add_argument("--max-rows", type=int, default=512, help="--batch auto: the most rows considered (default 512)")
    p.add_argument("--headroom", type=float, default=0.05,
                   help="--batch auto: share of the device's memory left free (default 0.05)")
    p.add_argument("--method", default="vase_attnv", help="eviction method, or 'full' (default vase_attnv)")
    p.add_argument("--budget", type=int, default=4096, help="KV budget N (default 4096)")
    p.add_argument("--buffer", type=int, default=64, help="eviction buffer B (default 64)")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--kv-bits", default="bf16",
                   help="cache setting: bf16 (default) or K<bits>V<bits>[g<group>], a mixed-precision cache "
                   "(one device), e.g. K8V4")
    p.add_argument("--kv-protected", type=int, help="16-bit slots of a mixed-precision cache kept for their Range "
                   "(default: Nv with vase_attnv, 0 with other evicting methods, a quarter without eviction)")
    p.add_argument("--compress-prompt", action="store_true", help="EvictionConfig.compress_prompt: a prompt longer "
                   "than N is evicted to N after the prefill (the cache holds N + B slots whatever the prompt)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="GenerateConfig.prefill_chunk: prompt tokens per "
                   "prefill chunk (default 256); 0: the dense prefill")
    p.add_argument("--max-new-tokens", type=int, default=32768, help="output tokens per row (default 32768)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--target", default="h200", choices=("h200", "v5p", "cpu"),
                   help="whose compiler plans the program: an H200's (default), a TPU v5p's, or XLA:CPU's")
    p.add_argument("--no-compile", action="store_true", help="weights and cache only (no compile)")
    p.add_argument("--device-gb", type=float, help="device memory in GB (1e9 bytes): say whether the plan fits; "
                   "--batch auto: what it must fit (default per target: 139 GiB h200, 95 GiB v5p)")
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
    auto = args.batch == "auto"
    for name in ("batch", "budget", "buffer", "prompt", "max_new_tokens", "queue", "samples", "max_rows"):
        value = getattr(args, name)
        if value is not None and value != "auto" and value < 1:
            fail(f"--{name.replace('_', '-')}={value} must be >= 1")
    if not 0 <= args.headroom < 1:
        fail(f"--headroom={args.headroom} must be in [0, 1)")
    if args.device_gb is not None and args.device_gb <= 0:
        fail(f"--device-gb={args.device_gb} must be > 0")
    engine = args.engine or auto
    if engine and sizes["data"] * sizes["model"] != 1:
        fail(f"--mesh {args.mesh}: the continuous engine (--engine, --batch auto) runs on one device; use "
             "--mesh data=1,model=1")
    if auto and args.no_compile:
        fail("--batch auto compiles the engine (its temporaries decide the batch): drop --no-compile")
    if auto and args.target == "cpu" and args.device_gb is None:
        fail("--batch auto --target cpu: give --device-gb (the CPU has no default memory size)")
    if not engine and (args.queue or args.samples):
        fail("--queue and --samples apply to the engine (--engine or --batch auto)")
    devices = sizes["data"] * sizes["model"]
    if args.target == "h200":  # the H200 plugin's checks need a driver: compile only (before jax starts)
        from vase_jax.aot import deviceless_environment

        os.environ.update(deviceless_environment())
    import jax

    jax.config.update("jax_platforms", "cpu")  # the programs run nowhere; a device target's plugin only compiles
    if (args.target == "cpu" or args.no_compile) and devices > 1:  # simulated host devices (before the backend
        jax.config.update("jax_num_cpu_devices", devices)  # starts); a device target's come from its topology
    import jax.numpy as jnp

    from vase_jax import aot
    from vase_jax.config import Qwen3Config
    from vase_jax.planner import plan_memory
    from vase_jax.random_model import named_configs
    from vase_jax.sharding import check_mesh, make_mesh

    named = named_configs()
    if args.model.lower() in named:
        cfg = named[args.model.lower()]
    elif (Path(args.model) / "config.json").exists():
        cfg = Qwen3Config.from_json_file(Path(args.model) / "config.json")
    else:
        fail(f"--model={args.model!r} is neither a known config ({', '.join(named)}) nor a folder with config.json")
    try:  # the mesh against the model and the batch, before anything else
        check_mesh(cfg, jax.sharding.AbstractMesh((sizes["data"], sizes["model"]), ("data", "model")),
                   1 if auto else args.batch)
    except ValueError as e:
        fail(str(e))
    if args.target != "cpu" and not args.no_compile and aot.missing(args.target):
        fail(f"--target {args.target}: {aot.missing(args.target)}; or plan with --target cpu (XLA:CPU's figures)")
    compiler = {"h200": "XLA:GPU for an H200", "v5p": "XLA:TPU for a v5p", "cpu": "XLA:CPU"}[args.target]
    if engine:
        return engine_main(args, cfg, compiler)
    try:
        target_devices = None if args.target == "cpu" or args.no_compile else aot.TARGETS[args.target].devices(devices)
        mesh = make_mesh(sizes["data"], sizes["model"], target_devices)
        check_mesh(cfg, mesh, args.batch)
        eviction = eviction_of(args)
        plan = plan_memory(cfg, mesh, args.batch, eviction, prompt_len=args.prompt,
                           max_new_tokens=args.max_new_tokens, dtype=getattr(jnp, args.dtype),
                           compile_program=not args.no_compile, config=kv_config(args))
    except ValueError as e:
        fail(str(e))
    out = {"model": args.model, "target": args.target, "mesh": sizes, "batch": args.batch, "method": args.method,
           "budget": args.budget, "kv_bits": kv_config(args).kv_bits.name, "compress_prompt": args.compress_prompt,
           "prefill_chunk": kv_config(args).prefill_chunk, "capacity": plan.capacity,
           "per_device_bytes": generate_rows(plan)}
    if plan.temporaries is not None:  # the compiler's own figures, which the rows above split
        out["compiled_bytes"] = {"arguments": plan.arguments, "outputs": plan.outputs, "temporaries": plan.temporaries}
    if args.device_gb:
        out["fits"] = out["per_device_bytes"]["total"] <= args.device_gb * 1e9
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.model} on mesh data={sizes['data']},model={sizes['model']}: batch {args.batch}, {args.method} "
          f"budget {args.budget} ({plan.capacity} cache slots), per device ({compiler}):")
    print_rows(out["per_device_bytes"], GENERATE_ROWS)
    if "fits" in out:
        print(f"  fits in {args.device_gb} GB: {'yes' if out['fits'] else 'NO'}")
    return 0


# What each row of the tables holds; the rows add up to the total.
GENERATE_ROWS = {"weights": "the model's weights (a program argument)",
                 "inputs": "the program's other arguments (prompt ids, mask, keys, caps)",
                 "cache": "the KV cache (created inside the program)",
                 "temporaries": "the compiled program's other temporaries (activations, eviction scores)",
                 "outputs": "the tokens and counters it returns",
                 "total": "the peak estimate"}
ENGINE_ROWS = {"weights": "the model's weights",
               "cache": "the batch's KV cache",
               "state": "the rest of the engine's loop state (token and result buffers, counters)",
               "staged": "prefilled prompts: two rounds (the one decoding and the next)",
               "temporaries": "the larger of the engine program's and the prefill program's temporaries",
               "total": "the peak estimate"}


def generate_rows(plan) -> dict:
    """`MemoryPlan` as rows that sum to its total (the compiler's temporaries hold the cache, its arguments the
    weights); without a compile, weights and cache only."""
    if plan.temporaries is None:
        return {"weights": plan.weights, "cache": plan.cache, "total": plan.weights + plan.cache}
    return {"weights": plan.weights, "inputs": plan.arguments - plan.weights, "cache": plan.cache,
            "temporaries": plan.temporaries - plan.cache, "outputs": plan.outputs, "total": plan.total}


def engine_rows(plan) -> dict:
    """`EnginePlan` as rows that sum to its total."""
    from vase_jax.planner import STAGED_SETS

    compiled = plan.engine_temporaries is not None
    return {"weights": plan.weights, "cache": plan.cache, "state": plan.state - plan.cache,
            "staged": STAGED_SETS * plan.staged, "temporaries": plan.temporaries if compiled else None,
            "total": plan.total}


def print_rows(rows: dict, meaning: dict) -> None:
    """One line per row, in GiB."""
    for name, value in rows.items():
        amount = "        -    " if value is None else f"{value / 2**30:9.3f} GiB"
        print(f"  {name:12s} {amount}  {meaning[name]}")


def eviction_of(args):
    """The `EvictionConfig` of --method, --budget, --buffer, --compress-prompt."""
    from vase_jax.eviction.config import EvictionConfig

    if args.method == "full":
        return EvictionConfig("full", compress_prompt=args.compress_prompt)
    return EvictionConfig(args.method, budget=args.budget, buffer=args.buffer, compress_prompt=args.compress_prompt)


def kv_config(args):
    """The `GenerateConfig` of --kv-bits / --kv-protected (ValueError naming the flag)."""
    from vase_jax.generate import GenerateConfig
    from vase_jax.kvquant import KVBits

    try:
        kv = KVBits.parse(args.kv_bits).validate()
    except ValueError as e:
        raise ValueError(f"--kv-bits: {e}") from None
    chunk = args.prefill_chunk or None
    try:
        GenerateConfig(prefill_chunk=chunk).validate()
    except ValueError as e:
        raise ValueError(f"--prefill-chunk={args.prefill_chunk}: 0 (dense) or at least 16") from e
    if not kv.quantizes:
        return GenerateConfig(prefill_chunk=chunk)
    return GenerateConfig(key_bits=kv.key_bits, value_bits=kv.value_bits, kv_group=kv.key_group,
                          kv_protected=args.kv_protected, kv_refine=kv.refine, prefill_chunk=chunk)


def engine_main(args, cfg, compiler: str) -> int:
    """--engine / --batch auto: the continuous engine on one device of the target (jax is configured by main)."""
    import jax.numpy as jnp

    from vase_jax.planner import largest_batch, plan_engine

    dtype = getattr(jnp, args.dtype)
    try:
        eviction = eviction_of(args)
        config = dataclasses.replace(kv_config(args), max_new_tokens=args.max_new_tokens)
        target = "cpu" if args.no_compile else args.target  # no compile: the buffers' bytes need no compiler
        common = dict(target=target, config=config, prompt_len=args.prompt, dtype=dtype, queue=args.queue)
        if args.batch == "auto":
            device_bytes = None if args.device_gb is None else int(args.device_gb * 1e9)
            found = largest_batch(cfg, eviction, device_bytes=device_bytes, headroom=args.headroom,
                                  samples=args.samples, max_rows=args.max_rows, **common)
            plan = found.plan
        else:
            found, plan = None, plan_engine(cfg, args.batch, eviction, compile_program=not args.no_compile, **common)
    except ValueError as e:
        fail(str(e))
    out = {"model": args.model, "target": args.target, "program": "engine", "method": args.method,
           "kv_bits": config.kv_bits.name,
           "budget": None if args.method == "full" else args.budget,
           "batch": plan.rows if found is None else found.rows,
           "plan": plan.as_dict() if plan is not None else None,
           "per_device_bytes": engine_rows(plan) if plan is not None else None}
    if found is not None:
        out |= {"limit": found.limit, "reason": found.reason, "device_bytes": found.device_bytes,
                "usable_bytes": found.usable, "compiled": [list(x) for x in found.compiled],
                "compile_s": found.compile_s}
    elif args.device_gb:
        out["fits"] = plan.total <= args.device_gb * 1e9
    if args.json:
        print(json.dumps(out))
        return 0 if out["batch"] > 0 else 1
    print(f"{args.model}: continuous engine (batching.run), {eviction.label}, prompt {args.prompt} (bucket "
          f"{plan.staged_slots}), {args.max_new_tokens} new tokens, {plan.capacity} cache slots per row, one "
          f"device ({compiler}):")
    if found is not None:
        print(f"  batch {found.rows}: {found.reason}")
        print(f"  compiled at {', '.join(f'{r} rows ({t / 2**30:.3f} GiB)' for r, t in found.compiled)} in "
              f"{found.compile_s:.0f} s")
    print(f"  at {plan.rows} rows, queue {plan.queue}:")
    print_rows(engine_rows(plan), ENGINE_ROWS)
    if "fits" in out:
        print(f"  fits in {args.device_gb} GB: {'yes' if out['fits'] else 'NO'}")
    return 0 if out["batch"] > 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
