"""Per-device memory of a run before renting the devices (`scripts/plan.py`): `generate` on a mesh, and the
continuous engine (`vase_jax.batching.run`) on one device, with the largest batch that fits.

`generate` (`plan_memory`):

    weights     = sum over parameters of the bytes of one device's shard (`sharding.param_specs`)
    cache       = sum over cache arrays of one device's shard (`sharding.cache_specs` of `jax.eval_shape`)
    temporaries = `Compiled.memory_analysis().temp_size_in_bytes` of the whole `generate` program compiled for
                  the mesh by its devices' own compiler: an H200's or a TPU v5p's without the device
                  (`vase_jax.aot` topologies), or XLA:CPU's on simulated host devices

The continuous engine (`plan_engine`, `largest_batch`; `EnginePlan` has the formula):

    total(rows) = weights + state(rows) + 2 * staged(queue) + max(engine temporaries, prefill temporaries)

with `state` and `staged` exact from the programs' output shapes and both temporaries from the target's compiler;
`largest_batch` fits the temporaries as a + b * rows from two compiled sizes, solves for the most rows that fit
the device's memory less a headroom, and compiles the answer to check it.

Nothing is allocated: the model is abstract (`ShapeDtypeStruct`s with their shardings). The program is the one
the platform runs (`vase_jax.target`: its layer loop, cache storage and kernels); weights, cache and buffers are
exact, the temporaries are that compiler's buffer assignment.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from vase_jax import aot, batching, limits
from vase_jax.config import Qwen3Config
from vase_jax.eviction import framework
from vase_jax.eviction.config import EvictionConfig
from vase_jax.generate import GenerateConfig, cache_layout, generate_program, query_window
from vase_jax.invariance import padded_rows, rule_for, unpadded
from vase_jax.model import Qwen3
from vase_jax.sampling import typed_key
from vase_jax.sharding import cache_specs, check_mesh, param_specs, per_device_bytes, spec_for
from vase_jax.target import Target, platform_of


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    weights: int  # bytes per device
    cache: int
    temporaries: int  # None when not compiled
    arguments: int  # the compiled program's inputs per device (weights, prompt ids, ...)
    outputs: int
    capacity: int  # cache slots

    @property
    def total(self) -> int:
        """Peak estimate per device: arguments (weights included) + outputs + temporaries (the cache lives in the
        temporaries: `generate` creates it inside the program)."""
        return self.arguments + self.outputs + (self.temporaries or 0)


def plan_memory(cfg: Qwen3Config, mesh: jax.sharding.Mesh, batch: int, eviction: EvictionConfig, *,
                prompt_len: int = 1024, max_new_tokens: int = 32768, dtype=jnp.bfloat16,
                compile_program: bool = True, config: GenerateConfig | None = None) -> MemoryPlan:
    """Bytes per device of weights, cache and (compiled) temporaries for `generate` on `mesh`; `config`: its
    cache settings (`key_bits`, `value_bits`, ...; default the 16-bit cache)."""
    check_mesh(cfg, mesh, batch)
    eviction.validate()
    shape = dict(mesh.shape)
    target = Target.make(platform_of(mesh.devices.flat[0]))
    config = dataclasses.replace(config or GenerateConfig(), max_new_tokens=max_new_tokens,
                                 platform=target.platform).validate()
    t = config.bucket(prompt_len)
    capacity = cache_layout(cfg, config, eviction, t)
    specs = param_specs(cfg, mesh)
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    params = nnx.to_flat_state(nnx.state(abstract))
    weights = sum(per_device_bytes(v.shape, v.dtype, specs[p], shape) for p, v in params)
    cache = jax.eval_shape(lambda: capacity.init(cfg, batch, query_window(eviction), dtype,
                                                 framework.slot_state(eviction), target))
    cspecs = cache_specs(cache, mesh)
    cache_bytes = sum(per_device_bytes(x.shape, x.dtype, s, shape) for x, s in
                      zip(jax.tree.leaves(cache), jax.tree.leaves(cspecs, is_leaf=lambda s: isinstance(
                          s, jax.sharding.PartitionSpec)), strict=True))
    if not compile_program:
        return MemoryPlan(weights, cache_bytes, None, 0, 0, capacity.slots)

    def sharded(x, spec):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    graphdef, state = nnx.split(abstract)
    flat = [(p, v.replace(sharded(v, specs[p]))) for p, v in nnx.to_flat_state(state)]
    state = nnx.from_flat_state(flat)
    ids = sharded(jax.ShapeDtypeStruct((batch, t), jnp.int32), spec_for(("batch", "seq"), mesh))
    rows = sharded(jax.ShapeDtypeStruct((batch,), jnp.int32), spec_for(("batch",), mesh))
    caps = sharded(jax.ShapeDtypeStruct((batch,), jnp.int32), spec_for(("batch",), mesh))  # per-row token caps
    compiled = generate_program.lower(graphdef, state, ids, ids, jax.random.key(0), rows, caps, config, eviction,
                                      capacity, target, mesh).compile()
    m = compiled.memory_analysis()
    return MemoryPlan(weights, cache_bytes, int(m.temp_size_in_bytes), int(m.argument_size_in_bytes),
                      int(m.output_size_in_bytes), capacity.slots)


# ---- the continuous engine (`vase_jax.batching.run`) -------------------------------------------------------------
GIB, MIB = 2**30, 2**20
# Device memory per deviceless target (bytes): an H200's 141 GB of HBM3e, which this project's H200 machines report
# as about 139 GiB; a TPU v5p's 95 GiB. On an attached device JAX's allocator limit counts (`device_memory`); the CPU
# has no default: say how much (`device_bytes`).
DEVICE_MEMORY = {"h200": 139 * GIB, "v5p": 95 * GIB}
STAGED_SETS = 2  # staged rounds held at once: the round being decoded and the next one, prefilled beside it
DEFAULT_HEADROOM = 0.05  # share of the device's memory left free (allocator fragmentation, runtime workspaces)
MAX_ROWS = 512


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """Bytes on the device while `batching.run` runs `rows` rows, `queue` samples prefilled per round:

        total = weights + state + STAGED_SETS * staged + max(engine temporaries, stage temporaries)

    `state` is the engine's loop state (`batching.init_state`: the batch's cache of `capacity` slots per row, the
    token buffers [rows, max_new_tokens], the results buffer [rows + queue, max_new_tokens]); `staged` one round's
    prefilled prompts (`batching.stage_prompts`'s output: `queue` rows of `staged_slots` slots). Both are exact (shapes
    and dtypes). The temporaries are `memory_analysis().temp_size_in_bytes` of the engine program (`_engine`: admit,
    decode, evict, collect) and of the prefill program (`_stage`), compiled by the target's compiler; the two
    never run at once. Two staged rounds are counted: the host prefills the next round while the last one's
    staged samples are still referenced (a bound, whatever the host loop overlaps)."""

    rows: int
    queue: int
    capacity: int  # cache slots per row
    staged_slots: int  # slots per staged row (the prompt bucket)
    weights: int
    state: int
    cache: int  # the batch's KV cache (part of `state`)
    staged: int
    engine_temporaries: int | None  # None when not compiled
    stage_temporaries: int | None
    compile_s: float = 0.0

    @property
    def temporaries(self) -> int:
        return max(self.engine_temporaries or 0, self.stage_temporaries or 0)

    @property
    def total(self) -> int:
        return self.weights + self.state + STAGED_SETS * self.staged + self.temporaries

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"temporaries": self.temporaries, "total": self.total}


def size(n: float) -> str:
    """Bytes in words: GiB from 1 GiB, else MiB from 1 MiB, else KiB (negative sizes keep their sign)."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


