"""The evaluation loop: problems x (method, budget) x chunks of samples -> graded records, resumably.

Randomness. Problem p's key is `fold_in(key(seed), stable_id(task, p.id))`, where `stable_id` is the first 31
bits of sha256("task/id"), and sample s is row stream `row_ids = s` of `generate`. A sample's tokens depend
on (seed, task, problem id, sample index, method, budget) and the settings, not on batch order or on which
samples were already done. All methods of a problem share its key (common random numbers for comparisons).

Schedulers. "continuous" (default, `vase_jax.evaluation.continuous`): `batch_size` rows, each refilled with
the next missing sample (of any problem) as soon as its sample ends. "static": the R samples of a problem run as
rows of one batch of the same prompt (as in the reference); with `batch_size < R`, as chunks of `batch_size`
rows, the last chunk padded with copies of its last row (discarded) so that every call has the same shape. A
chunk runs if any of its samples lacks a record; only the missing ones are written. Compiles: one per (prompt
bucket, method, budget). A sample's tokens are the same under both (each row is its own sequence,
`vase_jax.generate`).

Code tasks (livecodebench) are graded by running each sample's code on the problem's tests in
`vase_jax.sandbox` (tests in parallel on the CPU cores); the record's `reason` says why a sample failed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

import vase_jax as vj
from vase_jax import distributed
from vase_jax.evaluation.config import RANDOM_MODELS, RANDOM_PREFIX, EvalConfig
from vase_jax.evaluation.continuous import run_continuous
from vase_jax.evaluation.records import Key, RecordStore, make_record, problem_key, record_key
from vase_jax.kvquant import BF16
from vase_jax.random_model import HEAD_SCALE, random_model
from vase_jax.sharding import shard_model
from vase_jax.tasks import Problem, get_task
from vase_jax.weights import resolve_checkpoint


def load_model(model: str, dtype: str, mesh=None):
    """`Qwen3.from_pretrained(model)`, or for "random:<name>" a random Qwen3 (`vase_jax.random_model`, seed 0,
    output head scaled by `HEAD_SCALE` so that its next-token distribution is peaked like a trained model's and
    top-p keeps few tokens). `mesh`: sharded over it (`vase_jax.sharding`), so that `generate` runs on it."""
    if not model.startswith(RANDOM_PREFIX):
        return vj.Qwen3.from_pretrained(str(resolve_checkpoint(model)), dtype=getattr(jnp, dtype), mesh=mesh)
    built = random_model(RANDOM_MODELS[model[len(RANDOM_PREFIX):]], getattr(jnp, dtype), head_scale=HEAD_SCALE)
    return built if mesh is None else shard_model(built, mesh)


def end_tokens(model: str) -> tuple[int, ...] | None:
    """The end-of-sequence ids of `model`: its generation_config.json's `eos_token_id` (one or a list), else its
    config.json's; None (Qwen3's, `GenerateConfig`'s default) for a random model or a folder that names none."""
    if model.startswith(RANDOM_PREFIX):
        return None
    folder = resolve_checkpoint(model)
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return None


def load_tokenizer(model: str):
    """The model's tokenizer (a hub id is fetched once, with its weights, by `resolve_checkpoint`); the packaged
    Qwen3 tokenizer for a random model."""
    return vj.load_tokenizer(None if model.startswith(RANDOM_PREFIX) else str(resolve_checkpoint(model)))


@dataclasses.dataclass(frozen=True)
class Chunk:
    problem: Problem
    method: str
    budget: int | None
    samples: tuple[int, ...]  # sample indices of this call's rows (without padding)
    kv_bits: str = BF16  # the cache setting (`EvalConfig.kv_bits`)


def plan(cfg: EvalConfig, problems: list[Problem]) -> list[Chunk]:
    """Every generate call of the run, in order: problems, then (method, budget), then chunks of samples."""
    rows = cfg.rows
    return [
        Chunk(p, method, budget, tuple(range(start, min(start + rows, cfg.samples))), kv)
        for p in problems
        for method, budget, kv in cfg.variants
        for start in range(0, cfg.samples, rows)
    ]


