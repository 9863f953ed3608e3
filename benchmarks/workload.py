"""The AIME25 protocol's shape on random weights: each eviction method measured for a while on the engine, the whole
protocol (about 6M tokens) projected from the engine's schedule, which `simulate_engine` replays on the host by
`batching.run`'s rules, written again here (every measured run and the tests compare the two)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.decode_step import row_replay
from benchmarks.report import names
from benchmarks.timing import Stat
from vase_jax import batching, planner
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import GenerateConfig, row_rule
from vase_jax.model import Qwen3
from vase_jax.target import Target, platform_of

# The paper's AIME25 protocol: 30 problems x R = 16 samples, at most 32768 tokens per sample (prompt + output),
# Qwen3's sampling. It gives no per-sample output lengths: a log-normal with median 12k and sigma 0.5 (our choice),
# cut at the cap, puts about 2% of the samples at the cap and averages about 13.4k tokens (6.4M per method).
AIME25 = {"samples": 480, "prompt_len": 256, "total_tokens": 32768, "median": 12000, "sigma": 0.5}
AIME25_TINY = {"samples": 24, "prompt_len": 16, "total_tokens": 256, "median": 96, "sigma": 0.5}
PROJECTION = ("T = rounds * round_s + steps * step_s + slot_reads * slot_s + events * event_s (rounds, steps, "
              "slot_reads, events: the engine's schedule of the drawn lengths, simulated; slot_reads: the cache "
              "slots the steps' attention reads, over rows and steps; the seconds: fitted to the measured runs)")
ATTENTION_READS = ("own", "longest")
DEADLINE_MARGIN_S = 15.0  # aime25_workload: left after the measuring for the projection and the write
CHECK_SHARE, FIRST_WINDOW = 0.3, 32  # measure_engine: the check's share of the time; the first window's tokens


def lognormal_lengths(samples: int, *, median: float, sigma: float, cap: int, seed: int = 0) -> np.ndarray:
    """[samples] int32 output lengths (the end token included): round(median * exp(sigma * z)), z ~ N(0, 1) from
    `np.random.default_rng(seed)`, clipped to [2, cap] (a prefill token and a decode step at least)."""
    if not (samples >= 1 and median > 0 and sigma >= 0 and cap >= 2):
        raise ValueError(f"need samples={samples} >= 1, median={median} > 0, sigma={sigma} >= 0, cap={cap} >= 2")
    z = np.random.default_rng(seed).standard_normal(samples)
    return np.clip(np.rint(median * np.exp(sigma * z)), 2, cap).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class EngineSchedule:
    """What `batching.run` does with a list of sample lengths, replayed on the host (`simulate_engine`)."""

    rows: int
    queue: int
    samples: int
    tokens: int  # sum of the lengths
    rounds: int  # engine calls (one prefill of up to `queue` samples each)
    steps: int  # decode steps the batch runs
    events: int  # eviction events (steps after which some row is evicted)
    own_slot_reads: int  # cache slots the steps' attention reads, over rows, each up to its own length (Pallas)
    longest_slot_reads: int  # the same, each row up to the longest row's length (the XLA path)
    useful_row_steps: int  # row-steps that produce a token of some sample

    @property
    def utilization(self) -> float:
        return self.useful_row_steps / max(self.rows * self.steps, 1)

    def slot_reads(self, reads: str) -> int:
        """`own_slot_reads` (reads="own") or `longest_slot_reads` (reads="longest")."""
        return self.own_slot_reads if reads == "own" else self.longest_slot_reads


def simulate_engine(lengths, rows: int, eviction: EvictionConfig, prompt_len: int,
                    queue: int | None = None) -> EngineSchedule:
    """Replay `batching.run` on samples of `lengths` tokens (each ends at its cap: no end token) with prompts of
    `prompt_len` tokens, on `rows` rows, `queue` samples staged per round (default `batching.default_queue(rows)`).
    The engine's rules: each round stages the next `queue` samples; a free row (in row order) takes the next staged
    sample and starts decoding at once (`full`) or at the next multiple of B steps (eviction: its trigger phase on
    the batch's ticks); a sample of n tokens decodes n - 1 steps; the round ends when every row is done, or when a
    row is free, nothing staged is left and more samples wait; the last round drains. A step's attention reads the
    slots of the rows that decode (a waiting or ended row is inactive: length 0 to it), each up to its own length
    (`own_slot_reads`) or up to the longest row's (`longest_slot_reads`)."""
    lengths, rows = np.asarray(lengths, np.int64), int(rows)
    queue = batching.default_queue(rows) if queue is None else int(queue)
    period = eviction.buffer if eviction.evicts else 1
    busy_until, decodes, t = [None] * rows, [], 0  # per row: the step its sample ends (None: free)

    def collect_admit(staged: range, used: int) -> int:
        """Ended rows become free; free rows take staged samples in row order. Returns the staged used."""
        for r in range(rows):
            if busy_until[r] is not None and busy_until[r] <= t:
                busy_until[r] = None
            if busy_until[r] is None and used < len(staged):
                n, start = int(lengths[staged[used]]) - 1, t + (-t) % period
                busy_until[r], used = (start + n if n > 0 else t), used + 1
                decodes.append((start, n))
        return used

    for first in range(0, len(lengths), queue):  # a round: the next `queue` samples staged
        staged = range(first, min(first + queue, len(lengths)))
        used = collect_admit(staged, 0)
        while True:
            busy = [d for d in busy_until if d is not None and d > t]
            if not busy or (staged.stop < len(lengths) and used >= len(staged) and None in busy_until):
                break
            if not any(d is not None and d <= t for d in busy_until):
                t = min(busy)  # decode until a running row is done
            used = collect_admit(staged, used)
    reads, _, triggers = row_replay(eviction, prompt_len, max(int(lengths.max()) - 1 if len(lengths) else 0, 1))
    cumulative = np.concatenate([[0], np.cumsum(reads)])
    longest, event = np.zeros(t, np.int64), np.zeros(t, bool)  # per step: the longest row's length, an event
    for start, n in decodes:  # a row reads its slots only while it decodes (waiting or ended, it is inactive)
        longest[start:start + n] = np.maximum(longest[start:start + n], reads[:n])
        event[start + triggers[triggers <= n] - 1] = True
    return EngineSchedule(rows, queue, len(lengths), int(lengths.sum()), -(-len(lengths) // queue), t, int(event.sum()),
                          own_slot_reads=sum(int(cumulative[n]) for _, n in decodes),
                          longest_slot_reads=rows * int(longest.sum()), useful_row_steps=sum(n for _, n in decodes))


def attention_reads(platform: str, attention_impl: str) -> str:
    """How the decode attention bounds a row: the Pallas kernels (cuda, tpu; `attention_impl` "auto" or "pallas*")
    read each row's slots up to its own length ("own"); the XLA path (CPU's, or "xla") to the longest's ("longest")."""
    return "longest" if attention_impl == "xla" or (platform == "cpu" and attention_impl == "auto") else "own"


@dataclasses.dataclass(frozen=True)
class StepModel:
    """Wall seconds of an engine run from its schedule, `PROJECTION`'s T: `round_s`: a round's prefill, admissions,
    results and host round trip; `step_s`: a decode step's fixed cost (weights, sampling); `slot_s`: per cache slot
    read (the schedule's `slot_reads(reads)`, `attention_reads`); `event_s`: an eviction event."""

    round_s: float
    step_s: float
    slot_s: float
    event_s: float
    reads: str = "own"

    def seconds(self, s: EngineSchedule) -> float:
        return (s.rounds * self.round_s + s.steps * self.step_s + s.slot_reads(self.reads) * self.slot_s
                + s.events * self.event_s)


def fit_step_model(round_s: float, windows: list[tuple[EngineSchedule, float]], reads: str = "own") -> StepModel:
    """`StepModel` from measured runs [(schedule, seconds)]: y = seconds - rounds * round_s regressed on (steps,
    slot_reads, events) by non-negative least squares: of the least-squares fits on `steps` and each subset of the
    other columns (those nonzero in some run) whose coefficients are all >= 0, the fewest columns within 1e-9 * |y|^2
    of the least error (past the first eviction, lockstep runs' slot_reads are a combination of steps and events);
    if none, step_s = sum(y) / sum(steps)."""
    if not windows or reads not in ATTENTION_READS:
        raise ValueError(f"fit_step_model: {len(windows)} runs (need one), reads={reads!r} (one of {ATTENTION_READS})")
    x = np.array([[s.steps, s.slot_reads(reads), s.events] for s, _ in windows], np.float64)
    y = np.array([sec - s.rounds * round_s for s, sec in windows], np.float64)
    live = [j for j in (1, 2) if x[:, j].any()]
    fits = []  # (columns, squared error, {column: coefficient}) where every coefficient is >= 0
    for cols in ([0], *[[0, j] for j in live], [0, *live] if len(live) == 2 else None):
        if cols and len(cols) <= len(windows):
            c = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
            if (c >= 0).all():
                fits.append((len(cols), float(np.sum((x[:, cols] @ c - y) ** 2)), dict(zip(cols, c, strict=True))))
    least = min((f[1] for f in fits), default=0.0)
    good = [f for f in fits if f[1] <= least + 1e-9 * float(y @ y)]
    coef = min(good, key=lambda f: f[:2])[2] if good else {0: max(float(y.sum()), 0.0) / max(float(x[:, 0].sum()), 1.0)}
    return StepModel(round_s, *(float(coef.get(j, 0.0)) for j in range(3)), reads)


def measure_engine(model: Qwen3, ev: EvictionConfig, make_requests: Callable[[list[int]], list], rows: int,
                   queue: int, config: GenerateConfig, prompt_len: int, lengths: np.ndarray, seconds: float, reads: str,
                   log: Callable[[str], None]) -> dict:
    """Steps 1-4 of `aime25_workload` for one method on `rows` rows (after the compile): round_s, the windows, the
    fitted `StepModel` (slots counted as `reads`), the check and the projection. Returns the record."""
    label, cap, t0 = ev.label, config.max_new_tokens, time.perf_counter()

    def timed(caps) -> tuple[float, batching.EngineStats, EngineSchedule]:  # their match recorded
        """Wall seconds of `batching.run` on samples of `caps` tokens, its stats and its simulated schedule."""
        stats, start = batching.EngineStats(), time.perf_counter()
        batching.run(model, make_requests(caps), rows=rows, config=config, eviction=ev, stats=stats, queue=queue)
        sec, sched = time.perf_counter() - start, simulate_engine(caps, rows, ev, prompt_len, queue)
        matches.append(stats.steps == sched.steps and stats.events == sched.events)
        return sec, stats, sched

    def fits(n: int) -> bool:  # a window of n tokens in the windows' time, as the fit so far predicts it
        return time.perf_counter() + fit.seconds(simulate_engine([n] * rows, rows, ev, prompt_len, queue)) <= window_end

    matches: list[bool] = []  # the simulated schedules against the engine's
    round_s = Stat.of(timed([1] * rows)[0] for _ in range(3))
    triggers = row_replay(ev, prompt_len, cap - 1)[2] if ev.evicts else []
    reach = min(int(triggers[0]) + 2 * ev.buffer + 1, cap) if len(triggers) else 0  # two events past the first
    window_end, length, windows = t0 + (1 - CHECK_SHARE) * seconds, min(FIRST_WINDOW, cap), []
    while True:  # L, 2L, 4L, ... (at least two), while the next fits the windows' time
        sec, _, sched = timed([length] * rows)
        windows.append((sched, sec))
        fit = fit_step_model(round_s.median, windows, reads)
        log(f"{label}: window {length} tokens x {rows} rows: {sec:.2f} s ({sched.steps} steps, {sched.events} events)")
        # past the first eviction while the time allows, so that the events' cost is measured
        jump = len(windows) >= 2 and reach > 2 * length and not any(s.events for s, _ in windows) and fits(reach)
        nxt = reach if jump else min(2 * length, cap)
        if length >= cap or (len(windows) >= 2 and not fits(nxt)):
            break
        length = nxt
    # the check: the first drawn samples, their lengths scaled by (time left - rounds) / (the model's seconds - rounds)
    first = lengths[: 3 * rows]
    whole, left = simulate_engine(first, rows, ev, prompt_len, queue), max(t0 + seconds - time.perf_counter(), 0.0)
    rounds_s, whole_s = whole.rounds * fit.round_s, fit.seconds(whole)
    scale = 1.0 if whole_s <= left else min(max((left - rounds_s) / max(whole_s - rounds_s, 1e-9), 1e-6), 1.0)
    caps = np.clip(np.rint(first * scale), 2, cap).astype(np.int32)
    sec, stats, sched = timed(caps)
    check = {"samples": len(caps), "scale": scale, "tokens": int(caps.sum()), "seconds": sec,
             "predicted_s": fit.seconds(sched), "tok_s": int(caps.sum()) / sec, "steps": sched.steps,
             "engine_steps": stats.steps, "events": sched.events, "engine_events": stats.events,
             "utilization": sched.utilization, "error": fit.seconds(sched) / sec - 1}
    log(f"{label}: check {len(caps)} samples (x {scale:.3f}): {sec:.2f} s, {check['predicted_s']:.2f} s predicted")
    proto = simulate_engine(lengths, rows, ev, prompt_len, queue)
    total, other = fit.seconds(proto), dataclasses.replace(fit, reads=ATTENTION_READS[reads == "own"])
    log(f"{label}: protocol {proto.tokens} tokens on {rows} rows: {proto.steps} steps, utilization "
        f"{proto.utilization:.2f}, projected {total / 60:.1f} min ({proto.tokens / total:.0f} tok/s)")
    return {"round_s": round_s.as_dict(), "model": dataclasses.asdict(fit), "check": check,
            "protocol": dataclasses.asdict(proto) | {
                "utilization": proto.utilization, "seconds": total, "tok_s": proto.tokens / total, "reads": reads,
                "seconds_if_" + other.reads: other.seconds(proto),
                "step_ms": 1e3 * (total - proto.rounds * fit.round_s) / max(proto.steps, 1)},
            "windows": [{"length": s.tokens // s.samples, "seconds": w, "steps": s.steps, "events": s.events,
                         "slot_reads": s.slot_reads(reads), "tok_s": s.tokens / w, "predicted_s": fit.seconds(s)}
                        for s, w in windows],
            "window_tok_s": windows[-1][0].tokens / windows[-1][1], "schedules_match_engine": all(matches),
            "steady": (not ev.evicts) or any(s.events > 0 for s, _ in windows), "measure_s": time.perf_counter() - t0}


def aime25_workload(model: Qwen3, methods: list[EvictionConfig], *, shape: dict = AIME25,
                    seconds_per_method: float = 120.0, batch: int | None = None, seed: int = 0,
                    device_bytes: int | None = None, headroom: float = planner.DEFAULT_HEADROOM,
                    queue: int | None = None, max_rows: int = planner.MAX_ROWS, attention_impl: str = "auto",
                    layer_loop: str = "auto", deadline: float | None = None,
                    on_method: Callable[[dict], object] = lambda out: None, log: Callable[[str], None] = print) -> dict:
    """The AIME25 protocol's `shape` (`AIME25`'s keys) per eviction method on `model` (random weights will do):
    `samples` random prompts of `prompt_len` tokens, output lengths `lognormal_lengths(median, sigma, cap =
    total_tokens - prompt_len)` (no end token), decoded by `batching.run` on `batch` rows, else the most that fit
    the device (`planner.largest_batch`: `device_bytes`, default its allocator limit, less `headroom`; it compiles
    the engine at 3+ sizes, which `scripts/plan.py --batch auto` spares a device). Each method is measured for
    `seconds_per_method` after its plan and compile (plan_s, compile_s; a `deadline`, seconds since the epoch,
    shortens it to end by then less `DEADLINE_MARGIN_S`, at least 1 s: the record's `seconds`), and projected:
    1. round_s: the median of 3 runs of `rows` samples that end at the prefill (1 token): one round, no step;
    2. windows: lockstep runs of `rows` samples of L = `FIRST_WINDOW`, 2L, ... tokens (or two events past the first
       eviction) while the next fits in (1 - CHECK_SHARE) of the time; `fit_step_model` on them;
    3. check: the first min(samples, 3 * rows) drawn samples, lengths scaled by one factor to the time left, run
       continuously: predicted against measured seconds, simulated steps and events against the engine's;
    4. the protocol: `PROJECTION`'s T on `simulate_engine` of the drawn lengths, slot_reads counted as the
       platform's attention reads them (`attention_reads`; T with the other count too); tokens/s = tokens / T.
    Peak memory: the device's `peak_bytes_in_use` after the method (the process's so far), else the plan's total;
    `on_method(result so far)` after each method. Returns {"meta": ..., "methods": [records]}."""
    samples, prompt_len, cap = shape["samples"], shape["prompt_len"], shape["total_tokens"] - shape["prompt_len"]
    lengths = lognormal_lengths(samples, median=shape["median"], sigma=shape["sigma"], cap=cap, seed=seed)
    device = next(iter(jax.tree.leaves(nnx.state(model))[0].devices()))  # the one holding the weights
    config = GenerateConfig(max_new_tokens=cap, eos_token_ids=(), attention_impl=attention_impl,
                            layer_loop=layer_loop).validate()
    reads = attention_reads(platform_of(device), attention_impl)
    rng = np.random.default_rng(seed + 1)
    prompts = [tuple(int(t) for t in rng.integers(0, model.cfg.vocab_size, prompt_len)) for _ in range(samples)]

    def make_requests(caps) -> list:
        return [batching.Request(prompts[i % samples], jax.random.fold_in(jax.random.key(seed), i), i, int(n), i)
                for i, n in enumerate(caps)]

    meta = {"workload": "aime25", **shape, "max_new_tokens": cap,
            "lengths": {"lognormal": "clipped to [2, max_new_tokens]", "seed": seed, "mean": float(lengths.mean()),
                        "max": int(lengths.max()), "at_cap": int((lengths == cap).sum()), "tokens": int(lengths.sum())},
            "model": dataclasses.asdict(model.cfg), "dtype": jnp.dtype(model.dtype).name,
            "device": f"{device.device_kind} ({device.platform})", "seconds_per_method": seconds_per_method,
            "headroom": headroom, "formula": PROJECTION, "attention_reads": reads}
    out, common = {"meta": meta, "methods": []}, dict(target=device, config=config, prompt_len=prompt_len,
                                                      dtype=model.dtype, queue=queue)
    for ev in methods:
        rec = names(ev)
        start = time.perf_counter()
        if batch is None:
            found = planner.largest_batch(model.cfg, ev, device_bytes=device_bytes, headroom=headroom,
                                          samples=samples, max_rows=max_rows, **common)
            rows, plan = found.rows, found.plan
            rec |= {"rows_reason": found.reason, "batch_plan": found.as_dict()}
        else:
            rows = batch
            plan = planner.plan_engine(model.cfg, rows, ev, compile_program=False, **common)
            rec["rows_reason"] = f"given: {rows} rows"
        rec |= {"rows": rows, "plan_s": time.perf_counter() - start, "plan": None if plan is None else plan.as_dict()}
        log(f"{ev.label}: {rows} rows ({rec['rows_reason']})")
        if rows > 0:
            q = batching.queue_for(rows, queue, row_rule(model, config, Target.make(platform_of(device))))  # as `run`
            start = time.perf_counter()
            batching.run(model, make_requests([2] * rows), rows=rows, config=config, eviction=ev, queue=q)  # compiles
            seconds = seconds_per_method if deadline is None else max(  # what is left after the compile
                min(seconds_per_method, deadline - time.time() - DEADLINE_MARGIN_S), 1.0)
            rec |= {"queue": q, "compile_s": time.perf_counter() - start, "seconds": seconds} | measure_engine(
                model, ev, make_requests, rows, q, config, prompt_len, lengths, seconds, reads, log)
            peak = (device.memory_stats() or {}).get("peak_bytes_in_use")  # None on a CPU
            rec |= {"peak_bytes": peak if peak is not None else getattr(plan, "total", None),
                    "peak_source": "plan" if peak is None else "memory_stats peak_bytes_in_use (the process's so far)"}
        out["methods"].append(rec)
        on_method(out)
    return out
