#!/usr/bin/env python
"""The paper's value-quantization analysis (spec section 5) on any model the library loads.

    python scripts/analyze.py --model Qwen/Qwen3-4B --task gsm8k --limit 200

Generates one sample per question with the full KV cache under the task's protocol (sampling settings and
token cap as scripts/eval.py; sample 0 of the `full` method, same seed), takes every layer's value cache minus the
4 sink tokens, quantizes it per token in groups with HQQ (its half-quadratic zero-point refinement) and with plain
round-to-nearest (RTN) at bits 2 and 4, groups 32 and 64, and reports per layer the Pearson correlation between
each token's quantization MSE and its Range(v) = max_c v - min_c v, with the distribution of Range(v) per layer.

Writes DIR/summary.md (tables), DIR/summary.json, DIR/pearson_per_layer.png, DIR/range_per_layer.png and
DIR/mse_vs_range.png (default DIR: runs/analyze/<task>/<model name>).

With --kv-error K8V8,K8V4,K4V4 the same generated sequences also give, per layer, the attention-output error of
each KV-cache quantization setting against the 16-bit cache on the same tokens (`vase_jax.analysis.kv_error`):
||o_hat - o||_F / ||o||_F of the last --kv-queries positions' attention over their causal prefix, with every token
quantized (unprotected) and with the top --kv-protected of each prefix by Range(v), the --sinks first tokens and
the --kv-buffer most recent tokens kept in 16 bits (protected); the table goes into summary.md and summary.json
("kv_error").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

PROG = "analyze.py"


def build_parser() -> argparse.ArgumentParser:
    from vase_jax.cli import Parser, comma_list
    from vase_jax.evaluation.config import RANDOM_MODELS

    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="hub id (Qwen/Qwen3-4B), HF checkpoint folder, or orbax folder")
    src.add_argument("--random-model", choices=sorted(RANDOM_MODELS),
                     help="a tiny random Qwen3 built in memory (offline smoke runs)")
    p.add_argument("--task", default="gsm8k", help="evaluation task whose questions are used (default gsm8k)")
    p.add_argument("--data", help="JSONL file in the task's format instead of the packaged set")
    p.add_argument("--tests-dir", help="livecodebench only: the authors' test files (see scripts/eval.py)")
    p.add_argument("--limit", type=int, default=200, help="first N questions (default 200, as the paper)")
    p.add_argument("--max-new-tokens", type=int, help="output cap (default: the task's total cap minus the prompt)")
    p.add_argument("--max-total-tokens", type=int, help="prompt + output cap (default: the task's; gsm8k 4096)")
    p.add_argument("--temperature", type=float, help="default: the task's (0.6)")
    p.add_argument("--top-p", type=float, help="default: the task's (0.95)")
    p.add_argument("--top-k", type=int, help="default 0 (off)")
    p.add_argument("--seed", type=int, help="default 0")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    p.add_argument("--sinks", type=int, default=4, help="sink tokens dropped per head (default 4)")
    p.add_argument("--bits", type=comma_list(int, nonempty=True), default=(2, 4), help="comma list (default 2,4)")
    p.add_argument("--groups", type=comma_list(int, nonempty=True), default=(32, 64),
                   help="comma list of group sizes (default 32,64)")
    p.add_argument("--kv-error", metavar="SETTINGS",
                   help="comma list of KV-cache settings (K8V8,K8V4,K4V4, K4V4g32, ...): also report each one's "
                        "per-layer attention-output error against the 16-bit cache, with and without protection")
    p.add_argument("--kv-protected", type=float,
                   help="with --kv-error: fraction of each prefix kept in 16 bits by Range(v) (default 0.25)")
    p.add_argument("--kv-buffer", type=int,
                   help="with --kv-error: most recent tokens of each query kept in 16 bits (default 64)")
    p.add_argument("--kv-queries", type=int,
                   help="with --kv-error: the last N positions of each sequence are the queries (default 256; "
                        "0: every position)")
    p.add_argument("--kept-methods", type=lambda t: tuple(x.strip() for x in t.split(",") if x.strip()),
                   help="comma list of eviction methods: where the large-Range value tokens are, and the share of "
                   "them each method keeps on the full cache's greedy traces (`vase_jax.analysis.kept`)")
    p.add_argument("--kept-budget", type=int, help="budget N of --kept-methods (default: the task's)")
    p.add_argument("--kept-problems", type=int, default=32, help="traces of --kept-methods (default 32)")
    p.add_argument("--out", help="output folder (default: runs/analyze/<task>/<model name>)")
    return p


def _head_dim(model_name: str) -> int | None:
    """head_dim of a random model or of a local checkpoint folder, read before anything loads (else None)."""
    from vase_jax.config import Qwen3Config
    from vase_jax.evaluation.config import RANDOM_MODELS, RANDOM_PREFIX

    if model_name.startswith(RANDOM_PREFIX):
        return RANDOM_MODELS[model_name[len(RANDOM_PREFIX):]].head_dim
    config = Path(model_name).expanduser() / "config.json"
    try:
        return Qwen3Config.from_json_file(config).head_dim if config.is_file() else None
    except (ValueError, OSError, KeyError):
        return None


def kv_options(args, head_dim: int | None) -> dict | None:
    """The --kv-* options -> keyword arguments of `vase_jax.analysis.kv_error.kv_error` (None without
    --kv-error); ValueError with a one-line message naming the option."""
    from vase_jax.analysis import kv_error as kve

    if args.kv_error is None:
        for name in ("kv_protected", "kv_buffer", "kv_queries"):
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} needs --kv-error")
        return None
    try:
        settings = kve.parse_settings(args.kv_error, head_dim)
    except ValueError as e:
        raise ValueError(f"--kv-error: {e}") from None
    protected = kve.PROTECTED if args.kv_protected is None else args.kv_protected
    if not 0.0 <= protected <= 1.0:
        raise ValueError(f"--kv-protected={protected:g} must be in [0, 1]")
    buffer = kve.BUFFER if args.kv_buffer is None else args.kv_buffer
    if buffer < 0:
        raise ValueError(f"--kv-buffer={buffer} must be >= 0")
    queries = kve.QUERIES if args.kv_queries is None else args.kv_queries
    if queries < 0:
        raise ValueError(f"--kv-queries={queries} must be >= 0 (0: every position)")
    return {"settings": settings, "protected": protected, "sinks": args.sinks, "buffer": buffer,
            "queries": queries or None}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def fail(msg: str) -> int:
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2

    from vase_jax import evaluation as ev
    from vase_jax.analysis import QuantConfig

    model_name = f"random:{args.random_model}" if args.random_model else args.model
    try:
        cfg, problems = ev.resolve(
            model=model_name, task=args.task, data=args.data, tests_dir=args.tests_dir, methods=("full",),
            samples=1, max_new_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, limit=args.limit, seed=args.seed,
            dtype=args.dtype)
        if args.sinks < 0:
            raise ValueError(f"--sinks={args.sinks} must be an integer >= 0")
        for b in args.bits:
            if not 1 <= b <= 8:
                raise ValueError(f"--bits: {b} must be in 1..8")
        for g in args.groups:
            if g < 1:
                raise ValueError(f"--groups: {g} must be a positive integer")
        kv = kv_options(args, _head_dim(model_name))
        from vase_jax.eviction import METHODS
        from vase_jax.tasks.registry import suggest

        for m in args.kept_methods or ():
            if m not in METHODS:
                raise ValueError(f"--kept-methods: {m!r} is not an eviction method{suggest(m, METHODS)}; known: "
                                 f"{', '.join(sorted(METHODS))}")
        if args.kept_budget is not None and args.kept_budget < 1:
            raise ValueError(f"--kept-budget={args.kept_budget} must be an integer >= 1")
    except ValueError as e:
        return fail(str(e))
    out = Path(args.out) if args.out else Path("runs") / "analyze" / cfg.task / re.sub(
        r"[^A-Za-z0-9_.-]+", "_", Path(model_name.rstrip("/")).name or model_name)
    if out.exists() and not out.is_dir():
        return fail(f"--out={str(out)!r} exists and is not a folder")
    try:
        tokenizer = ev.load_tokenizer(cfg.model)
        model = ev.load_model(cfg.model, cfg.dtype)
    except (ValueError, OSError) as e:
        return fail(f"--model={cfg.model!r}: {e}".replace("\n", " "))
    head_dim = model.cfg.head_dim
    skipped = [g for g in args.groups if head_dim % g]
    if skipped:
        print(f"{PROG}: warning: --groups {','.join(map(str, skipped))} skipped: a group must divide head_dim "
              f"{head_dim} (groups hold channels of one token)", file=sys.stderr)
    configs = tuple(QuantConfig(b, g).validate(head_dim) for b in args.bits for g in args.groups if g not in skipped)
    if not configs:
        return fail(f"--groups: none of {','.join(map(str, args.groups))} divides head_dim {head_dim}")
    if kv is not None:
        try:
            kv = kv_options(args, head_dim)  # a hub model's head_dim is known once it is loaded
        except ValueError as e:
            return fail(str(e))
    cfg = dataclasses.replace(cfg, eos_token_ids=ev.end_tokens(cfg.model))  # the model's own end tokens
    summary = run(model, tokenizer, cfg, problems, configs, args.sinks, out, kv)
    if args.kept_methods:
        summary["kept"] = kept_report(model, tokenizer, cfg, problems, args, out)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(Path(out / "summary.md").read_text())
    print(f"wrote {out}/summary.md, summary.json, pearson_per_layer.png, range_per_layer.png, mse_vs_range.png "
          f"({summary['samples']} samples)")
    return 0


def kept_report(model, tokenizer, cfg, problems, args, out: Path) -> dict:
    """--kept-methods: `vase_jax.analysis.kept.kept_vs_range` on the first --kept-problems traces, appended to
    summary.md."""
    import vase_jax as vj
    from vase_jax.analysis.kept import kept_vs_range, markdown
    from vase_jax.tasks import get_task

    task = get_task(cfg.task)
    chosen = problems[:args.kept_problems]
    batch = vj.encode_prompts(tokenizer, [task.build_prompt(p.question) for p in chosen])
    budget = args.kept_budget or task.budget
    new_tokens, _ = cfg.token_limits(int(batch.lengths.max()))
    report = kept_vs_range(model, batch, tokenizer, args.kept_methods, budget, task.buffer,
                           cfg.generate_config(new_tokens), sinks=args.sinks, seed=cfg.seed)
    with open(out / "summary.md", "a") as fh:
        fh.write("\n" + markdown(report) + "\n")
    return report


def run(model, tokenizer, cfg, problems, configs, sinks: int, out: Path, kv: dict | None = None) -> dict:
    """Generate one full-cache sample per problem, accumulate the per-layer statistics, write the report; with
    `kv` (`kv_options`) also the attention-output errors of the quantized KV cache on the same sequences."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import vase_jax as vj
    from vase_jax.analysis.values import Accumulator, layer_stats, value_rows, write_report
    from vase_jax.evaluation import problem_key
    from vase_jax.tasks import get_task

    task = get_task(cfg.task)
    acc = kv_stats = None
    t0 = time.perf_counter()
    for i, problem in enumerate(problems):
        prompt = vj.encode_prompts(tokenizer, [task.build_prompt(problem.question)])
        prompt_len = int(prompt.lengths[0])
        gen_tokens, cap = cfg.token_limits(prompt_len)
        gen_cfg = dataclasses.replace(cfg.generate_config(gen_tokens), return_cache=True)
        res = vj.generate(model, jnp.asarray(prompt.input_ids), jnp.asarray(prompt.attention_mask),
                          key=problem_key(cfg.seed, cfg.task, problem.id), config=gen_cfg,
                          eviction=cfg.eviction("full", None), row_ids=jnp.zeros((1,), jnp.int32))
        cache = res.cache
        num_layers = cache.v.shape[0] if hasattr(cache.v, "shape") else len(cache.v)
        kept = min(int(res.num_tokens[0]), cap)
        rows, valid = [], []
        for layer in range(num_layers):
            r, ok = value_rows(np.asarray(jax.device_get(cache.v[layer][0])),
                               np.asarray(jax.device_get(cache.pos[layer][0])), prompt_len + kept, sinks)
            rows.append(r)
            valid.append(ok)
        rows, valid = np.stack(rows), np.stack(valid)  # [L, Hkv * S, D], [L, Hkv * S]
        if acc is None:
            acc = Accumulator(num_layers, configs, seed=cfg.seed)
        ranges, mse = jax.device_get(layer_stats(jnp.asarray(rows), jnp.asarray(valid), configs))
        acc.add(ranges, mse, valid)
        if kv is not None:
            from vase_jax.analysis.kv_error import kv_error

            real = np.asarray(prompt.attention_mask[0]).astype(bool)
            sequence = np.concatenate([np.asarray(prompt.input_ids[0])[real],
                                       np.asarray(jax.device_get(res.tokens[0]))[:kept]])  # [prompt + kept]
            kv_stats = kv_error(model, sequence, stats=kv_stats, **kv)
        print(f"{PROG}: {i + 1}/{len(problems)} {problem.id}: {prompt_len} prompt + {kept} output tokens, "
              f"{int(valid[0].sum())} values per layer ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    meta = {"model": cfg.model, "task": cfg.task, "sinks": sinks, "limit": cfg.limit, "seed": cfg.seed,
            "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
            "max_new_tokens": cfg.max_new_tokens, "max_total_tokens": cfg.max_total_tokens, "dtype": cfg.dtype,
            "configs": [dataclasses.asdict(c) for c in configs]}
    summary = write_report(acc, out, meta)
    if kv_stats is not None:
        from vase_jax.analysis.kv_error import markdown

        summary["kv_error"] = kv_stats.summary()
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        with open(out / "summary.md", "a") as fh:
            fh.write("\n" + markdown(summary["kv_error"]))
    return summary


if __name__ == "__main__":
    sys.exit(main())
