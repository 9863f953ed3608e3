"""Time the Pallas kernels against their pure-JAX references on the current device, and sweep the decode kernel's
launch parameters.

Timing: each figure is ONE compiled program that calls the operation many times back to back, so dispatch and
synchronization (a fraction of a millisecond per call, more than a whole call at small sizes) are paid once per
program, not per call. Decode attention runs over a cache stacked over `layers` layers (chosen so that the layers
together exceed the device's L2 cache by far: nothing is cached between calls); one pass calls the kernel for the
layers in turn (at least 4 calls), each call reading its own layer in place and taking the previous call's output
as its query (the data dependency keeps the calls in order, and adds no operation), and a `fori_loop` repeats the
pass. The per-call time is the program's best time over `--repeats` runs divided by the calls. Bytes read per
call: K, V and pos of the used slots, q and the output (what the operation must move at least once); GB/s and the
fraction of the device's read and copy bandwidth (`benchmarks.timing.bandwidth` over `--copy-mib` MiB).

The window score is timed the same way over copies of its keys. It is compute-bound, not memory-bound: every key
meets group x window query rows (256 for Qwen3-8B with a 64-query window), twice in the Triton kernel (statistics,
then mass), so its rows also give TFLOP/s of one q.k per (query row, key).

Kernels: the Triton kernels on a GPU, the Mosaic TPU kernels on a TPU. On CPU only the references run, unless
`--interpret` is given (then both kernel families run in interpret mode: very slow, for checking only).

    python -m benchmarks.kernels                     # small defaults on CPU, full sweep on GPU / TPU
    python -m benchmarks.kernels --lengths 1024,8192 --batches 1,8 --json out.json
    python -m benchmarks.kernels --sweep-budget 90 --batches 16,128 --lengths 2048,4096 --group 5

`sweep_decode(shapes, candidates, seconds_budget)` (also the device check's sweep phase) times the decode kernel's
launch parameters per shape and returns JSON-able results with the best per shape and `decode_tuning.TABLE` rows to
paste.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.report import ints, write_json
from benchmarks.timing import DEVICE_PROBE_BYTES, bandwidth, time_runs
from pallas_kernels import decode_tuning, dispatch
from pallas_kernels.decode_attention import decode_attention, decode_attention_reference
from pallas_kernels.decode_attention_tpu import decode_attention_tpu
from pallas_kernels.decode_tuning import DecodeParams, DecodeTuning
from vase_jax.eviction.window_score import window_score

L2_BYTES = 64 << 20  # at least an H200's L2 (50 MB); the stacked layers hold >= 2x this
MAX_LAYERS = 32
MIN_CALLS_PER_PASS = 4
MIN_CALL_S = 5e-6  # a kernel launch and its memory latency: no call is estimated shorter
UNROLL_CALLS = 8  # calls per pass written out in the program; more (small shapes, many layers) run in a loop
MAX_SCORE_COPIES = 8  # key arrays of the window-score timing (small shapes may then be served from the L2)
XLA_FRACTION = 0.02  # of the read bandwidth, to size the XLA references' programs (H200: 1.5%, the kernels: 34-56%)


# ---------------------------------------------------------------------------------------------------------------
# shapes and bytes
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DecodeShape:
    """One decode call: `batch` rows, `kv_heads` kv heads of `group` query heads each, `slots` live slots per row
    in a cache of `capacity` slots (default: `slots`)."""

    batch: int
    kv_heads: int
    group: int
    head_dim: int
    slots: int
    dtype: str = "bfloat16"
    capacity: int | None = None

    @classmethod
    def of(cls, spec) -> DecodeShape:
        """A `DecodeShape` from itself, a dict of its fields, or a tuple (batch, kv_heads, group, head_dim, slots[,
        dtype[, capacity]])."""
        if isinstance(spec, cls):
            return spec
        shape = cls(**spec) if isinstance(spec, dict) else cls(*spec)
        shape = dataclasses.replace(shape, dtype=jnp.dtype(shape.dtype).name)  # raises on an unknown dtype
        for name in ("batch", "kv_heads", "group", "head_dim", "slots"):
            if getattr(shape, name) < 1:
                raise ValueError(f"{name}={getattr(shape, name)} must be >= 1 in {shape}")
        if shape.capacity is not None and shape.capacity < shape.slots:
            raise ValueError(f"capacity={shape.capacity} must be >= slots={shape.slots}")
        return shape

    @property
    def cache_slots(self) -> int:
        return self.capacity or self.slots

    def bytes_read(self) -> int:
        """K, V and pos of the used slots, plus q and the output."""
        itemsize = jnp.dtype(self.dtype).itemsize
        kv = self.batch * self.kv_heads * self.slots * (2 * self.head_dim * itemsize + 4)
        return kv + 2 * self.batch * self.kv_heads * self.group * self.head_dim * itemsize

    def layer_bytes(self) -> int:
        """Bytes of one layer of the cache (K, V, pos at the capacity)."""
        itemsize = jnp.dtype(self.dtype).itemsize
        return self.batch * self.kv_heads * self.cache_slots * (2 * self.head_dim * itemsize + 4)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def layers_for(shape: DecodeShape, on_device: bool) -> int:
    """Layers of the stacked cache: enough that they exceed the L2 by 2x (at least 2; 2 off a device)."""
    if not on_device:
        return 2
    return int(min(MAX_LAYERS, max(2, math.ceil(2 * L2_BYTES / shape.layer_bytes()))))


def decode_cache(shape: DecodeShape, layers: int, key) -> tuple:
    """(q, k, v, pos, lengths) with k, v [layers, batch, kv_heads, capacity, head_dim] and per-row lengths (all
    `slots`: the form the model passes)."""
    dtype = jnp.dtype(shape.dtype)
    kq, kk, kv = jax.random.split(key, 3)
    cache = (layers, shape.batch, shape.kv_heads, shape.cache_slots, shape.head_dim)
    q = jax.random.normal(kq, (shape.batch, shape.kv_heads, shape.group, shape.head_dim), dtype)
    k = jax.random.normal(kk, cache, dtype)
    v = jax.random.normal(kv, cache, dtype)
    pos = jnp.broadcast_to(jnp.arange(shape.cache_slots, dtype=jnp.int32), cache[:-1])
    lengths = jnp.full((shape.batch,), shape.slots, jnp.int32)
    return q, k, v, pos, lengths


# ---------------------------------------------------------------------------------------------------------------
# timing inside one program
# ---------------------------------------------------------------------------------------------------------------
def repeated_decode(attend: Callable, layers: int, passes: int, calls_per_pass: int) -> Callable:
    """A jitted f(q, k, v, pos, lengths) that calls `attend(q, k, v, pos, lengths, layer=c % layers)` for c in
    range(calls_per_pass), `passes` times over, each call's output the next call's query. Up to `UNROLL_CALLS`
    calls per pass are unrolled (static layer indices: nothing runs between the calls); more run in an inner loop
    whose index is the (traced) layer."""

    def one_pass(_, q, k, v, pos, lengths):
        if calls_per_pass <= UNROLL_CALLS:
            for c in range(calls_per_pass):
                q = attend(q, k, v, pos, lengths, layer=c % layers)
            return q
        # more calls than UNROLL_CALLS come from many layers: calls_per_pass == layers, the index is the layer
        return lax.fori_loop(0, calls_per_pass, lambda c, x: attend(x, k, v, pos, lengths, layer=c), q)

    def run(q, k, v, pos, lengths):
        return lax.fori_loop(0, passes, functools.partial(one_pass, k=k, v=v, pos=pos, lengths=lengths), q)

    return jax.jit(run)


def passes_for(bytes_per_pass: int, calls_per_pass: int, bandwidth: float, target_s: float, on_device: bool) -> int:
    """Passes for a program of about `target_s` seconds at `bandwidth` bytes/s, a call taking at least
    `MIN_CALL_S` (1 pass off a device)."""
    if not on_device:
        return 1
    pass_s = max(bytes_per_pass / bandwidth, calls_per_pass * MIN_CALL_S)
    return int(min(10_000, max(1, math.ceil(target_s / pass_s))))


@dataclasses.dataclass
class DecodeBench:
    """A shape's stacked cache on the device, and its timed programs: `lower(attend)` builds one for an
    implementation of decode attention, `time` runs it compiled."""

    shape: DecodeShape
    layers: int
    inputs: tuple
    bandwidth: float
    target_s: float
    on_device: bool
    repeats: int = 3

    @classmethod
    def make(cls, shape: DecodeShape, *, bandwidth: float, target_s: float, on_device: bool,
             repeats: int = 3) -> DecodeBench:
        layers = layers_for(shape, on_device)
        return cls(shape, layers, decode_cache(shape, layers, jax.random.key(0)), bandwidth, target_s, on_device,
                   repeats)

    def lower(self, attend: Callable, expected_fraction: float = 0.5) -> tuple[jax.stages.Lowered, int]:
        """(the lowered program, its calls): passes sized for `target_s` at `expected_fraction` of the bandwidth
        (XLA's compile of it may run in another thread)."""
        per_pass = self.calls_per_pass
        passes = passes_for(per_pass * self.shape.bytes_read(), per_pass, expected_fraction * self.bandwidth,
                            self.target_s, self.on_device)
        return repeated_decode(attend, self.layers, passes, per_pass).lower(*self.inputs), passes * per_pass

    @property
    def calls_per_pass(self) -> int:
        """Calls per loop iteration: every layer, and at least `MIN_CALLS_PER_PASS` on a device (a loop iteration
        may cost a little beside its calls)."""
        return max(self.layers, MIN_CALLS_PER_PASS) if self.on_device else self.layers

    def time(self, compiled, calls: int) -> float:
        """Seconds per call of a compiled program of `calls` calls."""
        return time_runs(lambda: compiled(*self.inputs), self.repeats, warmup=1).min / calls

    def row(self, seconds: float, calls: int) -> dict:
        num_bytes = self.shape.bytes_read()
        return dict(ms=seconds * 1e3, gb_per_s=num_bytes / seconds / 1e9,
                    fraction_of_read_bw=num_bytes / seconds / self.bandwidth, bytes=num_bytes, calls=calls,
                    layers=self.layers)


# ---------------------------------------------------------------------------------------------------------------
# the sweep of the decode kernel's launch parameters
# ---------------------------------------------------------------------------------------------------------------
def _launch(params: DecodeParams) -> tuple[int, int, int]:
    return params.block_size, params.num_warps, params.num_stages


def _attend(params: DecodeParams, interpret: bool) -> Callable:
    return functools.partial(decode_attention, block_size=params.block_size, num_splits=params.num_splits,
                             num_warps=params.num_warps, num_stages=params.num_stages, interpret=interpret)


def _rule(launch: tuple[int, int, int], programs_per_sm: float, base: DecodeTuning) -> DecodeTuning:
    block_size, num_warps, num_stages = launch
    return dataclasses.replace(base, block_size=block_size, num_warps=num_warps, num_stages=num_stages,
                               programs_per_sm=programs_per_sm)


def _params(shape: DecodeShape, entry: DecodeTuning, sms: int | None) -> DecodeParams:
    splits = entry.splits_for(shape.batch, shape.kv_heads, shape.cache_slots, sms)
    return DecodeParams(entry.block_size, splits, entry.num_warps, entry.num_stages, entry.min_blocks_per_split)


class _ShapeSweep:
    """The measurements of one shape: `run(candidates)` compiles them (XLA compiles in parallel threads) and times
    each until `deadline`; results are rows with the params and the timing or an error."""

    def __init__(self, bench: DecodeBench, interpret: bool, deadline: float, log: Callable):
        self.bench, self.interpret, self.deadline, self.log = bench, interpret, deadline, log
        self.results: list[dict] = []
        self.seen: set[DecodeParams] = set()

    def run(self, candidates: Sequence[DecodeParams], source: str) -> None:
        todo = [p for p in dict.fromkeys(candidates) if p not in self.seen]
        lowered = []
        for params in todo:
            if time.time() >= self.deadline:
                break
            self.seen.add(params)
            try:
                lowered.append((params, *self.bench.lower(_attend(params, self.interpret))))
            except Exception as e:  # a launch the lowering rejects: recorded, the sweep goes on
                self._error(params, source, e)
        with _pool(len(lowered)) as pool:
            futures = [(params, calls, pool.submit(low.compile)) for params, low, calls in lowered]
            for params, calls, future in futures:
                if time.time() >= self.deadline:
                    self.results.append(dict(params=params.as_dict(), source=source, skipped="budget"))
                    continue
                try:
                    seconds = self.bench.time(future.result(), calls)
                except Exception as e:  # a launch that does not compile or run: recorded, the sweep goes on
                    self._error(params, source, e)
                    continue
                row = dict(params=params.as_dict(), source=source, **self.bench.row(seconds, calls))
                self.results.append(row)
                self.log(f"  {source:<8} {_describe(params)}: {row['ms']:.4f} ms, {row['gb_per_s']:.0f} GB/s, "
                         f"{100 * row['fraction_of_read_bw']:.0f}% of read bandwidth")

    def _error(self, params: DecodeParams, source: str, error: Exception) -> None:
        text = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300] if str(error).strip() else ''}"
        self.results.append(dict(params=params.as_dict(), source=source, error=text))
        self.log(f"  {source:<8} {_describe(params)}: {text}")

    def timed(self) -> list[dict]:
        return [r for r in self.results if "ms" in r]

    def best(self) -> dict | None:
        return min(self.timed(), key=lambda r: r["ms"], default=None)