def _nbytes(tree) -> int:
    """Bytes of the arrays (or ShapeDtypeStructs) of `tree`; a PRNG key counts its key data."""
    total = 0
    for x in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
            total += math.prod(data.shape) * data.dtype.itemsize
        else:
            total += math.prod(x.shape) * np.dtype(x.dtype).itemsize
    return int(total)


def target_device(target) -> jax.Device:
    """The device a plan compiles for: "h200" / "v5p" (a deviceless topology device, `vase_jax.aot`: its plugin
    must be installed), "cpu" (the host), or a `jax.Device` (an attached GPU, say)."""
    if isinstance(target, str):
        if target in aot.TARGETS:
            reason = aot.missing(target)
            if reason:
                raise ValueError(f"target={target!r}: {reason}")
            return aot.TARGETS[target].devices()[0]
        if target == "cpu":
            return jax.devices("cpu")[0]
        raise ValueError(f"target={target!r}; allowed: {', '.join(aot.TARGETS)}, cpu, or a jax.Device")
    if not isinstance(target, jax.Device):
        raise ValueError(f"target={target!r}; allowed: {', '.join(aot.TARGETS)}, cpu, or a jax.Device")
    return target


def device_memory(target) -> int | None:
    """Bytes JAX can use on `target`: the deviceless targets' `DEVICE_MEMORY`; an attached device's allocator
    limit (`memory_stats()["bytes_limit"]`, which XLA_PYTHON_CLIENT_MEM_FRACTION sets: 0.75 of the device by
    default); None where nothing says (the CPU)."""
    if isinstance(target, str):
        return DEVICE_MEMORY.get(target)
    return None if target.platform == "cpu" else limits.device_bytes(target)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


