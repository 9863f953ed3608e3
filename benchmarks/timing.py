"""The one timing loop, its statistics, the one memory-bandwidth probe, and the machine a figure was taken on.
Every benchmark times with `time_runs` (several calls in turns: `time_turns`; a call on what the last returned:
`time_chained`): wall seconds of `fn()` ended by `jax.block_until_ready`, after untimed warm-up calls (which
compile). A figure is the median of the runs (min and max kept); a capacity (bandwidth, a kernel's best launch) is
the minimum."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from vase_jax.jit import host_cpu

QUIET_LOAD = 1.2  # a 1-minute load average above this distorts CPU timings (and their ratios)
# Bytes of the bandwidth probe on an accelerator: one pass must dwarf a call's dispatch and sync (an H200 read
# 2.9-3.0 TB/s over 1-2 GiB, 4.0-4.2 TB/s over 8 GiB).
DEVICE_PROBE_BYTES = 8 << 30


@dataclasses.dataclass(frozen=True)
class Stat:
    """Median, min and max of repeated measurements (and the raw values)."""

    median: float
    min: float
    max: float
    runs: tuple[float, ...]

    @classmethod
    def of(cls, values) -> Stat:
        values = tuple(float(v) for v in values)
        return cls(statistics.median(values), min(values), max(values), values)

    def map(self, fn: Callable[[float], float]) -> Stat:
        """The statistics of `fn` applied to every run (e.g. seconds -> tokens/s)."""
        return Stat.of(fn(v) for v in self.runs)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def time_runs(fn: Callable[[], object], repeats: int, warmup: int = 0) -> Stat:
    """Wall seconds of `fn()` (result passed to `jax.block_until_ready`), after `warmup` untimed calls."""
    return time_turns([fn], repeats, warmup)[0][0]


def time_turns(fns: list[Callable[[], object]], repeats: int, warmup: int = 0) -> tuple[list[Stat], list]:
    """Wall seconds of each of `fns`, as `time_runs`, taken in turns: each round calls every one once (`warmup`
    untimed rounds, then `repeats` timed), so that drift on a busy machine hits them alike; and each one's last
    output."""
    times, outputs = [[] for _ in fns], [None for _ in fns]
    for _ in range(warmup + repeats):
        for i, fn in enumerate(fns):
            outputs[i] = None  # the output before it freed: one held at a time
            start = time.perf_counter()
            outputs[i] = jax.block_until_ready(fn())
            times[i].append(time.perf_counter() - start)
    return [Stat.of(t[warmup:]) for t in times], outputs


def time_chained(call: Callable[[object], object], carry: object, repeats: int) -> Stat:
    """Wall seconds of `repeats` calls of `call` (after an untimed one, which compiles), each on the `carry` the one
    before returned: a donated buffer (a cache) is then updated in place, never copied or reused."""
    box = [carry]

    def once():
        box[0] = call(box[0])
        return box[0]

    return time_runs(once, repeats, warmup=1)


def decode_rate(total: Stat, prefill: Stat, tokens: int) -> Stat | None:
    """tokens / (total - fastest prefill) per run: each run holds one prefill, never (but for noise) faster than the
    fastest one timed alone, so a slow prefill sample on a busy machine does not inflate the rate. None when a run
    is not longer than the prefill (too short to separate the decode steps from the noise)."""
    decode = [t - prefill.min for t in total.runs]
    return None if min(decode) <= 0 else Stat.of(tokens / d for d in decode)


_sum = jax.jit(jnp.sum)
_add_one = jax.jit(lambda x: x + 1.0, donate_argnums=0)


def bandwidth(num_bytes: int = 512 << 20, repeats: int = 5) -> dict[str, float]:
    """Memory bandwidth of the default device in bytes/s, each the best of `repeats` runs after a warm-up:

        read = num_bytes / seconds of a jitted sum over `num_bytes` of float32 (on a CPU also a NumPy sum over the
               same bytes: the same memory, another loop; the faster counts)
        copy = 2 * num_bytes / seconds of `x + 1` in place (donated: each run rewrites the same pages), read + write
    """
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    read = time_runs(lambda: _sum(x), repeats, warmup=1).min
    if jax.default_backend() == "cpu":
        read = min(read, time_runs(np.ones(num_bytes // 4, np.float32).sum, repeats, warmup=1).min)
    return {"read": num_bytes / read, "copy": 2 * num_bytes / time_chained(_add_one, x, repeats).min}


def load_warning(load: float) -> str | None:
    """A warning when the machine is busy, or None."""
    return None if load <= QUIET_LOAD else (
        f"load average {load:.2f} > {QUIET_LOAD}: other processes share the CPU; timings and ratios are not "
        "reliable; benchmark on a quiet machine")


def device_desc() -> str:
    """The accelerator the programs run on: its kind and backend, e.g. "NVIDIA H200 (gpu)" or "cpu (cpu)"."""
    return f"{jax.devices()[0].device_kind} ({jax.default_backend()})"


def machine(load_start: tuple[float, ...]) -> dict:
    """Where and when a figure was taken: device, host CPU, jax, the load average at the start and now."""
    load_end = os.getloadavg()
    return {"device": device_desc(), "cpu_model": host_cpu()["model name"], "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "load_start": [round(x, 2) for x in load_start],
            "load_end": [round(x, 2) for x in load_end],
            "load_warning": load_warning(max(load_start[0], load_end[0])), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
