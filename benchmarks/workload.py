"""The AIME25 protocol's shape on random weights: each eviction method measured for a while on the engine
(`vase_jax.batching`), the whole protocol projected from the engine's schedule (`aime25_workload`).

The schedule of 480 samples (about 6M tokens) is replayed on the host (`simulate_engine`): the engine's rounds,
steps, events and the cache slots its attention reads, which the engine does not report and cannot produce without
decoding. Its rules are `batching.run`'s, written again here; every measured run compares the two (steps, events:
`schedules_match_engine` in the record), and the tests compare them on the tiny model.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.decode_step import row_replay
from benchmarks.report import method_label
from benchmarks.timing import Stat
from vase_jax import batching, planner
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import GenerateConfig, row_rule
from vase_jax.model import Qwen3
from vase_jax.target import Target, platform_of

# The paper's AIME25 protocol (its "samples per problem R"): 30 problems x R = 16
# samples, at most 32768 tokens per sample in all (prompt + output), Qwen3's sampling (temperature 0.6, top-p 0.95).
AIME25 = {"samples": 480, "prompt_len": 256, "total_tokens": 32768, "median": 12000, "sigma": 0.5}
# The spec gives no per-sample output lengths for AIME25. A log-normal with median 12k and sigma 0.5 (our choice),
# cut at the cap, is heavy-tailed to the right, puts about 2% of the samples at the cap and averages about 13.4k
# tokens: about 6.4M generated tokens per method (the issue's ~6M).
AIME25_TINY = {"samples": 24, "prompt_len": 16, "total_tokens": 256, "median": 96, "sigma": 0.5}


def lognormal_lengths(samples: int, *, median: float, sigma: float, cap: int, seed: int = 0) -> np.ndarray:
    """Output lengths (tokens, the end token included) of `samples` samples: round(median * exp(sigma * z)),
    z ~ N(0, 1) from `np.random.default_rng(seed)`, clipped to [2, cap] (a prefill token and a decode step at
    least). [samples] int32."""
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples={samples!r} must be a positive int")
    if not median > 0 or not sigma >= 0:
        raise ValueError(f"median={median!r} must be > 0 and sigma={sigma!r} >= 0")
    if not isinstance(cap, int) or cap < 2:
        raise ValueError(f"cap={cap!r} must be an int >= 2")
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
    # cache slots the steps' attention reads, summed over steps and rows, for the two ways a decode attention
    # bounds a row: by its own length (the Pallas kernels), or by the longest row's (the XLA path: rows x longest)
    own_slot_reads: int
    longest_slot_reads: int
    useful_row_steps: int  # row-steps that produce a token of some sample

    @property
    def utilization(self) -> float:
        return self.useful_row_steps / max(self.rows * self.steps, 1)

    def slot_reads(self, reads: str) -> int:
        """`own_slot_reads` (reads="own") or `longest_slot_reads` (reads="longest")."""
        return self.own_slot_reads if reads == "own" else self.longest_slot_reads

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"utilization": self.utilization}


_FREE = -1


def simulate_engine(lengths, rows: int, eviction: EvictionConfig, prompt_len: int,
                    queue: int | None = None) -> EngineSchedule:
    """Replay `batching.run` on samples of `lengths` tokens (each ends at its cap, as with no end token), all with
    prompts of `prompt_len` tokens, on `rows` rows, `queue` samples staged per round (default
    `batching.default_queue(rows)`, as `run`).

    The engine's rules: each round stages the next `queue` samples; a free row (in row order) takes the next
    staged sample and starts decoding at once (`full`) or at the next multiple of B steps (eviction: its trigger
    phase on the batch's ticks); a sample of n tokens decodes n - 1 steps; the round ends when every row is done,
    or when a row is free, nothing staged is left and more samples wait; the last round drains. A row holds its
    prompt while it waits, one slot more per step (back to N after an eviction), and its last length once ended,
    until a new sample takes it; a step's attention reads the slots of the rows that decode (an inactive row's
    length is 0 to it), up to the row's own length (`own_slot_reads`) or up to the longest row's
    (`longest_slot_reads`). Returns the step, round and
    event counts and the slots read."""
    lengths = np.asarray(lengths, np.int64)
    rows = int(rows)
    queue = batching.default_queue(rows) if queue is None else int(queue)
    period = eviction.buffer if eviction.evicts else 1
    sample = [_FREE] * rows
    done_at = [0] * rows  # the step count at which the row's sample is done
    occupancy: list[list[tuple[int, int, int]]] = [[] for _ in range(rows)]  # per row: (admitted, start, steps)
    pending = list(range(len(lengths)))[::-1]
    t = rounds = 0

    def collect_admit(staged: list[int], used: int, t: int) -> int:
        """The ended rows become free; free rows take staged samples in row order. Returns the staged used."""
        for r in range(rows):
            if sample[r] >= 0 and done_at[r] <= t:
                sample[r] = _FREE
        for r in range(rows):
            if sample[r] == _FREE and used < len(staged):
                i, n = staged[used], int(lengths[staged[used]]) - 1
                used += 1
                start = t + (-t) % period
                sample[r], done_at[r] = i, (start + n if n > 0 else t)
                occupancy[r].append((t, start, n))
        return used

    while pending:
        staged = [pending.pop() for _ in range(min(queue, len(pending)))]
        rounds += 1
        more = bool(pending)
        used = collect_admit(staged, 0, t)
        while True:
            busy = [done_at[r] for r in range(rows) if sample[r] >= 0 and done_at[r] > t]
            starved = more and used >= len(staged) and _FREE in sample
            if not busy or starved:
                break
            if not any(sample[r] >= 0 and done_at[r] <= t for r in range(rows)):
                t = min(busy)  # decode until a running row is done
            used = collect_admit(staged, used, t)
    longest = int(lengths.max()) - 1 if len(lengths) else 0
    reads, after, triggers = row_replay(eviction, prompt_len, max(longest, 1))
    longest = np.zeros(t, np.int64)  # [steps] the longest row's cache length at each step
    own = 0  # every row's length, summed over steps
    event = np.zeros(t, bool)
    useful = 0
    cumulative = np.concatenate([[0], np.cumsum(reads)])
    for r in range(rows):
        for _, start, n in occupancy[r]:
            useful += n
            # a row reads its slots only while it decodes: waiting for its tick and once ended it is inactive,
            # and the attention reads nothing of it (`model.attention`)
            longest[start:start + n] = np.maximum(longest[start:start + n], reads[:n])
            own += int(cumulative[n])
            event[start + triggers[triggers <= n] - 1] = True
    return EngineSchedule(rows=rows, queue=queue, samples=len(lengths), tokens=int(lengths.sum()), rounds=rounds,
                          steps=t, events=int(event.sum()), own_slot_reads=own,
                          longest_slot_reads=rows * int(longest.sum()), useful_row_steps=useful)


PROJECTION = ("T = rounds * round_s + steps * step_s + slot_reads * slot_s + events * event_s (rounds, steps, "
              "slot_reads, events: the engine's schedule of the drawn lengths, simulated; slot_reads: the cache "
              "slots the steps' attention reads, over rows and steps; the seconds: fitted to the measured runs)")
ATTENTION_READS = ("own", "longest")


def attention_reads(platform: str, attention_impl: str) -> str:
    """How the decode attention bounds a row, per platform and `GenerateConfig.attention_impl`: the Pallas
    kernels (cuda, tpu; "auto", "pallas", "pallas_gpu", "pallas_tpu") read each row's slots up to its own length
    ("own"); the XLA path (CPU's, or "xla") loops to the longest row's ("longest")."""
    if attention_impl == "xla" or (platform == "cpu" and attention_impl == "auto"):
        return "longest"
    return "own"


@dataclasses.dataclass(frozen=True)
class StepModel:
    """Wall seconds of an engine run from its schedule (`EngineSchedule`):

        T = rounds * round_s + steps * step_s + slot_reads * slot_s + events * event_s

    `round_s`: a round's prefill, admissions, results and host round trip (with the run's setup); `step_s`: a decode
    step's fixed cost (weights, sampling); `slot_s`: per cache slot a row's attention reads (slot_reads: the
    schedule's `slot_reads(reads)`, reads "own" or "longest": `attention_reads`); `event_s`: an eviction event."""

    round_s: float
    step_s: float
    slot_s: float
    event_s: float
    reads: str = "own"

    def seconds(self, s: EngineSchedule) -> float:
        return (s.rounds * self.round_s + s.steps * self.step_s + s.slot_reads(self.reads) * self.slot_s
                + s.events * self.event_s)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def fit_step_model(round_s: float, windows: list[tuple[EngineSchedule, float]], reads: str = "own") -> StepModel:
    """`StepModel` from measured runs [(schedule, seconds)]: y = seconds - rounds * round_s regressed on (steps,
    slot_reads, events) by non-negative least squares: every subset of the columns that keeps `steps` (and leaves
    out columns that are zero in every run) is solved by least squares, and among those whose coefficients are all
    >= 0, the one of fewest columns whose squared error is within 1e-9 * |y|^2 of the least is kept; if none is,
    step_s = sum(y) / sum(steps)."""
    if not windows:
        raise ValueError("fit_step_model: no measured runs")
    if reads not in ATTENTION_READS:
        raise ValueError(f"reads={reads!r}; allowed: {', '.join(ATTENTION_READS)}")
    x = np.array([[s.steps, s.slot_reads(reads), s.events] for s, _ in windows], np.float64)
    y = np.array([sec - s.rounds * round_s for s, sec in windows], np.float64)
    live = [j for j in (1, 2) if x[:, j].any()]
    fits = []
    for extra in ([], *[[j] for j in live], live if len(live) == 2 else []):
        cols = [0, *extra]
        if len(cols) > len(windows):
            continue
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (coef >= 0).all():
            fits.append((float(np.sum((x[:, cols] @ coef - y) ** 2)), len(cols), dict(zip(cols, coef, strict=True))))
    best = None
    if fits:  # the fewest columns among the best fits (in lockstep runs past the first eviction, slot_reads is a
        # combination of steps and events: the three columns are collinear, and the smaller model is as good)
        least = min(err for err, _, _ in fits)
        best = min((n, err, i) for i, (err, n, _) in enumerate(fits) if err <= least + 1e-9 * float(y @ y))
        best = fits[best[2]][2]
    if best is None:
        best = {0: max(float(y.sum()), 0.0) / max(float(x[:, 0].sum()), 1.0)}
    return StepModel(round_s, float(best.get(0, 0.0)), float(best.get(1, 0.0)), float(best.get(2, 0.0)), reads)


def model_device(model: Qwen3) -> jax.Device:
    """The device holding the model's weights."""
    return next(iter(jax.tree.leaves(nnx.state(model))[0].devices()))


def _run_timed(model: Qwen3, reqs: list, rows: int, queue: int, config: GenerateConfig, ev: EvictionConfig,
               prompt_len: int) -> tuple[float, batching.EngineStats, EngineSchedule]:
    """Wall seconds of `batching.run` on `reqs`, its stats, and the simulated schedule of the same run."""
    stats = batching.EngineStats()
    start = time.perf_counter()
    batching.run(model, reqs, rows=rows, config=config, eviction=ev, stats=stats, queue=queue)
    seconds = time.perf_counter() - start
    return seconds, stats, simulate_engine([r.max_new_tokens for r in reqs], rows, ev, prompt_len, queue)


def _check_scale(model_fit: StepModel, lengths: np.ndarray, rows: int, ev: EvictionConfig, prompt_len: int,
                 queue: int, cap: int, seconds: float) -> float:
    """The largest factor f in (0, 1] (bisection, 12 halvings) whose lengths round(lengths * f) the model says run
    within `seconds`."""
    def predicted(f: float) -> float:
        caps = np.clip(np.rint(lengths * f), 2, cap)
        return model_fit.seconds(simulate_engine(caps, rows, ev, prompt_len, queue))

    if predicted(1.0) <= seconds:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) <= seconds else (lo, mid)
    return max(lo, 1e-6)


