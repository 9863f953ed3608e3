#!/usr/bin/env python
"""Generate an answer to one question with a Qwen3 model, with or without KV eviction.

    python scripts/demo.py --model Qwen/Qwen3-0.6B --method vase_attnv --budget 512 --max-new-tokens 1024
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="hub id, HF folder or converted orbax folder")
    p.add_argument("--question", default="What is the sum of the first 20 odd numbers?")
    p.add_argument("--method", default="full")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--buffer", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args(argv)
    try:
        import jax
        import jax.numpy as jnp

        import vase_jax as vj

        ev = vj.EvictionConfig(args.method, budget=args.budget, buffer=args.buffer).validate()
        gen = vj.GenerateConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature).validate()
        model = vj.Qwen3.from_pretrained(args.model, dtype=getattr(jnp, args.dtype))
        tok = vj.load_tokenizer(args.model)
    except ValueError as e:
        print(f"demo.py: error: {e}", file=sys.stderr)
        return 2
    batch = vj.encode_prompts(tok, [args.question + "\nPlease reason step by step, and put your final answer "
                                    "within \\boxed{}."])
    t0 = time.perf_counter()
    out = vj.generate(model, batch.input_ids, batch.attention_mask, key=jax.random.key(args.seed), config=gen,
                      eviction=ev)
    n = int(out.num_tokens[0])
    dt = time.perf_counter() - t0
    print(tok.decode(out.tokens[0, :n].tolist()))
    print(f"\n[{n} tokens in {dt:.1f} s (compile included), {int(out.evictions)} evictions, "
          f"finished={bool(out.finished[0])}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
