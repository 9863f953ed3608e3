#!/usr/bin/env python
"""Compute TriAttention's query statistics for a model and save them beside it (`vase_jax.calibration`).

    python scripts/calibrate.py                            # the packaged model, on its own varchain traces
    python scripts/calibrate.py --model DIR --text FILE    # any Qwen3 folder, on a plain-text file

With --text the file is tokenized and cut into sequences of --max-length tokens (the authors calibrate on one
plain-text file, any coherent text). Without it the model writes its own greedy traces (full cache) for the
first --problems problems of varchain's training split (never the held-out problems) and the statistics are
taken over prompt + trace. The file goes to DIR/triattention_stats.npz (or --out); `EvictionConfig(
"triattention", calibration=DIR)` and `scripts/eval.py --methods triattention` read it from there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

PROG = "calibrate.py"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Qwen3 checkpoint folder (default: the packaged varchain model)")
    p.add_argument("--text", help="a plain-text file to calibrate on (default: the model's varchain traces; "
                   "required for any other model)")
    p.add_argument("--max-length", type=int, default=4096, help="tokens per --text sequence (default 4096)")
    p.add_argument("--problems", type=int, default=64, help="varchain training problems (default 64)")
    p.add_argument("--batch", type=int, default=8, help="sequences per forward pass (default 8)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the model's dtype (default bfloat16, as the evaluation runs it)")
    p.add_argument("--out", help="the statistics file (default: MODEL/triattention_stats.npz)")
    return p


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"--{name}={value} must be >= 1")


def text_sequences(tokenizer, path: str, max_length: int) -> list[list[int]]:
    """The file's tokens in consecutive sequences of `max_length` (the last one shorter)."""
    with open(path, encoding="utf-8") as fh:
        ids = tokenizer(fh.read(), add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"--text={path!r} holds no tokens")
    return [ids[i:i + max_length] for i in range(0, len(ids), max_length)]


def trace_sequences(model, tokenizer, model_dir: str, problems: int, batch: int) -> list[list[int]]:
    """Prompt + the model's own greedy trace (full cache) for varchain's training problems 0 .. problems-1."""
    import jax
    import numpy as np

    import vase_jax as vj
    from vase_jax.evaluation.runner import end_tokens
    from vase_jax.tasks import get_task
    from vase_jax.tasks.varchain import problem

    task = get_task("varchain")
    questions = [problem(seed, split="train").question for seed in range(problems)]
    eos = end_tokens(model_dir)
    config = vj.GenerateConfig(max_new_tokens=task.max_total_tokens, temperature=0.0,
                               **({"eos_token_ids": eos} if eos else {}))
    out: list[list[int]] = []
    for start in range(0, len(questions), batch):
        enc = vj.encode_prompts(tokenizer, [task.build_prompt(q) for q in questions[start:start + batch]])
        res = vj.generate(model, enc.input_ids, enc.attention_mask, key=jax.random.key(0), config=config)
        tokens, num = np.asarray(res.tokens), np.asarray(res.num_tokens)
        for r, length in enumerate(enc.lengths):
            prompt = enc.input_ids[r, enc.input_ids.shape[1] - int(length):].tolist()
            out.append(prompt + tokens[r, : int(num[r])].tolist())
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vase_jax.evaluation.config import packaged_model_dir

    model_dir = os.path.abspath(args.model) if args.model else str(packaged_model_dir())
    try:
        for name in ("max_length", "problems", "batch"):
            _positive(name.replace("_", "-"), getattr(args, name))
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ValueError(f"--model={model_dir!r} is not a checkpoint folder (no config.json)")
        if args.text is None and args.model and os.path.abspath(args.model) != str(packaged_model_dir()):
            raise ValueError("--text FILE is needed for a model other than the packaged one (its varchain "
                             "traces are the packaged model's default)")
        if args.text is not None and not os.path.isfile(args.text):
            raise ValueError(f"--text={args.text!r} is not a file")
    except ValueError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2

    import jax.numpy as jnp

    import vase_jax as vj
    from vase_jax.calibration import query_statistics
    from vase_jax.eviction.triattention import save_calibration

    t0 = time.perf_counter()
    model = vj.Qwen3.from_pretrained(model_dir, dtype=getattr(jnp, args.dtype))
    tokenizer = vj.load_tokenizer(model_dir)
    if args.text is not None:
        sequences = text_sequences(tokenizer, args.text, args.max_length)
        source = f"text {os.path.basename(args.text)}, {args.max_length}-token sequences"
    else:
        sequences = trace_sequences(model, tokenizer, model_dir, args.problems, args.batch)
        source = f"varchain train problems 0-{args.problems - 1}: prompt + the model's greedy trace"
    calibration = query_statistics(model, sequences, batch=args.batch, source=source,
                                   pad_id=int(tokenizer.pad_token_id or 0))
    calibration = dataclasses.replace(calibration, meta=calibration.meta | {"dtype": args.dtype, "batch": args.batch})
    path = save_calibration(args.out or model_dir, calibration)
    print(f"{PROG}: {calibration.meta['tokens']} tokens in {len(sequences)} sequences, "
          f"{time.perf_counter() - t0:.1f} s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