def measure_engine(model: Qwen3, ev: EvictionConfig, make_requests: Callable[[list[int]], list], rows: int,
                   queue: int, config: GenerateConfig, prompt_len: int, lengths: np.ndarray, seconds: float,
                   check_share: float, first_window: int, reads: str, log: Callable[[str], None]) -> dict:
    """Steps 1-3 of `aime25_workload` for one method on `rows` rows (after the compile): round_s, the lockstep
    windows, the fitted `StepModel` (slots counted as `reads`) and the continuous check. Returns its record (with
    the model as "fit")."""
    label, cap = method_label(ev.method, ev.evicts and ev.budget), config.max_new_tokens
    t0 = time.perf_counter()

    def timed(caps):
        return _run_timed(model, make_requests(caps), rows, queue, config, ev, prompt_len)

    round_s = Stat.of(timed([1] * rows)[0] for _ in range(3))
    triggers = row_replay(ev, prompt_len, cap - 1)[2] if ev.evicts else np.zeros(0, np.int64)
    reach = min(int(triggers[0]) + 2 * ev.buffer + 1, cap) if len(triggers) else 0  # two events past the first
    windows, matches = [], []
    length, fit = min(first_window, cap), None
    window_end = t0 + (1 - check_share) * seconds
    while True:
        sched = simulate_engine([length] * rows, rows, ev, prompt_len, queue)
        if fit is not None:
            predicted = fit.seconds(sched)
        elif windows:  # one window so far: its seconds per step, doubled for the slots' growth
            s0, sec0 = windows[-1]
            predicted = round_s.median + 2 * (sec0 - round_s.median) * sched.steps / max(s0.steps, 1)
        else:
            predicted = 0.0
        if len(windows) >= 2 and time.perf_counter() + predicted > window_end:
            break
        sec, stats, sched = timed([length] * rows)
        windows.append((sched, sec))
        matches.append(stats.steps == sched.steps and stats.events == sched.events)
        fit = fit_step_model(round_s.median, windows, reads) if len(windows) >= 2 else None
        log(f"{label}: window {length} tokens x {rows} rows: {sec:.2f} s ({sched.steps} steps, {sched.events} "
            "events)")
        if length >= cap:
            break
        nxt = min(2 * length, cap)
        if reach > nxt and fit is not None and not any(s.events for s, _ in windows) and (
                time.perf_counter() + fit.seconds(simulate_engine([reach] * rows, rows, ev, prompt_len, queue))
                <= window_end):
            nxt = reach  # past the first eviction while the time allows: the events' cost is measured
        length = nxt
    fit = fit_step_model(round_s.median, windows, reads)
    first = lengths[: min(len(lengths), 3 * rows)]
    scale = _check_scale(fit, first, rows, ev, prompt_len, queue, cap,
                         max(t0 + seconds - time.perf_counter(), 0.0))
    caps = np.clip(np.rint(first * scale), 2, cap).astype(np.int32)
    sec, stats, sched = timed(caps.tolist())
    matches.append(stats.steps == sched.steps and stats.events == sched.events)
    check = {"samples": len(caps), "scale": scale, "tokens": int(caps.sum()), "seconds": sec,
             "predicted_s": fit.seconds(sched), "tok_s": int(caps.sum()) / sec, "steps": sched.steps,
             "engine_steps": stats.steps, "events": sched.events, "engine_events": stats.events,
             "utilization": sched.utilization}
    check["error"] = check["predicted_s"] / sec - 1
    log(f"{label}: check {len(caps)} samples (lengths x {scale:.3f}): {sec:.2f} s measured, "
        f"{check['predicted_s']:.2f} s predicted")
    last, last_s = windows[-1]
    return {"fit": fit, "round_s": round_s.as_dict(), "model": fit.as_dict(), "check": check,
            "windows": [{"length": s.tokens // s.samples, "seconds": w, "steps": s.steps, "events": s.events,
                         "slot_reads": s.slot_reads(reads), "tok_s": s.tokens / w, "predicted_s": fit.seconds(s)}
                        for s, w in windows],
            "window_tok_s": last.tokens / last_s, "schedules_match_engine": all(matches),
            "steady": (not ev.evicts) or any(s.events > 0 for s, _ in windows),
            "measure_s": time.perf_counter() - t0}