class _EnginePrograms:
    """The engine's programs for one configuration on one device, with their abstract arguments; compiles are
    memoized (the prefill program depends on `queue` only)."""

    def __init__(self, cfg: Qwen3Config, eviction: EvictionConfig, target, config: GenerateConfig, prompt_len: int,
                 dtype):
        if not isinstance(cfg, Qwen3Config):
            raise ValueError(f"cfg must be a vase_jax.Qwen3Config, got {type(cfg).__name__}")
        if not isinstance(eviction, EvictionConfig):
            raise ValueError(f"eviction must be a vase_jax.EvictionConfig, got {type(eviction).__name__}")
        eviction.validate()
        if not isinstance(config, GenerateConfig):
            raise ValueError(f"config must be a vase_jax.GenerateConfig, got {type(config).__name__}")
        self.prompt_len = _positive_int("prompt_len", prompt_len)
        if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
            raise ValueError(f"dtype={dtype!r}; allowed: bfloat16, float16, float32")
        self.device = target_device(target)
        self.target = Target.make(platform_of(self.device), config.layer_loop)
        self.config = dataclasses.replace(config, platform=self.target.platform).validate()
        self.cfg, self.eviction, self.dtype = cfg, eviction, jnp.dtype(dtype)
        self.slots = self.config.bucket(prompt_len)
        self.capacity = cache_layout(cfg, self.config, eviction, self.slots)  # as `run` makes it
        self.stage_slots = batching.staged_layout(self.capacity, self.slots, eviction)  # as `run` makes it
        # On JAX's default device the arguments carry no sharding, as the engine's own arrays do: the programs
        # lowered here are then the ones `batching.run` compiles (the same text: a persistent compilation cache
        # serves them). Elsewhere (a deviceless target, the CPU beside a GPU) they are placed on the device.
        default = self.device.platform == jax.default_backend() and self.device == jax.devices()[0]
        self.sharding = None if default else NamedSharding(Mesh(np.array([self.device]), ("data",)), PartitionSpec())
        model = aot.abstract_model(cfg, self.dtype, self.sharding)
        self.graphdef, self.params = nnx.split(model)
        self.weights = _nbytes(self.params)
        self._stage: dict[int, tuple] = {}
        self._engine: dict[tuple[int, int], int] = {}
        self.compile_s = 0.0
        # the batch padding `run` will use (`vase_jax.invariance`): measured when the device is this process's
        self.rule = rule_for(cfg, self.dtype, self.target, probe=default and self.config.batch_invariant)
        if not self.config.batch_invariant:
            self.rule = unpadded(self.target, self.dtype)

    def place(self, tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.sharding), tree)

    def queue_for(self, rows: int, queue: int | None) -> int:
        """The queue `batching.run` uses (`batching.queue_for`)."""
        return batching.queue_for(rows, queue, self.rule)

    def state(self, rows: int, queue: int):
        return self.place(jax.eval_shape(lambda: batching.init_state(
            self.cfg, self.dtype, rows, padded_rows(rows, self.rule), queue, self.config, self.eviction,
            self.capacity, self.target)))

    def stage_args(self, queue: int) -> tuple:
        def arg(shape, dt=jnp.int32):
            return jax.ShapeDtypeStruct(shape, dt)

        t = self.slots
        keys = jax.eval_shape(lambda: jnp.stack([typed_key(jax.random.key(0))] * queue))
        return self.place((arg((queue, t)), arg((queue, t)), keys, arg((queue,)), arg((queue,)), arg((queue,)),
                           arg(())))

    def staged(self, queue: int, compile_program: bool) -> tuple:
        """(abstract `Staged`, its bytes, the prefill program's temporaries or None)."""
        if queue in self._stage and (self._stage[queue][2] is not None or not compile_program):
            return self._stage[queue]
        args = self.stage_args(queue)
        static = (self.config, self.eviction, self.stage_slots, self.target)
        staged = self.place(jax.eval_shape(lambda *a: batching.stage_prompts(self.graphdef, *a, *static), self.params,
                                           *args))
        temps = None
        if compile_program:
            start = time.perf_counter()
            compiled = batching.stage_prompts.lower(self.graphdef, self.params, *args, *static).compile()
            self.compile_s += time.perf_counter() - start
            temps = int(compiled.memory_analysis().temp_size_in_bytes)
        self._stage[queue] = (staged, _nbytes(staged), temps)
        return self._stage[queue]

    def engine_temporaries(self, rows: int, queue: int, state, staged) -> int:
        if (rows, queue) not in self._engine:
            scalar = self.place((jax.ShapeDtypeStruct((), jnp.bool_), jax.ShapeDtypeStruct((), jnp.int32)))
            start = time.perf_counter()
            compiled = batching.engine_program.lower(self.graphdef, self.params, state, staged, *scalar, self.config,
                                              self.eviction, self.target).compile()
            self.compile_s += time.perf_counter() - start
            self._engine[rows, queue] = int(compiled.memory_analysis().temp_size_in_bytes)
        return self._engine[rows, queue]

    def plan(self, rows: int, queue: int | None = None, compile_program: bool = True) -> EnginePlan:
        rows = _positive_int("rows", rows)
        if queue is not None:
            queue = _positive_int("queue", queue)
        q = self.queue_for(rows, queue)
        before = self.compile_s
        state = self.state(rows, q)
        staged, staged_bytes, stage_temps = self.staged(q, compile_program)
        engine_temps = self.engine_temporaries(rows, q, state, staged) if compile_program else None
        return EnginePlan(rows=rows, queue=q, capacity=self.capacity.slots, staged_slots=self.slots,
                          weights=self.weights,
                          state=_nbytes(state), cache=_nbytes(state.loop.cache), staged=staged_bytes,
                          engine_temporaries=engine_temps, stage_temporaries=stage_temps,
                          compile_s=self.compile_s - before)