def wanted_keys(cfg: EvalConfig, problems: list[Problem]) -> list[Key]:
    """The record keys this run asks for."""
    return [(p.id, s, m, b, kv) for p in problems for m, b, kv in cfg.variants for s in range(cfg.samples)]


def run_chunk(model, tokenizer, cfg: EvalConfig, chunk: Chunk, prompt) -> list[dict]:
    """Generate the rows of `chunk`, cut each at the exact cap, grade; one record per sample."""
    prompt_len = int(prompt.lengths[0])
    gen_tokens, cap = cfg.token_limits(prompt_len)  # the bucket's program, the prompt's exact cap
    row_ids = np.array(chunk.samples + (chunk.samples[-1],) * (cfg.rows - len(chunk.samples)), np.int32)
    ids = np.repeat(prompt.input_ids, cfg.rows, axis=0)  # [rows, prompt]
    mask = np.repeat(prompt.attention_mask, cfg.rows, axis=0)  # [rows, prompt]
    key = problem_key(cfg.seed, cfg.task, chunk.problem.id)
    t0 = time.perf_counter()
    out = vj.generate(model, ids, mask, key=key, config=cfg.generate_config(gen_tokens, chunk.kv_bits),
                      eviction=cfg.eviction(chunk.method, chunk.budget), row_ids=jnp.asarray(row_ids),
                      max_new_tokens=np.full((cfg.rows,), cap, np.int32))  # rows stop at the exact cap
    tokens, num, finished, evictions = distributed.fetch(
        (out.tokens, out.num_tokens, out.finished, out.row_evictions))  # [rows, gen_tokens], [rows] x 3
    seconds = time.perf_counter() - t0
    records = []
    for r, sample in enumerate(chunk.samples):
        records.append(make_record(tokenizer, cfg, chunk.problem, sample, chunk.method, chunk.budget, prompt_len,
                                   tokens[r, : int(num[r])], bool(finished[r]), int(evictions[r]),
                                   seconds / len(chunk.samples), chunk.kv_bits))
    return records


def run(model, tokenizer, cfg: EvalConfig, problems: list[Problem], store: RecordStore,
        progress: Callable[[list[dict], str | None], None] | None = None) -> int:
    """Generate every wanted sample that lacks a record, appending each record to `store` as soon as it exists.

    `cfg.scheduler`: "continuous" (`vase_jax.evaluation.continuous`: rows refilled as samples end, problems
    mixed) or "static" (every chunk of `plan` as one `generate` call). `progress(new_records, problem_id or
    None)` is called after each chunk or record, with the problem's id when the problem has no sample left to
    run. Returns the samples generated.

    Several processes (`vase_jax.distributed`): all run every generate call together; what is done is the
    writer's store, and only the writer appends records.
    """
    if cfg.scheduler == "continuous":
        return run_continuous(model, tokenizer, cfg, problems, store, progress)

    task = get_task(cfg.task)
    encoded: dict[str, vj.PromptBatch] = {}
    generated = 0
    chunks = plan(cfg, problems)
    keys = wanted_keys(cfg, problems)
    done = {k for k, d in zip(keys, distributed.agree([k in store for k in keys]), strict=True) if d}
    for i, chunk in enumerate(chunks):
        missing = [s for s in chunk.samples
                   if (chunk.problem.id, s, chunk.method, chunk.budget, chunk.kv_bits) not in done]
        last_of_problem = i + 1 == len(chunks) or chunks[i + 1].problem.id != chunk.problem.id
        new: list[dict] = []
        if missing:
            if chunk.problem.id not in encoded:
                prompt = task.build_prompt(chunk.problem.question)
                encoded = {chunk.problem.id: vj.encode_prompts(tokenizer, [prompt])}
            new = [r for r in run_chunk(model, tokenizer, cfg, chunk, encoded[chunk.problem.id])
                   if r["sample"] in missing]
            if distributed.is_writer():
                store.append(new)
            done.update(record_key(r) for r in new)
            generated += len(new)
        if progress is not None:
            progress(new, chunk.problem.id if last_of_problem else None)
    return generated