DEADLINE_MARGIN_S = 15.0  # aime25_workload: left after the measuring for the projection and the write


def aime25_workload(model: Qwen3, methods: list[EvictionConfig], *, seconds_per_method: float = 120.0,
                    batch: int | dict[str, int] | None = None, samples: int = AIME25["samples"],
                    prompt_len: int = AIME25["prompt_len"], total_tokens: int = AIME25["total_tokens"],
                    median: float = AIME25["median"], sigma: float = AIME25["sigma"], seed: int = 0,
                    device_bytes: int | None = None, headroom: float = planner.DEFAULT_HEADROOM,
                    queue: int | None = None, max_rows: int = planner.MAX_ROWS, attention_impl: str = "auto",
                    layer_loop: str = "auto", check_share: float = 0.3, first_window: int = 32,
                    deadline: float | None = None,
                    on_method: Callable[[dict], None] | None = None, log: Callable[[str], None] = print) -> dict:
    """The AIME25 protocol's shape, per eviction method, on `model` (random weights will do): `samples` samples
    of `prompt_len`-token random prompts whose output lengths are `lognormal_lengths(median, sigma, cap =
    total_tokens - prompt_len)`, each ended at its drawn length by its cap (`Request.max_new_tokens`; no end
    token), decoded by `batching.run` with the protocol's sampling (temperature 0.6, top-p 0.95) and
    `max_new_tokens = total_tokens - prompt_len`.

    Rows: `batch` (one for every method, or {label: rows}, labels as "vase_dkv@2048" and "full"), or the largest
    that fits the model's device (`planner.largest_batch`, with the device's compiler, `device_bytes` (default:
    the device's allocator limit) and `headroom`; at most `samples` and `max_rows`). The search compiles the
    engine's programs at 3 or more sizes (about 40 s a size for Qwen3-14B's 40 layers on XLA:GPU); to spare a
    device's time, plan beforehand on any host (`scripts/plan.py --batch auto --target h200`) and pass `batch`.

    A whole protocol (~6M tokens) takes too long to time, so each method is measured for about
    `seconds_per_method` (after its plan and its compile, reported as plan_s and compile_s) and projected:

    1. round_s: the median of 3 runs of `rows` samples that end at the prefill (1 token): one round, no step;
    2. windows: runs of `rows` samples of L tokens in lockstep (one round each), L = `first_window`, 2L, 4L, ...
       (for an eviction method, a jump to two events past the first eviction, when the fit so far says it fits)
       while the next one fits in (1 - check_share) of the time; a `StepModel` fitted to them (`fit_step_model`);
    3. check: the first min(samples, 3 * rows) drawn samples, their lengths scaled down to fit the time left, run
       continuously; the model's prediction against the measured seconds (and the simulated steps and events
       against the engine's);
    4. the whole protocol: `simulate_engine` on the drawn lengths gives rounds, steps, slot_reads and events, and

           T = rounds * round_s + steps * step_s + slot_reads * slot_s + events * event_s

       (slot_reads: the cache slots the steps' attention reads, summed over rows and steps, each row up to its own
       length with the Pallas kernels, up to the longest row's on the XLA path (`attention_reads`): how `full`'s
       step time grows with its live slots, a line fitted in step 2; the projection with the other count is
       reported too). tokens/s = tokens / T; row utilization = the samples' decode row-steps / (rows * steps).

    `deadline` (seconds since the epoch): each method's measuring is shortened to end by then (less
    `DEADLINE_MARGIN_S`, at least 1 s), whatever its plan and compile took; the time used is the record's `seconds`.

    Peak memory: the device's `memory_stats()["peak_bytes_in_use"]` after the method (the process's peak so far),
    else the plan's total. `on_method(result so far)` is called after each method (to write results as they come).
    Returns a JSON-able dict {"meta": ..., "methods": [one record per method]}.
    """
    # the arguments as `benchmarks.bench` checks them (one place): methods validated, labels of `batch` among them
    labels = [method_label(ev.method, ev.evicts and ev.budget) for ev in methods]
    per_method = batch if isinstance(batch, dict) else dict.fromkeys(labels, batch)
    cap = total_tokens - prompt_len
    lengths = lognormal_lengths(samples, median=median, sigma=sigma, cap=cap, seed=seed)
    device = model_device(model)
    config = GenerateConfig(max_new_tokens=cap, eos_token_ids=(), attention_impl=attention_impl,
                            layer_loop=layer_loop).validate()
    reads = attention_reads(platform_of(device), attention_impl)
    rng = np.random.default_rng(seed + 1)
    prompts = [tuple(int(t) for t in rng.integers(0, model.cfg.vocab_size, prompt_len)) for _ in range(samples)]
    base_key = jax.random.key(seed)

    def make_requests(caps) -> list:
        return [batching.Request(prompts[i % samples], jax.random.fold_in(base_key, i), i, int(n), i)
                for i, n in enumerate(caps)]

    meta = {"workload": "aime25", "samples": samples, "prompt_len": prompt_len, "total_tokens": total_tokens,
            "max_new_tokens": cap,
            "lengths": {"distribution": "lognormal, clipped to [2, max_new_tokens]", "median": median,
                        "sigma": sigma, "seed": seed, "mean": float(lengths.mean()), "max": int(lengths.max()),
                        "at_cap": int((lengths == cap).sum()), "tokens": int(lengths.sum())},
            "model": dataclasses.asdict(model.cfg), "dtype": jnp.dtype(model.dtype).name,
            "device": f"{device.device_kind} ({device.platform})", "seconds_per_method": seconds_per_method,
            "headroom": headroom, "formula": PROJECTION, "attention_reads": reads}
    out = {"meta": meta, "methods": []}
    for ev in methods:
        label = method_label(ev.method, ev.evicts and ev.budget)
        rec: dict = {"label": label, "method": ev.method, "budget": ev.budget if ev.evicts else None,
                     "buffer": ev.buffer if ev.evicts else None}
        start = time.perf_counter()
        common = dict(target=device, config=config, prompt_len=prompt_len, dtype=model.dtype, queue=queue)
        if per_method.get(label) is None:
            found = planner.largest_batch(model.cfg, ev, device_bytes=device_bytes, headroom=headroom,
                                          samples=samples, max_rows=max_rows, **common)
            rows, plan = found.rows, found.plan
            rec |= {"rows_reason": found.reason, "batch_plan": found.as_dict()}
        else:
            rows = per_method[label]
            plan = planner.plan_engine(model.cfg, rows, ev, compile_program=False, **common)
            rec["rows_reason"] = f"given: {rows} rows"
        rec |= {"rows": rows, "plan_s": time.perf_counter() - start, "plan": None if plan is None else plan.as_dict()}
        log(f"{label}: {rows} rows ({rec['rows_reason']})")
        if rows > 0:
            rule = row_rule(model, config, Target.make(platform_of(device)))
            q = batching.queue_for(rows, queue, rule)  # as `batching.run` does
            start = time.perf_counter()
            _run_timed(model, make_requests([2] * rows), rows, q, config, ev, prompt_len)  # compiles the programs
            rec |= {"queue": q, "compile_s": time.perf_counter() - start}
            seconds = seconds_per_method  # a deadline (time.time()) shortens it to what is left after the compile
            if deadline is not None:
                seconds = max(min(seconds, deadline - time.time() - DEADLINE_MARGIN_S), 1.0)
            rec["seconds"] = seconds
            measured = measure_engine(model, ev, make_requests, rows, q, config, prompt_len, lengths,
                                      seconds, check_share, first_window, reads, log)
            fit = measured.pop("fit")
            proto = simulate_engine(lengths, rows, ev, prompt_len, q)
            total = fit.seconds(proto)
            other = dataclasses.replace(fit, reads=ATTENTION_READS[1 - ATTENTION_READS.index(reads)])
            stats = device.memory_stats() if device.platform != "cpu" else None
            peak = (stats or {}).get("peak_bytes_in_use")
            rec |= measured | {
                "protocol": proto.as_dict() | {
                    "seconds": total, "tok_s": proto.tokens / total, "reads": reads,
                    "seconds_if_" + other.reads: other.seconds(proto),
                    "step_ms": 1e3 * (total - proto.rounds * fit.round_s) / max(proto.steps, 1)},
                "peak_bytes": peak if peak is not None else (None if plan is None else plan.total),
                "peak_source": "memory_stats peak_bytes_in_use (the process's, so far)" if peak is not None else
                "plan (no compile: weights, state and staged prompts)" if plan.engine_temporaries is None else
                "plan"}
            log(f"{label}: protocol {proto.tokens} tokens on {rows} rows: {proto.steps} steps, utilization "
                f"{proto.utilization:.2f}, projected {total:.1f} s = {total / 60:.1f} min ({proto.tokens / total:.0f} "
                "tok/s)")
        out["methods"].append(rec)
        if on_method is not None:
            on_method(out)
    return out