def _pool(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(1, min(8, n)))


def _describe(params: DecodeParams) -> str:
    return (f"block {params.block_size:>3} splits {params.num_splits:>2} warps {params.num_warps} stages "
            f"{params.num_stages}")


def _search(sweep: _ShapeSweep, shape: DecodeShape, base: DecodeTuning, sms: int | None) -> None:
    """Coordinate search: the table's params; the split rule's programs per SM at the table's launch; the
    launches (`SWEEP_LAUNCHES`) at the best programs per SM; the programs per SM again at the best launch."""
    sweep.run([_params(shape, base, sms)], "table")

    def best_rule() -> tuple[tuple[int, int, int], float]:
        best = sweep.best()
        if best is None:
            return _launch(_params(shape, base, sms)), base.programs_per_sm
        p = DecodeParams(**best["params"])
        return _launch(p), p.num_splits * shape.batch * shape.kv_heads / (sms or decode_tuning.FALLBACK_SM_COUNT)

    def splits_stage(launch):
        sweep.run([_params(shape, _rule(launch, pps, base), sms) for pps in decode_tuning.SWEEP_PROGRAMS_PER_SM],
                  "splits")

    splits_stage(_launch(_params(shape, base, sms)))
    launch, pps = best_rule()
    sweep.run([_params(shape, _rule(lnch, pps, base), sms) for lnch in decode_tuning.SWEEP_LAUNCHES], "launch")
    launch, _ = best_rule()
    splits_stage(launch)


