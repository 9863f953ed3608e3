#!/usr/bin/env python
"""Generate an answer to one question with a Qwen3 model, with or without KV eviction.

    python scripts/demo.py                                  # the packaged model on a fresh varchain problem, offline
    python scripts/demo.py --method vase_attnv --budget 96 --buffer 32
    python scripts/demo.py --model Qwen/Qwen3-0.6B --method vase_attnv --budget 512 --max-new-tokens 1024

With no --model, the packaged trained model answers a problem of its task (`vase_jax.tasks.varchain`, split
"fresh", problem --seed) greedily, and the line after the answer says whether it is right. With --model (a hub id,
an HF folder or a converted orbax folder), --question (default: a short math question) is asked with the math
prompt, sampled at --temperature.
"""

from __future__ import annotations

import argparse
import sys
import time

MATH_QUESTION = "What is the sum of the first 20 odd numbers?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="hub id, HF folder or converted orbax folder (default: the packaged model)")
    p.add_argument("--question", help=f"the question (default: a varchain problem, or {MATH_QUESTION!r} with --model)")
    p.add_argument("--method", default="full")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--buffer", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, help="default: the task's cap less the prompt (packaged), else 1024")
    p.add_argument("--temperature", type=float, help="default: 0 (greedy) with the packaged model, else 0.6")
    p.add_argument("--seed", type=int, default=0, help="the sampling key, and the varchain problem's seed")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = p.parse_args(argv)
    try:
        import jax
        import jax.numpy as jnp

        import vase_jax as vj
        from vase_jax.evaluation import end_tokens
        from vase_jax.evaluation.config import packaged_model_dir
        from vase_jax.tasks import varchain
        from vase_jax.tasks.registry import get_task

        packaged = args.model is None
        task = get_task("varchain" if packaged else "math500")
        chain = varchain.problem(args.seed, split="fresh") if packaged and args.question is None else None
        question = chain.question if chain is not None else (args.question or MATH_QUESTION)
        ev = vj.EvictionConfig(args.method, budget=args.budget, buffer=args.buffer).validate()
        model_path = str(packaged_model_dir()) if packaged else args.model
        tok = vj.load_tokenizer(model_path)
        batch = vj.encode_prompts(tok, [task.build_prompt(question)])
        max_new = args.max_new_tokens or (task.max_new_tokens(batch.input_ids.shape[1]) if packaged else 1024)
        temperature = args.temperature if args.temperature is not None else (task.temperature if packaged else 0.6)
        ends = end_tokens(model_path)  # the model's own end tokens (the packaged model's are not Qwen3's)
        gen = vj.GenerateConfig(max_new_tokens=max_new, temperature=temperature,
                                **({} if ends is None else {"eos_token_ids": ends})).validate()
        model = vj.Qwen3.from_pretrained(model_path, dtype=getattr(jnp, args.dtype))
    except ValueError as e:
        print(f"demo.py: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = vj.generate(model, batch.input_ids, batch.attention_mask, key=jax.random.key(args.seed), config=gen,
                      eviction=ev)
    n = int(out.num_tokens[0])
    dt = time.perf_counter() - t0
    text = tok.decode(out.tokens[0, :n].tolist(), skip_special_tokens=True)
    print(question)
    print(text)
    if chain is not None:
        answer = varchain.extract_answer(text)
        print(f"\n[answer {answer or '(none)'}, gold {chain.answer}: {'right' if answer == chain.answer else 'wrong'}]")
    print(f"[{n} tokens in {dt:.1f} s (compile included), {int(out.evictions)} evictions, "
          f"finished={bool(out.finished[0])}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