def _engine_config(config: GenerateConfig | None, max_new_tokens: int | None) -> GenerateConfig:
    config = GenerateConfig() if config is None else config
    if max_new_tokens is not None:
        config = dataclasses.replace(config, max_new_tokens=_positive_int("max_new_tokens", max_new_tokens))
    return config


def plan_engine(cfg: Qwen3Config, rows: int, eviction: EvictionConfig, *, target="h200",
                config: GenerateConfig | None = None, max_new_tokens: int | None = None, prompt_len: int = 256,
                dtype=jnp.bfloat16, queue: int | None = None, compile_program: bool = True) -> EnginePlan:
    """Device bytes of `batching.run` on `rows` rows (`EnginePlan`): every sample's prompt `prompt_len` tokens,
    decoding with `config` (default `GenerateConfig()`; `max_new_tokens` replaces its cap), `queue` samples
    prefilled per round (default: `rows`, as `run`). The programs are compiled by `target`'s compiler (a name or
    a device: `target_device`) with abstract arguments: nothing is allocated. `compile_program=False`: weights,
    state and staged prompts only (temporaries None)."""
    programs = _EnginePrograms(cfg, eviction, target, _engine_config(config, max_new_tokens), prompt_len, dtype)
    return programs.plan(rows, queue, compile_program)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The largest number of rows whose `EnginePlan` fits `usable = device_bytes * (1 - headroom)`, and why."""

    rows: int  # 0: not even one row fits
    limit: str  # "memory", "cap" or "nothing fits"
    reason: str
    device_bytes: int
    headroom: float
    usable: int
    cap: int  # the most rows considered (max_rows, or the number of samples)
    plan: EnginePlan | None  # compiled, at `rows` (at the smallest size tried when nothing fits)
    weights: int
    per_row: float  # exact bytes per row of state and staged prompts
    temporaries_per_row: float  # the fitted slope of the temporaries that bind at `rows`
    fixed: float  # what is left: total - weights - rows * (per_row + temporaries_per_row)
    compiled: tuple[tuple[int, int], ...]  # (rows, total bytes) of every size compiled, in order
    compile_s: float

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["plan"] = None if self.plan is None else self.plan.as_dict()
        out["compiled"] = [list(x) for x in self.compiled]
        return out


def _line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """(a, b) of the line a + b * rows through the two points of largest rows (a slope below 0 is taken as 0); for
    one point, the flat line through it."""
    if len(points) == 1:
        return float(points[0][1]), 0.0
    (r1, y1), (r2, y2) = sorted(points)[-2:]
    b = max((y2 - y1) / (r2 - r1), 0.0)
    return y2 - b * r2, b


def largest_batch(cfg: Qwen3Config, eviction: EvictionConfig, *, target="h200", device_bytes: int | None = None,
                  headroom: float = DEFAULT_HEADROOM, config: GenerateConfig | None = None,
                  max_new_tokens: int | None = None, prompt_len: int = 256, dtype=jnp.bfloat16,
                  queue: int | None = None, samples: int | None = None, max_rows: int = MAX_ROWS,
                  fit_rows: tuple[int, int] = (8, 16), max_compiles: int = 4) -> BatchPlan:
    """The most rows `batching.run` can hold on one device of `target` (`BatchPlan`).

    A row's bytes beyond the weights are exact (its cache, token and result buffers, and its share of the
    staged prompts: `EnginePlan`); the temporaries are the compiler's, and a compile of a 40-layer model takes a
    minute or more, so they are not compiled at every size. They are compiled at the two sizes `fit_rows` and
    fitted, per program (engine, prefill), as a line

        temporaries(rows) = a + b * rows     (the line through the two largest sizes compiled so far)

    and the plan total(rows) = weights + state(rows) + 2 * staged(rows) + max of the two lines is solved for the
    largest rows with total(rows) <= usable = device_bytes * (1 - headroom), capped at `min(max_rows, samples)`.
    The answer is then compiled: when it does not fit, the line is refitted through it and the search steps down;
    when it fits and the refitted line says one row more does not, it is the answer; else the search steps up. At
    most `max_compiles` compiles after the fit; the answer is always a compiled size that fits. A cap at most
    `fit_rows[0]` (few samples) is compiled alone first: when it fits it is the answer, after one compile; else
    one row less is compiled too, and the search goes on from the line through both.

    `device_bytes` defaults to the target's (`device_memory`: 139 GiB for an H200, 95 GiB for a v5p, an attached
    device's allocator limit); the CPU needs it given. The other arguments are `plan_engine`'s.
    """
    if not isinstance(headroom, (int, float)) or isinstance(headroom, bool) or not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom!r} must be a number in [0, 1) (the share of memory left free)")
    max_rows = _positive_int("max_rows", max_rows)
    max_compiles = _positive_int("max_compiles", max_compiles)
    if samples is not None:
        samples = _positive_int("samples", samples)
    if queue is not None:
        queue = _positive_int("queue", queue)
    if (not isinstance(fit_rows, (tuple, list)) or len(fit_rows) != 2 or
            not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in fit_rows) or
            fit_rows[0] >= fit_rows[1]):
        raise ValueError(f"fit_rows={fit_rows!r} must be two increasing positive ints")
    if device_bytes is None:
        device_bytes = device_memory(target if isinstance(target, str) else target_device(target))
        if device_bytes is None:
            raise ValueError(f"device_bytes: target={target!r} has no known memory size; give device_bytes")
    if not isinstance(device_bytes, (int, float, np.integer)) or isinstance(device_bytes, bool) or device_bytes <= 0:
        raise ValueError(f"device_bytes={device_bytes!r} must be a positive number of bytes")
    device_bytes = int(device_bytes)
    programs = _EnginePrograms(cfg, eviction, target, _engine_config(config, max_new_tokens), prompt_len, dtype)
    usable = int(device_bytes * (1 - headroom))
    cap = min(max_rows, samples or max_rows)

    plans: dict[int, EnginePlan] = {}
    order: list[int] = []

    def compile_at(rows: int) -> EnginePlan:
        plans[rows] = programs.plan(rows, queue)
        order.append(rows)
        return plans[rows]

    # state(rows) + 2 * staged(queue): exact, linear in rows and in the queue used at `rows` (`queue_for`: the
    # rows, at most 64, by default), from two uncompiled plans
    u2, u3 = (programs.plan(r, queue, compile_program=False) for r in (2, 3))  # (a lone CPU row counts as 2)
    q2, q3 = programs.queue_for(2, queue), programs.queue_for(3, queue)
    state_row = u3.state - u2.state
    staged_row = (u3.staged - u2.staged) / (q3 - q2) if q3 != q2 else 0.0

    def buffers(rows: int) -> float:
        q = programs.queue_for(rows, queue)
        return u2.state + state_row * (max(rows, 2) - 2) + STAGED_SETS * (u2.staged + staged_row * (q - q2))


    def per_row_at(rows: int) -> float:
        """Exact bytes one more row adds at `rows`: its state, and its staged prompts while the queue grows."""
        grows = programs.queue_for(rows + 1, queue) - programs.queue_for(rows, queue)
        return state_row + STAGED_SETS * staged_row * grows

    per_row = per_row_at(2)

    def predict(rows: int) -> tuple[float, float, float]:
        """(total, temporaries, temporaries' slope) at `rows` from the lines through the compiled sizes."""
        points = sorted(plans.items())
        ae, be = _line([(r, p.engine_temporaries) for r, p in points])
        # the prefill program depends on the queue only: a line in the queue used at each size
        by_queue = {programs.queue_for(r, queue): p.stage_temporaries for r, p in points}
        q = programs.queue_for(rows, queue)
        if len(by_queue) > 1:
            as_, bs = _line(list(by_queue.items()))
        else:
            as_, bs = next(iter(by_queue.values())), 0.0
        te, ts = ae + be * rows, as_ + bs * q
        grows = bs if q == rows else 0.0  # the prefill's temporaries grow with rows only while the queue does
        temps, slope = (te, be) if te >= ts else (ts, grows)
        return programs.weights + buffers(rows) + temps, temps, slope

    def solve() -> int:
        """The largest rows in [0, cap] that the lines say fit (predict is increasing in rows)."""
        lo, hi = 0, cap
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if predict(mid)[0] <= usable:
                lo = mid
            else:
                hi = mid - 1
        return lo

    fits = {}
    first = sorted({min(r, cap) for r in fit_rows})
    for r in first:
        fits[r] = compile_at(r).total <= usable
    if len(first) == 1 and not fits[cap] and cap > 1:  # cap <= fit_rows[0] and the cap does not fit: a second size
        fits[cap - 1] = compile_at(cap - 1).total <= usable
    if len(plans) == 1:  # the cap alone was compiled (cap <= fit_rows[0]): it fits, or cap == 1 and nothing does
        lo = cap if fits[cap] else 0
    else:
        for _ in range(max_compiles):
            lo = max([r for r, ok in fits.items() if ok], default=0)
            hi = min([r for r, ok in fits.items() if not ok], default=cap + 1)
            if lo == cap or lo + 1 == hi:
                break
            r = min(solve(), hi - 1)
            if r <= lo:
                if lo > 0 or 1 in fits:
                    break
                r = 1  # nothing compiled fits: the smallest size decides
            fits[r] = compile_at(r).total <= usable
        lo = max([r for r, ok in fits.items() if ok], default=0)
    compiled = tuple((r, plans[r].total) for r in order)
    room = f"{size(usable)} ({size(device_bytes)} less {headroom:.0%} headroom)"
    if lo == 0:
        smallest = plans[min(plans)]
        return BatchPlan(0, "nothing fits", f"nothing fits: {smallest.rows} row(s) need {size(smallest.total)} "
                         f"(weights {size(smallest.weights)}) > {room}", device_bytes, headroom, usable, cap,
                         smallest, programs.weights, per_row, 0.0, 0.0, compiled, programs.compile_s)
    plan = plans[lo]
    _, _, slope = predict(lo)
    per_row = per_row_at(lo)
    fixed = plan.total - programs.weights - lo * (per_row + slope)
    if len(plans) > 1:
        sums = (f"weights {size(plan.weights)} + {lo} rows x (cache and buffers {size(per_row)} + temporaries "
                f"{size(slope)} per row) + {size(fixed)} fixed = {size(plan.total)} <= {room}")
    else:  # one size compiled: its temporaries are not split into a part per row and a fixed part
        sums = (f"weights {size(plan.weights)} + {lo} rows x cache and buffers {size(per_row)} + temporaries and "
                f"fixed {size(fixed)} = {size(plan.total)} <= {room}")
    if lo == cap:
        what = "the number of samples" if samples is not None and samples <= max_rows else "max_rows"
        limit, reason = "cap", f"capped at {cap} rows ({what}): {sums}"
    else:
        nxt = plans.get(lo + 1)
        after = (f"{lo + 1} rows: {size(nxt.total)} (compiled)" if nxt is not None else
                 f"{lo + 1} rows: {size(predict(lo + 1)[0])} (fitted)")
        limit, reason = "memory", f"limited by memory: {sums}; {after} > {size(usable)}"
    return BatchPlan(lo, limit, reason, device_bytes, headroom, usable, cap, plan, programs.weights, per_row, slope,
                     fixed, compiled, programs.compile_s)