def sweep_decode(
    shapes: Sequence,
    candidates: Sequence[DecodeParams] | None = None,
    seconds_budget: float = 90.0,
    *,
    read_bandwidth_bytes_s: float | None = None,
    interpret: bool | None = None,
    target_ms: float = 20.0,
    repeats: int = 3,
    device_kind: str | None = None,
    log: Callable[[str], None] = print,
    on_shape: Callable[[dict], None] | None = None,
) -> dict:
    """Time the decode kernel's launch parameters on each shape, within about `seconds_budget` seconds.

    Args:
      shapes: `DecodeShape`s, dicts of their fields, or tuples (batch, kv_heads, group, head_dim, slots, dtype).
      candidates: `DecodeParams` to time on every shape, in order; None: a coordinate search from the table's own
        params (`_search`: split rules of `decode_tuning.SWEEP_PROGRAMS_PER_SM`, launches of `SWEEP_LAUNCHES`).
      seconds_budget: the shapes share it evenly (what one leaves goes to the next); a shape's candidates stop
        when its share is spent (a shape always gets its table params timed while any budget is left).
      read_bandwidth_bytes_s: the device's read bandwidth for the fractions; None: measured here (`bandwidth`
        over `DEVICE_PROBE_BYTES` on a GPU).
      interpret: run the Triton kernel in interpret mode; default: off a GPU (CPU tests: tiny shapes only).
      target_ms: length of one timed program (calls x per-call time); dispatch is paid once per program.
      device_kind: the table's kind for the table params and rows; default: `decode_tuning.current_device_kind()`.
      on_shape: called with the result so far after each shape (to write it: a sweep stopped for time keeps the
        shapes it finished).

    Returns a JSON-able dict: device_kind, sm_count, jax, interpret, read_bandwidth_gb_s, budget_s, seconds,
    shapes: [{shape, layers, table (the table's params), results: [{params, source, ms, gb_per_s,
    fraction_of_read_bw, bytes, calls} or {params, source, error}], best (a result), best_vs_table (table ms /
    best ms)}],
    entries: [{key, entry, text}] the fitted `decode_tuning.TABLE` rows, and table_text (those rows as Python).
    """
    start = time.time()
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    interpret = (not on_gpu) if interpret is None else bool(interpret)
    kind = device_kind or decode_tuning.current_device_kind()
    sms = decode_tuning.sm_count(kind)
    shapes = [DecodeShape.of(s) for s in shapes]
    if read_bandwidth_bytes_s is None:
        read_bandwidth_bytes_s = bandwidth(DEVICE_PROBE_BYTES if on_gpu else 64 << 20)["read"]
    log(f"decode sweep on {kind} ({sms} SMs), {'interpret mode, ' if interpret else ''}read bandwidth "
        f"{read_bandwidth_bytes_s / 1e9:.0f} GB/s, {len(shapes)} shapes, budget {seconds_budget:.0f} s")
    out = []

    def result() -> dict:
        entries = fit_entries(out, kind, sms)
        return dict(device_kind=kind, sm_count=sms, jax=jax.__version__, interpret=interpret,
                    read_bandwidth_gb_s=read_bandwidth_bytes_s / 1e9, budget_s=seconds_budget,
                    seconds=time.time() - start, shapes=out, entries=entries,
                    table_text="\n".join(e["text"] for e in entries))

    for i, shape in enumerate(shapes):
        share = (start + seconds_budget - time.time()) / (len(shapes) - i)
        out.append(_sweep_shape(shape, candidates, share, kind, sms, read_bandwidth_bytes_s, interpret, on_gpu,
                                target_ms, repeats, log))
        if on_shape is not None:
            on_shape(result())
    return result()


