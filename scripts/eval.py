#!/usr/bin/env python
"""Evaluate KV-eviction methods on a reasoning task with the paper's protocol (resumable).

    python scripts/eval.py                      # the packaged trained model on its task, offline (see below)
    python scripts/eval.py --model Qwen/Qwen3-0.6B --task gsm8k --methods full,vase_attnv --budgets 512

With no --model, the packaged model (`vase_jax/data/models/varchain-qwen3`, trained by scripts/train.py) runs on
its task (`varchain`): every method of the paper and H2O and KeyDiff at the task's budgets, and `full` and
vase_dkv with the K8V8 and K4V4 caches as well; greedy, on the first 128 of the 200 held-out problems (about 7
minutes on 2 CPU cores; --limit 200 for all).

Defaults follow the paper per task (R samples, budget N, Nv = N/4, buffer 64, prompt + output <= the task's
total-token cap, temperature 0.6, top-p 0.95, top-k off). Writes DIR/records.jsonl (one graded sample per
line), DIR/summary.json, DIR/summary.md, DIR/accuracy_vs_budget.png, DIR/output_lengths.png and
DIR/config.json. Rerun the same command to resume an interrupted run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from pathlib import Path

PROG = "eval.py"
PACKAGED_METHODS = ("full", "snapkv", "rkv", "rkv_official", "curdkv", "vase_attnv", "vase_dkv", "h2o", "keydiff",
                    "triattention")


def build_parser() -> argparse.ArgumentParser:
    from vase_jax.cli import Parser, comma_list, int_or_auto
    from vase_jax.evaluation.config import RANDOM_MODELS

    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="hub id (Qwen/Qwen3-4B), HF checkpoint folder, or orbax folder (default: the "
                     "packaged varchain model)")
    src.add_argument("--random-model", choices=sorted(RANDOM_MODELS),
                     help="a tiny random Qwen3 built in memory (offline smoke runs; answers are noise)")
    p.add_argument("--task", help="varchain (the default with the packaged model), gsm8k, math500, aime24/25/26, "
                   "hmmt25, amc, minerva, "
                   "olympiadbench, gpqa (gpqa needs --data), livecodebench (needs --data or --tests-dir)")
    p.add_argument("--data", help="JSONL file in the task's format instead of the packaged set (livecodebench: "
                   "the official release file, or the authors' test.jsonl with --tests-dir)")
    p.add_argument("--tests-dir", help="livecodebench: folder of the authors' per-problem test files "
                   "(<global_id>.json, md5-checked); prompts from --data or the packaged test.jsonl")
    p.add_argument("--methods", type=comma_list(str),
                   help="comma list: 'full' (no eviction) and policies of vj.eviction.METHODS (snapkv, rkv, "
                   "rkv_official, curdkv, vase_attnv, vase_dkv, h2o, keydiff, triattention, ablations; default: "
                   "full,vase_attnv; "
                   f"with the packaged model: {','.join(PACKAGED_METHODS)})")
    p.add_argument("--budgets", type=comma_list(int), help="comma list of KV budgets N (default: the task's)")
    p.add_argument("--calibration", help="triattention's query statistics file (default: the model folder's "
                   "triattention_stats.npz, made by scripts/calibrate.py)")
    p.add_argument("--kv-bits", type=comma_list(str),
                   help="comma list of cache settings, each run for every method and budget: bf16 (the 16-bit "
                   "cache, default) or K<bits>V<bits>[g<group>] (a mixed-precision cache: keys and values in 8 "
                   "or 4 bits, the slots of largest Range(v) and the recent B in 16 bits), e.g. bf16,K8V8,K4V4 "
                   "(default: bf16; with the packaged model: bf16,K8V8,K4V4)")
    p.add_argument("--kv-methods", type=comma_list(str),
                   help="the methods that run with the mixed-precision settings of --kv-bits (default: those of "
                   "--methods that run on that cache, every one but triattention; with the packaged model: "
                   "full,vase_dkv)")
    p.add_argument("--kv-protected", type=int,
                   help="16-bit slots of a mixed-precision cache kept for their Range(v) (default: Nv with "
                   "vase_attnv and the range_* methods, 0 with the other evicting methods, a quarter of the cache "
                   "without eviction)")
    p.add_argument("--buffer", type=int, help="eviction buffer / period B (default: the task's, 64; varchain 32)")
    p.add_argument("--compress-prompt", action="store_true", help="evict a prompt longer than N to N right after "
                   "the prefill, with the method's own scores: every cache N + B slots (default: the paper's, the "
                   "prompt kept)")
    p.add_argument("--prefill-chunk", type=int, default=256, help="prompt tokens per prefill chunk (default 256; a "
                   "bucket of at most this many tokens runs densely); 0: always the dense prefill")
    p.add_argument("--value-slots", type=int, help="protected value slots Nv (default: N/4 for each budget)")
    p.add_argument("--samples", type=int, help="samples R per problem (default: the task's)")
    p.add_argument("--max-new-tokens", type=int,
                   help="output cap per sample (default: --max-total-tokens minus each prompt)")
    p.add_argument("--max-total-tokens", type=int,
                   help="prompt + output cap when --max-new-tokens is not given (default: the task's, 32768; "
                   "gsm8k 4096)")
    p.add_argument("--temperature", type=float, help="default 0.6")
    p.add_argument("--top-p", type=float, help="default 0.95")
    p.add_argument("--top-k", type=int, help="default 0 (off)")
    p.add_argument("--batch-size", type=int_or_auto, help="rows of the batch (default: R); continuous: samples of "
                   "any problem, at most the samples left to run; static: rows per generate call, all of one "
                   "problem. 'auto' (continuous, one device): the most rows that fit the device, per method and "
                   "budget, planned with its compiler")
    p.add_argument("--scheduler", choices=("continuous", "static"),
                   help="continuous: a row takes the next sample as soon as its sample ends (the default on one "
                   "device); static: one generate call per chunk of a problem's samples (the default, and the only "
                   "choice, on a mesh of several devices or processes). Same tokens either way")
    p.add_argument("--limit", type=int, help="first N problems (default: all; gsm8k: 500; varchain: 128)")
    p.add_argument("--seed", type=int, help="default 0")
    p.add_argument("--out", help="output folder (default: runs/<task>/<model name>)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    p.add_argument("--save-text", action="store_true", help="also store each decoded completion")
    p.add_argument("--replay", action="store_true",
                   help="teacher-forced replay instead of sampling: each evicting method and budget fed the full "
                   "cache's greedy traces; KL(full || evicted), top-1 agreement and NLL per position bucket "
                   "(DIR/replay.md, replay.json; resumable)")
    p.add_argument("--mesh", help="data=D,model=M: rows over D devices, heads over M (default: every device in "
                   "data, model=1); D x M must be the number of devices of all processes")
    p.add_argument("--coordinator", help="HOST:PORT of process 0, for a run over several processes (hosts); "
                   "every process runs the same command with its own --process-id")
    p.add_argument("--num-processes", type=int, help="processes of a multi-process run")
    p.add_argument("--process-id", type=int, help="this process's index, 0..num-processes-1")
    p.add_argument("--compile-cache", metavar="DIR", help="JAX's persistent compilation cache: compiled programs "
                   "kept for later runs (default $VASE_JAX_COMPILATION_CACHE or ~/.cache/vase-jax/xla, 4 GiB at most)")
    p.add_argument("--no-compile-cache", action="store_true", help="compile every program anew in this run")
    return p


def _default_out(task: str, model: str) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model.rstrip("/")).name or model)
    return Path("runs") / task / name


def main(argv: list[str] | None = None) -> int:
    # transformers says "PyTorch was not found" at import where torch is absent (the eval extra has none, and
    # needs none: the models run in JAX); an advisory line of noise on every run
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    args = build_parser().parse_args(argv)

    def fail(msg: str) -> int:
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2

    def warn(msg: str) -> None:
        print(f"{PROG}: warning: {msg}", file=sys.stderr)

    from vase_jax import distributed
    from vase_jax import evaluation as ev
    from vase_jax.evaluation.config import packaged_model_dir
    from vase_jax.jit import compilation_cache_dir, enable_compilation_cache
    from vase_jax.sharding import parse_mesh
    from vase_jax.tasks import get_task

    packaged = not args.random_model and args.model is None
    model = f"random:{args.random_model}" if args.random_model else (args.model or str(packaged_model_dir()))
    if args.task is None and not packaged:
        return fail("--task is required with --model or --random-model (the packaged model's task, varchain, is the "
                    "default only without them)")
    task = args.task or "varchain"
    if packaged:  # the offline default run: every method, and the mixed-precision caches for full and vase_dkv
        args.methods = args.methods or PACKAGED_METHODS
        if args.kv_bits is None:
            args.kv_bits = ("bf16", "K8V8", "K4V4")
            args.kv_methods = args.kv_methods or ("full", "vase_dkv")
    args.methods = args.methods or ("full", "vase_attnv")
    args.kv_bits = args.kv_bits or ("bf16",)
    try:  # checked before anything starts: a mesh or process flag that cannot work fails here, in every process
        mesh_sizes = parse_mesh(args.mesh) if args.mesh else None
        multi = distributed.check_args(args.coordinator, args.num_processes, args.process_id)
    except ValueError as e:
        return fail(str(e))
    if multi:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    if not args.no_compile_cache:  # before anything compiles: a rerun on the same shapes loads its programs
        try:
            enable_compilation_cache(args.compile_cache)
        except OSError as e:
            return fail(f"--compile-cache={args.compile_cache or str(compilation_cache_dir())!r}: {e}")
    writer = distributed.is_writer()
    try:
        cfg, problems = ev.resolve(
            model=model, task=task, data=args.data, methods=args.methods, budgets=args.budgets,
            buffer=args.buffer, value_slots=args.value_slots, samples=args.samples,
            max_new_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, batch_size=args.batch_size,
            limit=args.limit, seed=args.seed, dtype=args.dtype, save_text=args.save_text,
            tests_dir=args.tests_dir, scheduler=args.scheduler or "continuous", kv_bits=args.kv_bits,
            kv_protected=args.kv_protected, kv_methods=args.kv_methods, calibration=args.calibration,
            compress_prompt=args.compress_prompt, prefill_chunk=args.prefill_chunk or None,
        )
        out = Path(args.out) if args.out else _default_out(cfg.task, model)
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out={str(out)!r} exists and is not a folder")
        ev.check_resume(cfg, out)
        mesh = _mesh(cfg, mesh_sizes)
        if mesh is not None or multi:  # the continuous engine runs on one device (README, "Continuous batching")
            if args.scheduler == "continuous":
                raise ValueError("--scheduler continuous runs on one device; with --mesh or several processes use "
                                 "--scheduler static (the same tokens)")
            cfg = dataclasses.replace(cfg, scheduler="static")
            if multi and any(kv != ev.BF16 for kv in cfg.kv_bits):
                raise ValueError(f"--kv-bits {','.join(cfg.kv_bits)}: a mixed-precision cache runs on one process "
                                 "(on a --mesh of its devices too), not over several processes yet")
        # only the writer (process 0) reads and writes the records; the others follow its store (runner.run)
        store = ev.RecordStore(out / "records.jsonl" if writer else os.devnull, warn=warn)
    except (ValueError, OSError) as e:
        return fail(str(e))
    if writer:
        ev.write_config(cfg, out)
    if args.replay:
        return _replay(ev, cfg, problems, out, mesh, multi)
    wanted = ev.wanted_keys(cfg, problems)
    todo = sum(not done for done in distributed.agree([k in store for k in wanted]))
    if todo and get_task(cfg.task).grader == "code":  # say once what the sandbox contains, and what not
        from vase_jax.sandbox import SandboxError, probe

        try:
            print(probe().describe(), file=sys.stderr)
        except SandboxError as e:
            return fail(f"--task {cfg.task}: model code cannot be run safely here: {e}")
    if todo:
        print(f"{PROG}: {cfg.task}: {len(problems)} problems x {cfg.samples} samples x {len(cfg.variants)} "
              f"variants; {len(wanted) - todo} done, {todo} to go -> {out}", file=sys.stderr)
        try:
            try:
                tokenizer, cfg, model = _load(ev, cfg, mesh)
            except (ValueError, OSError) as e:
                return fail(f"--model={cfg.model!r}: {e}".replace("\n", " "))
            _run_with_progress(ev, model, tokenizer, cfg, problems, store, wanted)
        except KeyboardInterrupt:
            print(f"\n{PROG}: interrupted; rerun the same command to resume", file=sys.stderr)
            return 130
    if not writer:
        return 0
    summary = ev.write_summary(cfg, store, wanted, out)
    print(ev.markdown(summary))
    print(f"wrote {out}/summary.md, summary.json, accuracy_vs_budget.png, output_lengths.png, records.jsonl")
    return 0


def _load(ev, cfg, mesh):
    """(tokenizer, cfg with the model's own end tokens, model): a hub id is fetched once, by the tokenizer."""
    tokenizer = ev.load_tokenizer(cfg.model)
    cfg = dataclasses.replace(cfg, eos_token_ids=ev.end_tokens(cfg.model))
    return tokenizer, cfg, ev.load_model(cfg.model, cfg.dtype, mesh)


def _replay(ev, cfg, problems, out: Path, mesh, multi: bool) -> int:
    """--replay: `vase_jax.evaluation.replay_eval.run_replay` on one device; prints the table."""
    from vase_jax.evaluation.replay_eval import run_replay

    if mesh is not None or multi:
        print(f"{PROG}: error: --replay runs on one device", file=sys.stderr)
        return 2
    try:
        tokenizer, cfg, model = _load(ev, cfg, None)
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: --model={cfg.model!r}: {e}".replace("\n", " "), file=sys.stderr)
        return 2
    count = sum(m != "full" for m, _, kv in cfg.variants if kv == ev.BF16)
    print(f"{PROG}: replay of {len(problems)} problems x {count} variants -> {out}/replay.md", file=sys.stderr)
    t0 = time.perf_counter()

    def progress(row: dict) -> None:
        print(f"  {row['method']}@{row['budget']}: KL {row['kl']:.4f}, top-1 {100 * row['agree']:.1f}% "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)

    run_replay(model, tokenizer, cfg, problems, out, progress)
    print((out / "replay.md").read_text())
    return 0


def _mesh(cfg, sizes: dict | None):
    """The run's mesh over the devices of every process: --mesh, or all of them in `data`. None on one device.
    ValueError when it does not fit the devices, the rows per call or (for a config known before loading) the
    model's heads."""
    import jax

    from vase_jax.sharding import check_mesh, make_mesh

    count = jax.device_count()
    sizes = sizes or {"data": count, "model": 1}
    if sizes["data"] * sizes["model"] != count:
        raise ValueError(f"--mesh data={sizes['data']},model={sizes['model']} has {sizes['data'] * sizes['model']} "
                         f"devices; this run has {count} (over {jax.process_count()} process(es))")
    if count == 1:
        return None
    if cfg.batch_size == "auto":
        raise ValueError(f"--batch-size auto sizes the continuous engine, which runs on one device; this run has "
                         f"{count} devices: give --batch-size N")
    mesh = make_mesh(sizes["data"], sizes["model"])
    model_cfg = _model_config(cfg.model)
    if model_cfg is not None:  # a hub id is checked when it is loaded (from_pretrained(mesh=))
        check_mesh(model_cfg, mesh)
    if cfg.rows % sizes["data"]:
        raise ValueError(f"mesh data={sizes['data']} does not divide the {cfg.rows} rows per call (--batch-size)")
    return mesh


def _model_config(model: str):
    """The model's Qwen3Config when it is known without loading anything (random, or a local folder)."""
    from vase_jax.config import Qwen3Config
    from vase_jax.evaluation.config import RANDOM_MODELS, RANDOM_PREFIX

    if model.startswith(RANDOM_PREFIX):
        return RANDOM_MODELS[model[len(RANDOM_PREFIX):]]
    path = Path(model) / "config.json"
    return Qwen3Config.from_json_file(path) if path.exists() else None


def _run_with_progress(ev, model, tokenizer, cfg, problems, store, wanted) -> None:
    from tqdm import tqdm

    from vase_jax.jit import release_programs_near_mapping_limit

    per_problem = len(wanted) // len(problems)
    have: dict[str, int] = {}
    correct = graded = 0
    for key in wanted:
        rec = store.records.get(key)
        if rec is not None:
            have[key[0]] = have.get(key[0], 0) + 1
            correct, graded = correct + bool(rec["correct"]), graded + 1
    counted = {pid for pid, n in have.items() if n == per_problem}
    tokens, t0 = 0, time.perf_counter()
    bar = tqdm(total=len(problems), initial=len(counted), unit="problem", desc=cfg.task, dynamic_ncols=True)

    def progress(new: list[dict], finished: str | None) -> None:
        nonlocal correct, graded, tokens
        tokens += sum(r["tokens"] for r in new)
        correct += sum(bool(r["correct"]) for r in new)
        graded += len(new)
        bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.1f}",
                        acc=f"{100 * correct / max(graded, 1):.1f}%", samples=f"{graded}/{len(wanted)}",
                        refresh=False)
        release_programs_near_mapping_limit()  # between calls: XLA:CPU crashes at the process's mapping limit
        if finished is not None and finished not in counted:
            counted.add(finished)
            bar.update(1)
        else:
            bar.refresh()

    try:
        ev.run(model, tokenizer, cfg, problems, store, progress=progress)
    finally:
        bar.close()


if __name__ == "__main__":
    sys.exit(main())
