"""The continuous scheduler of the eval: every missing sample of a (method, budget) as one stream of requests on
`batch_size` rows (`vase_jax.batching`; "auto": the most that fit the device, per method and budget), problems
mixed; each record is graded and written (fsynced) as soon as
the host sees its sample end: at the end of the engine's round, which stages `batch_size` samples.

A sample is request (prompt, key = `problem_key(seed, task, problem id)`, row id = sample index, cap = its exact
output cap), so its tokens are those of the static scheduler (`runner.run_chunk`), whose rows use the same key
rules; only the cap differs (the static call runs to its bucket's largest cap and cuts), which does not change the
tokens up to the exact cap. Compiles: one decode program per (method, budget), one prefill per prompt bucket.
A record's `seconds` is its sample's wall time in the batch divided by the number of rows (its share of the
batch), so that the records' seconds add up to the wall time, as under the static scheduler.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import jax
from flax import nnx

import vase_jax as vj
from vase_jax import batching, limits, planner
from vase_jax.evaluation.config import AUTO, EvalConfig
from vase_jax.evaluation.records import RecordStore, make_record, problem_key
from vase_jax.tasks import Problem, get_task


def run_continuous(model, tokenizer, cfg: EvalConfig, problems: list[Problem], store: RecordStore,
                   progress: Callable[[list[dict], str | None], None] | None = None) -> int:
    """`runner.run` with the continuous scheduler. Returns the samples generated."""
    task = get_task(cfg.task)
    by_id = {p.id: p for p in problems}
    prompts: dict[str, tuple[int, ...]] = {}
    missing = {(p.id, s, m, b, kv) for p in problems for m, b, kv in cfg.variants for s in range(cfg.samples)
               if (p.id, s, m, b, kv) not in store}
    left = {p.id: sum(k[0] == p.id for k in missing) for p in problems}  # samples still to run, per problem
    generated = 0
    for method, budget, kv in cfg.variants:
        todo = [(p.id, s) for p in problems for s in range(cfg.samples)
                if (p.id, s, method, budget, kv) in missing]
        if not todo:
            continue
        for pid, _ in todo:
            if pid not in prompts:
                enc = vj.encode_prompts(tokenizer, [task.build_prompt(by_id[pid].question)])
                prompts[pid] = tuple(int(x) for x in enc.input_ids[0, enc.input_ids.shape[1] - int(enc.lengths[0]):])
        caps = {pid: cfg.token_limits(len(prompts[pid]))[1] for pid, _ in todo}
        config = cfg.generate_config(max(caps.values()), kv)
        requests = [batching.Request(prompts[pid], problem_key(cfg.seed, cfg.task, pid), s, caps[pid], tag=(pid, s))
                    for pid, s in todo]

        rows = batch_rows(model, cfg, cfg.eviction(method, budget), config, max(len(p) for p in prompts.values()),
                          len(requests))

        def write(result: batching.Result, method=method, budget=budget, kv=kv, rows=rows) -> None:
            nonlocal generated
            pid, sample = result.tag
            rec = make_record(tokenizer, cfg, by_id[pid], sample, method, budget, len(prompts[pid]), result.tokens,
                              result.finished, result.evictions, result.seconds / rows, kv)
            store.append([rec])
            generated += 1
            left[pid] -= 1
            if progress is not None:
                progress([rec], pid if left[pid] == 0 else None)

        batching.run(model, requests, rows=rows, config=config,
                     eviction=cfg.eviction(method, budget), on_result=write)
    return generated


def batch_rows(model, cfg: EvalConfig, eviction, config, prompt_len: int, samples: int) -> int:
    """`cfg.batch_size`, or with "auto" the most rows of the engine that fit the model's device
    (`planner.largest_batch` with that device's compiler and its allocator limit; on a CPU, 80% of the host's
    available memory); at most `samples` (a row with no sample would only cost its steps); auto's reason is
    printed."""
    if cfg.batch_size != AUTO:
        return min(cfg.batch_size, samples)
    device = next(iter(jax.tree.leaves(nnx.state(model))[0].devices()))
    memory = planner.device_memory(device)
    if memory is None:  # the CPU: what the host has free
        memory = int(0.8 * limits.available_host_bytes())
    found = planner.largest_batch(model.cfg, eviction, target=device, device_bytes=memory, config=config,
                                  prompt_len=prompt_len, dtype=model.dtype, samples=samples)
    if found.rows < 1:
        raise ValueError(f"--batch-size auto: {found.reason}")
    print(f"--batch-size auto, {eviction.label}: {found.rows} rows ({found.reason})", file=sys.stderr)
    return found.rows