def _sweep_shape(shape, candidates, share, kind, sms, bandwidth, interpret, on_gpu, target_ms, repeats, log) -> dict:
    base = decode_tuning.lookup(kind, shape.head_dim, shape.group, shape.dtype)
    table = _params(shape, base, sms)
    record = dict(shape=shape.as_dict(), table=table.as_dict(), table_measured=base.measured or "no (a reasoned guess)",
                  results=[], best=None, best_vs_table=None)
    if share <= 0:
        record["skipped"] = "budget"
        return record
    log(f"{shape}: {share:.0f} s")
    bench = DecodeBench.make(shape, bandwidth=bandwidth, target_s=target_ms / 1e3, on_device=on_gpu,
                             repeats=repeats)
    record["layers"] = bench.layers
    sweep = _ShapeSweep(bench, interpret, time.time() + share, log)
    if candidates is None:
        _search(sweep, shape, base, sms)
    else:
        sweep.run([table], "table")
        sweep.run(list(candidates), "given")
    del bench.inputs
    record["results"] = sweep.results
    record["best"] = sweep.best()
    table_row = next((r for r in sweep.timed() if r["source"] == "table"), None)
    if record["best"] and table_row:
        record["best_vs_table"] = table_row["ms"] / record["best"]["ms"]
    return record


