"""Launch parameters of the Triton decode-attention kernel, per device kind, head_dim, GQA group and dtype.

`decode_params(...)` gives the `DecodeParams` of one call: explicit values win (validated), the others come from
`TABLE`, whose entries (`DecodeTuning`) hold the block size, the Triton compiler parameters and the rule that picks
the number of splits from the call's shape.

Splits (flash-decoding: each (row, kv head) pair's used blocks are dealt to `num_splits` programs, merged by
log-sum-exp afterwards). With `pairs = batch * kv_heads` programs before splitting and `sms` streaming
multiprocessors:

    num_splits = clip(round(programs_per_sm * sms / pairs), 1, min(max_splits, max(1, capacity_blocks // m)))

where `capacity_blocks = ceil(capacity / block_size)` and m = `min_blocks_per_split`. So a small batch is split
until the device holds about `programs_per_sm` programs per SM (a few waves of a few resident programs each: the
loads of one program do not keep an SM's memory pipe busy), a large batch is not split at all (batch 128 x 8 kv
heads is already ~8 programs per SM on an H200), and no split is given fewer than m of the capacity's blocks.
`length` is traced, so the used blocks are not known here; the kernel applies the same bound per row at run time
(`active = clip(used_blocks // m, 1, num_splits)` splits hold blocks, the others are empty), so a row holding few
slots is not spread thin. The static count depends on the capacity only through that bound, which never changes
which splits hold which blocks: two caches of different capacities holding the same slots compute bit-identically.

Batch invariance (`fixed_splits()`, a context read while tracing; `vase_jax.generate` enters it when
`GenerateConfig.batch_invariant` is on): the rule then counts `INVARIANT_BATCH` rows whatever the call's batch, so a
row's blocks are dealt to the same splits, and merged in the same order, in a batch of 1 or 128; the price is more
partials to merge at large batches and fewer programs at small ones (the device check's invariance phase times it).

Device kind (`current_device_kind()`, read while tracing): the abstract GPU of the current abstract mesh when
there is one (a deliberate target: `pallas_kernels.dispatch.lowering_target` installs it on a host without a GPU),
else the attached GPU's, else `DEFAULT_DEVICE_KIND` (an H200: the project's target). The SM count: the attached
GPU's `core_count`, else `SM_COUNTS` by kind, else `FALLBACK_SM_COUNT`. Kinds not in the table: Hopper kinds share
the H200's rows (`device_family`), any other kind gets `GENERIC` with its own SM count.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

DEFAULT_DEVICE_KIND = "NVIDIA H200"
INVARIANT_BATCH = 16  # the rows the split rule counts under `fixed_splits()` (the table's rows were tuned at 16)
_FIXED_SPLITS = contextvars.ContextVar("pallas_kernels_fixed_splits", default=False)


@contextlib.contextmanager
def fixed_splits(on: bool = True):
    """While tracing inside it, `decode_params` picks the split count for `INVARIANT_BATCH` rows, not the call's
    batch: a row's result does not depend on its batch's size (module docstring)."""
    token = _FIXED_SPLITS.set(bool(on))
    try:
        yield
    finally:
        _FIXED_SPLITS.reset(token)
FALLBACK_SM_COUNT = 128  # an unknown GPU: too many splits cost a few % (partials); too few leave SMs idle


def check_params(**params) -> None:
    """ValueError naming the first invalid launch parameter among block_size, num_splits, num_warps, num_stages,
    min_blocks_per_split (those given)."""
    rules = {
        "block_size": (lambda x: x >= 16 and not x & (x - 1), "a power of two >= 16"),
        "num_splits": (lambda x: x >= 1, ">= 1"),
        "num_warps": (lambda x: 1 <= x <= 32 and not x & (x - 1), "a power of two in [1, 32]"),
        "num_stages": (lambda x: x >= 1, ">= 1"),
        "min_blocks_per_split": (lambda x: x >= 1, ">= 1"),
    }
    for name, value in params.items():
        ok, allowed = rules[name]
        if not isinstance(value, int) or isinstance(value, bool) or not ok(value):
            raise ValueError(f"{name}={value!r} must be {allowed}")


@dataclasses.dataclass(frozen=True)
class DecodeParams:
    """What one call of the Triton decode kernel runs with.

    block_size: slots per loop step (a power of two >= 16); num_splits: programs per (row, kv head);
    num_warps, num_stages: Triton compiler parameters; min_blocks_per_split: the kernel's run-time bound, each
    split in use holds at least this many blocks (module docstring).
    """

    block_size: int
    num_splits: int
    num_warps: int
    num_stages: int
    min_blocks_per_split: int = 1

    def __post_init__(self):
        check_params(**dataclasses.asdict(self))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """One table entry: the kernel's block size and compiler parameters, and the split rule's constants
    (module docstring): about `programs_per_sm` programs per SM, at most `max_splits` splits per (row, kv head), at
    least `min_blocks_per_split` blocks per split. `measured`: where the row's figures come from when a sweep
    measured them ("swept on <device kind>, jax <version>, <date>"); empty for a reasoned guess."""

    block_size: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: float = 8.0
    max_splits: int = 32
    min_blocks_per_split: int = 4
    measured: str = ""

    def __post_init__(self):
        check_params(block_size=self.block_size, num_warps=self.num_warps, num_stages=self.num_stages,
                     min_blocks_per_split=self.min_blocks_per_split)
        if not self.programs_per_sm > 0:
            raise ValueError(f"programs_per_sm={self.programs_per_sm} must be > 0")
        if self.max_splits < 1:
            raise ValueError(f"max_splits={self.max_splits} must be >= 1")

    def splits_for(self, batch: int, kv_heads: int, capacity: int, sm_count: int | None) -> int:
        """The number of splits of a call (module docstring's rule)."""
        sms = sm_count or FALLBACK_SM_COUNT
        want = max(1, round(self.programs_per_sm * sms / max(1, batch * kv_heads)))
        capacity_blocks = -(-capacity // self.block_size)
        return max(1, min(want, self.max_splits, max(1, capacity_blocks // self.min_blocks_per_split)))


GENERIC = DecodeTuning()  # any GPU or shape the table does not name: the first device run's settings

# (device kind, head_dim, GQA group or None for any group, dtype name) -> entry. A row says whether it was measured
# (`measured`; the H200 rows below are reasoned guesses, `measured=""`); the device check's sweep
# (`benchmarks/kernels.py: sweep_decode`) measures the
# candidates below on the H200 and prints the rows to paste here. Why these guesses: K and V of a 64-slot bf16
# block are 32 KB; Triton keeps `num_stages - 1` blocks in flight per program, and with 2 stages its loop waits for
# the block it just issued before computing on it (no overlap inside a program; the first device run's setting,
# 34-56% of the bandwidth), with 3 the next block loads while this one is computed (~70 KB of shared memory: 3
# programs per SM). 8 programs per SM give batch 16 (8 kv heads) 8 splits, batch 64 two, batch 128 one (no merge).
TABLE: dict[tuple[str, int | None, int | None, str | None], DecodeTuning] = {
    ("NVIDIA H200", 128, 4, "bfloat16"): DecodeTuning(block_size=64, num_warps=4, num_stages=3, programs_per_sm=8.0),
    ("NVIDIA H200", 128, 5, "bfloat16"): DecodeTuning(block_size=64, num_warps=4, num_stages=3, programs_per_sm=8.0),
    ("NVIDIA H200", 128, None, "bfloat16"): DecodeTuning(block_size=64, num_warps=4, num_stages=3,
                                                         programs_per_sm=8.0),
    ("NVIDIA H200", 128, None, "float32"): DecodeTuning(block_size=32, num_warps=4, num_stages=3,
                                                        programs_per_sm=8.0),
}

# (block_size, num_warps, num_stages) the sweep tries, most likely first; each compiles for an H200
# (tests/test_aot_kernels.py; 256-slot blocks with 3 stages need 270 KB of shared memory and do not).
SWEEP_LAUNCHES: tuple[tuple[int, int, int], ...] = (
    (64, 4, 3), (64, 4, 2), (128, 4, 3), (128, 8, 3), (64, 4, 4), (32, 4, 4), (128, 8, 2), (64, 8, 3),
    (256, 8, 2), (128, 8, 4),
)
# programs per SM the sweep tries for the split rule
SWEEP_PROGRAMS_PER_SM: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0, 32.0)

# SMs per device kind (prefixes of the kinds JAX reports, most specific first); an attached GPU reports its own.
SM_COUNTS: tuple[tuple[str, int], ...] = (
    ("NVIDIA H100 PCIe", 114),
    ("NVIDIA H100", 132),
    ("NVIDIA H200", 132),
    ("NVIDIA GH200", 132),
    ("NVIDIA B200", 148),
    ("NVIDIA GB200", 152),
    ("NVIDIA A100", 108),
    ("NVIDIA A10G", 80),
    ("NVIDIA A10", 72),
    ("NVIDIA A30", 56),
    ("NVIDIA L40", 142),
    ("NVIDIA L4", 58),
    ("Tesla T4", 40),
)
_HOPPER = ("NVIDIA H100", "NVIDIA H200", "NVIDIA GH200")  # same SM (sm_90) and shared memory: the H200's rows


def device_family(kind: str) -> str:
    """The table's name for `kind`: Hopper kinds share the H200's rows."""
    return DEFAULT_DEVICE_KIND if kind.startswith(_HOPPER) else kind


def lookup(device_kind: str, head_dim: int, group: int, dtype) -> DecodeTuning:
    """The table entry for a call: exact group, then any group, then `GENERIC`."""
    kind, name = device_family(device_kind), jnp.dtype(dtype).name
    for key in ((kind, head_dim, group, name), (kind, head_dim, None, name)):
        if key in TABLE:
            return TABLE[key]
    return GENERIC


def _attached_gpu():
    """The first device of the default backend when it is a GPU, else None."""
    try:
        devices = jax.devices()
    except RuntimeError:
        return None
    return next((d for d in devices if d.platform == "gpu"), None)


def _abstract_gpu():
    """The abstract GPU device of the current abstract mesh (`dispatch.lowering_target`), else None."""
    try:
        device = jax.sharding.get_abstract_mesh().abstract_device
    except AttributeError:  # a jax without abstract devices
        return None
    return device if device is not None and device.platform in ("gpu", "cuda") else None


def current_device_kind() -> str:
    """The GPU kind a kernel being traced now is for: an abstract GPU the caller installed (a deliberate target,
    `dispatch.lowering_target`), else the attached GPU, else `DEFAULT_DEVICE_KIND`."""
    device = _abstract_gpu() or _attached_gpu()
    return device.device_kind if device is not None else DEFAULT_DEVICE_KIND


def sm_count(kind: str) -> int | None:
    """SMs of `kind`: the attached GPU's own count when it is that kind, else `SM_COUNTS`, else None."""
    attached = _attached_gpu()
    if attached is not None and attached.device_kind == kind and getattr(attached, "core_count", None):
        return int(attached.core_count)
    abstract = _abstract_gpu()
    if abstract is not None and abstract.device_kind == kind and getattr(abstract, "num_cores", None):
        return int(abstract.num_cores)
    return next((n for prefix, n in SM_COUNTS if kind.startswith(prefix)), None)


def decode_params(
    *,
    batch: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    capacity: int,
    dtype,
    device_kind: str | None = None,
    block_size: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> DecodeParams:
    """The `DecodeParams` of one call: explicit values (validated) win, the rest from the table entry of
    (`device_kind` or `current_device_kind()`, head_dim, group, dtype); `num_splits` by the entry's rule (module
    docstring), computed with the explicit block size when one is given. An explicit `num_splits` is clipped to
    the capacity's blocks, and the kernel then deals a row's used blocks to that many splits (min_blocks_per_split
    1: a split is empty only when the row has fewer used blocks than splits)."""
    check_params(**{k: v for k, v in dict(block_size=block_size, num_splits=num_splits, num_warps=num_warps,
                                          num_stages=num_stages).items() if v is not None})
    kind = device_kind or current_device_kind()
    entry = lookup(kind, head_dim, group, dtype)
    if block_size is not None:
        entry = dataclasses.replace(entry, block_size=block_size)
    min_blocks = 1  # an explicit split count: the used blocks are dealt to that many splits (if there are enough)
    if num_splits is None:
        rows = INVARIANT_BATCH if _FIXED_SPLITS.get() else batch
        num_splits = entry.splits_for(rows, kv_heads, capacity, sm_count(kind))
        min_blocks = entry.min_blocks_per_split
    return DecodeParams(
        block_size=entry.block_size,
        num_splits=max(1, min(num_splits, -(-capacity // entry.block_size))),
        num_warps=entry.num_warps if num_warps is None else num_warps,
        num_stages=entry.num_stages if num_stages is None else num_stages,
        min_blocks_per_split=min_blocks,
    )


def entry_text(key: tuple, entry: DecodeTuning, comment: str = "") -> str:
    """One `TABLE` row as Python source, to paste into this module."""
    fields = ", ".join(f"{f.name}={getattr(entry, f.name)!r}" for f in dataclasses.fields(entry)
                       if getattr(entry, f.name) != getattr(GENERIC, f.name) or f.name in (
                           "block_size", "num_warps", "num_stages", "programs_per_sm"))
    return f"    {key!r}: DecodeTuning({fields}),{'  # ' + comment if comment else ''}"