def fit_entries(shape_records: Sequence[dict], kind: str, sms: int | None) -> list[dict]:
    """Table rows from a sweep: per (kind, head_dim, group, dtype), the launch with the smallest geometric mean of
    (its best time / the shape's best time) over the shapes that measured it in all of them (else the best
    launch of the shape with the most bytes), and the programs per SM (of `SWEEP_PROGRAMS_PER_SM` and the
    measured ones) whose splits, by the rule, were fastest summed over the shapes (an unmeasured split count counts
    as 1.5x the shape's best)."""
    keyed: dict[tuple, list[dict]] = {}
    for rec in shape_records:
        if rec.get("best"):
            s = DecodeShape.of(rec["shape"])
            keyed.setdefault((decode_tuning.device_family(kind), s.head_dim, s.group, s.dtype), []).append(rec)
    entries = []
    for key, recs in keyed.items():
        base = decode_tuning.lookup(kind, key[1], key[2], key[3])
        launch = _fit_launch(recs)
        pps = _fit_programs(recs, launch, base, sms)
        gain = statistics.geometric_mean([r["best_vs_table"] or 1.0 for r in recs])
        entry = dataclasses.replace(_rule(launch, pps, base),
                                    measured=f"swept on {kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
        comment = f"best / table time x{1 / gain:.2f} ({len(recs)} shapes)"
        entries.append(dict(key=list(key), entry=dataclasses.asdict(entry),
                            text=decode_tuning.entry_text(key, entry, comment)))
    return entries


def _times(rec: dict) -> dict[DecodeParams, float]:
    return {DecodeParams(**r["params"]): r["ms"] for r in rec["results"] if "ms" in r}


def _fit_launch(recs: list[dict]) -> tuple[int, int, int]:
    per_shape = []
    for rec in recs:
        best_by_launch: dict[tuple, float] = {}
        for params, ms in _times(rec).items():
            best_by_launch[_launch(params)] = min(ms, best_by_launch.get(_launch(params), math.inf))
        per_shape.append({lnch: ms / rec["best"]["ms"] for lnch, ms in best_by_launch.items()})
    common = set.intersection(*(set(p) for p in per_shape))
    if not common:
        biggest = max(recs, key=lambda r: DecodeShape.of(r["shape"]).bytes_read())
        return _launch(DecodeParams(**biggest["best"]["params"]))
    return min(sorted(common), key=lambda lnch: statistics.geometric_mean([p[lnch] for p in per_shape]))


def _fit_programs(recs: list[dict], launch, base: DecodeTuning, sms: int | None) -> float:
    sm = sms or decode_tuning.FALLBACK_SM_COUNT
    options = set(decode_tuning.SWEEP_PROGRAMS_PER_SM) | {base.programs_per_sm}
    for rec in recs:
        s = DecodeShape.of(rec["shape"])
        options |= {round(p.num_splits * s.batch * s.kv_heads / sm, 2) for p in _times(rec) if _launch(p) == launch}

    def cost(pps: float) -> float:
        total = 0.0
        for rec in recs:
            s = DecodeShape.of(rec["shape"])
            splits = _rule(launch, pps, base).splits_for(s.batch, s.kv_heads, s.cache_slots, sms)
            ms = min((t for p, t in _times(rec).items() if _launch(p) == launch and p.num_splits == splits),
                     default=1.5 * rec["best"]["ms"])
            total += ms / rec["best"]["ms"]
        return total

    # ties (split counts the rule maps to the same measurements): the one nearest the table's own
    return min(sorted(o for o in options if o > 0), key=lambda o: (cost(o), abs(math.log(o / base.programs_per_sm))))


# ---------------------------------------------------------------------------------------------------------------
# the benchmark table (XLA reference vs the platform's kernels)
# ---------------------------------------------------------------------------------------------------------------
def impls(op: str, platform: str, interpret: bool) -> list[tuple[str, Callable]]:
    """[(label, fn)] of decode attention (`attend(q, k, v, pos, lengths, layer=l)`) or the window score, as the
    library calls them (the tuning table's or the kernel's own launch parameters): the XLA path, then the kernels
    this platform runs (off a GPU or TPU: both families in interpret mode with `interpret`, else none)."""
    if op == "decode":
        xla = decode_attention_reference
        triton = functools.partial(decode_attention, interpret=platform != "gpu")
        tpu = functools.partial(decode_attention_tpu, interpret=platform != "tpu" and dispatch.tpu_interpret_params())
    else:
        xla, triton, tpu = (functools.partial(window_score, impl=i) for i in ("xla", "pallas_gpu", "pallas_tpu"))
    kernels = {"gpu": [("triton", triton)], "tpu": [("tpu", tpu)]}.get(
        platform, [("triton-interp", triton), ("tpu-interp", tpu)] if interpret else [])
    return [("xla", xla), *kernels]


def time_scores(fn: Callable, batch: int, length: int, args, dtype, *, bandwidth: float, on_device: bool,
                target_s: float, expected_fraction: float) -> tuple[float, int]:
    """(seconds per call, bytes per call) of the window score: `copies` key arrays (together past the L2, up to
    `MAX_SCORE_COPIES`) scored in turn inside one program, each call's first query element shifted by 0 x one
    value of the previous scores (a data dependency; an in-place one-element update)."""
    kq, kk = jax.random.split(jax.random.key(1))
    queries = jax.random.normal(kq, (batch, args.kv_heads, args.group, args.window, args.head_dim), dtype)
    keys = jax.random.normal(kk, (batch, args.kv_heads, length, args.head_dim), dtype)
    copies = 1 if not on_device else int(min(MAX_SCORE_COPIES, max(2, math.ceil(2 * L2_BYTES / keys.nbytes))))
    key_list = [keys] + [keys + i for i in range(1, copies)]
    valid = jnp.ones((batch, args.kv_heads, length), bool)
    query_valid = jnp.ones((batch, args.window), bool)
    num_bytes = keys.nbytes + queries.nbytes
    passes = passes_for(copies * num_bytes, copies, expected_fraction * bandwidth, target_s, on_device)

    def one_pass(_, q):
        for keys_i in key_list:
            scores = fn(q, query_valid, keys_i, valid)
            q = q.at[0, 0, 0, 0, 0].add((scores[0, 0, 0] * 0).astype(q.dtype))  # one element, in place
        return q

    program = jax.jit(lambda q: lax.fori_loop(0, passes, one_pass, q))
    return time_runs(lambda: program(queries), args.repeats, warmup=1).min / (passes * copies), num_bytes


def main(argv=None) -> list[dict]:
    platform = jax.default_backend()
    on_accel = platform in ("gpu", "tpu")  # an accelerator: full sweep, bfloat16, compiled kernels
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--lengths", type=ints, default=[1024, 4096, 8192, 16384, 32768] if on_accel else [256, 1024])
    a("--batches", type=ints, default=[1, 4, 16] if on_accel else [1, 4])
    a("--kv-heads", type=int, default=8)
    a("--group", type=int, default=4, help="query heads per kv head (Qwen3-8B: 4, 14B: 5)")
    a("--head-dim", type=int, default=128)
    a("--window", type=int, default=64, help="window queries of the eviction score")
    a("--dtype", choices=["bfloat16", "float32"], default="bfloat16" if on_accel else "float32")
    a("--which", default="decode,scores", help="comma list of: decode, scores")
    a("--repeats", type=int, default=5)
    a("--target-ms", type=float, default=20.0, help="length of one timed program")
    a("--interpret", action="store_true", help="on CPU: also run both kernel families in interpret mode")
    a("--copy-mib", type=int, default=DEVICE_PROBE_BYTES >> 20 if on_accel else 64,
      help="MiB of the read and copy bandwidth measurements")
    a("--sweep-budget", type=float, default=0.0, help="seconds: instead of the table, sweep the decode kernel's "
      "launch parameters on the batches x lengths shapes (`sweep_decode`)")
    a("--json", dest="json_out", default=None, help="write the results to this file")
    args = p.parse_args(argv)
    if args.repeats < 3:
        p.error(f"--repeats={args.repeats} must be >= 3")
    whats = [w for w in args.which.split(",") if w]
    if set(whats) - {"decode", "scores"}:
        p.error(f"--which={args.which!r}; allowed: decode, scores")

    dtype = jnp.dtype(args.dtype)
    bw = bandwidth(args.copy_mib << 20, args.repeats)
    read_bw, copy_bw = bw["read"], bw["copy"]
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({platform}), jax {jax.__version__}, dtype {args.dtype}; bandwidth over "
          f"{args.copy_mib} MiB: read {read_bw / 1e9:.1f} GB/s, copy {copy_bw / 1e9:.1f} GB/s")
    if args.sweep_budget > 0:
        shapes = [(b, args.kv_heads, args.group, args.head_dim, n, args.dtype) for b in args.batches
                  for n in args.lengths]
        result = sweep_decode(shapes, None, args.sweep_budget, read_bandwidth_bytes_s=read_bw,
                              interpret=None if on_accel else args.interpret or None, target_ms=args.target_ms,
                              repeats=args.repeats)
        print("decode_tuning.TABLE rows:\n" + result["table_text"])
        if args.json_out:
            write_json(args.json_out, result)
        return result["shapes"]

    rows = []
    meta = dict(device=device.device_kind, backend=platform, jax=jax.__version__, read_bandwidth_gb_per_s=read_bw / 1e9,
                copy_bandwidth_gb_per_s=copy_bw / 1e9, interpret=not on_accel and args.interpret,
                timing="best of --repeats runs of one program of many calls, divided by the calls",
                **{k: getattr(args, k) for k in ("dtype", "kv_heads", "group", "head_dim", "window", "target_ms")})

    def add(row: dict) -> None:  # written as it comes: a run stopped for time keeps the rows it has
        rows.append(row)
        print(f"{row['op']:<7} {row['impl']:<13} {row['batch']:>5} {row['length']:>7} {row['ms']:>9.4f} ms "
              f"{row['gb_per_s']:>8.1f} GB/s {100 * row['fraction_of_copy_bw']:>6.1f}% of copy", flush=True)
        if args.json_out:
            write_json(args.json_out, dict(meta=meta, results=rows))

    for batch in args.batches:
        for length in args.lengths:
            if "decode" in whats:
                shape = DecodeShape(batch, args.kv_heads, args.group, args.head_dim, length, args.dtype)
                bench = DecodeBench.make(shape, bandwidth=read_bw, target_s=args.target_ms / 1e3, on_device=on_accel,
                                         repeats=args.repeats)
                for impl, attend in impls("decode", platform, args.interpret):
                    lowered, calls = bench.lower(attend, XLA_FRACTION if impl == "xla" else 0.5)
                    seconds = bench.time(lowered.compile(), calls)
                    add(dict(op="decode", impl=impl, batch=batch, length=length, **bench.row(seconds, calls),
                             fraction_of_copy_bw=shape.bytes_read() / seconds / copy_bw))
                del bench.inputs
            for impl, fn in impls("scores", platform, args.interpret) if "scores" in whats else ():
                seconds, num_bytes = time_scores(
                    fn, batch, length, args, dtype, bandwidth=read_bw, on_device=on_accel,
                    target_s=args.target_ms / 1e3, expected_fraction=XLA_FRACTION if impl == "xla" else 0.3)
                # one q.k per (window query row, key): the score is compute-bound (G x W rows per kv head)
                flops = 2 * batch * args.kv_heads * args.group * args.window * length * args.head_dim
                add(dict(op="scores", impl=impl, batch=batch, length=length, ms=seconds * 1e3,
                         gb_per_s=num_bytes / seconds / 1e9, fraction_of_read_bw=num_bytes / seconds / read_bw,
                         fraction_of_copy_bw=num_bytes / seconds / copy_bw, bytes=num_bytes,
                         tflop_per_s=flops / seconds / 1e12))
    return rows


if __name__ == "__main__":
    main()
