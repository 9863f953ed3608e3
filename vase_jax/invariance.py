"""Batch invariance: does a row's result depend on how many rows ride with it, here, and from how many rows on not?

A matmul's kernel is picked by its shape. On XLA:CPU (jax 0.10.2) a one-row matmul is a matrix-vector product whose
float32 sums differ from the multi-row kernel's (AMD EPYC, AVX2: batch 1 differs, 2 to 128 agree); on an Intel Xeon
with AVX-512 (with AMX too), in bfloat16, batches 1 and 2 differ and 3 on agree; on GPUs cuBLAS picks kernels and
split-K by the row count too. So the rule is measured, not assumed: `probe_shapes` runs the model's own matmuls (its
projections and LM head through `model.linear`, as the model runs them) at batches `BATCHES` on the current backend
and dtype, on inputs whose products cancel (so that the order of a sum shows in every output, in bfloat16 too),
compares the rows' bits with the same rows in one batch of all rows, and returns a `RowRule`: the fewest rows per
device from which every tested batch agrees (`min_rows`, at least the platform's `DEFAULT_MIN_ROWS`), or, when no
such count exists up to `MAX_MIN_ROWS`, that invariance cannot be promised here. The reductions within a row that
the model and the decode attention's XLA path do are summed in a fixed order
(`pallas_kernels.dispatch.pairwise_sum`), so they need no rule: XLA:CPU vectorizes a reduce by the number of rows it
holds (a float32 RMSNorm over head_dim, and the decode softmax's sum at 2 rows against 8, gave other bits before
that).

`generate`, the continuous engine and `replay` run a batch of fewer rows than `min_rows` beside copies of its first
row (per device, on a data mesh), so that every batch size takes the path of the larger ones. `rule_for` keeps
the rule per process (keyed by platform, device kind, dtype and shapes) and, where JAX's persistent compilation cache
is on (`vase_jax.jit.enable_compilation_cache`), in its folder too, keyed also by what else could change the kernels
(`rule_key`): the probe then runs once per machine, not once per process. `python -m vase_jax.check_invariance`
probes anew and prints the rule.

    rule = probe_shapes(hidden=1024, q_dim=2048, kv_dim=1024, mlp=3072, vocab=151936, dtype=jnp.bfloat16)
    rule.min_rows   # e.g. 2: a lone row runs beside one copy
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from vase_jax.jit import host_cpu, sources_digest
from vase_jax.model import linear
from vase_jax.target import Target

BATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 64)  # rows per device that the probe runs
W_BLOCK_ROWS = 8192  # rows of the probe's weights drawn at a time (`_cancelling`)
RULES_FOLDER = "vase-jax-row-rules"  # `rule_for`'s rules on disk, in the persistent compilation cache's folder
MAX_MIN_ROWS = 8  # padding a batch beyond this many rows would cost too much: beyond it, no promise
# The fewest rows per device on each platform, measured or not (and the rule when nothing was measured: a lowering
# for another platform, abstract weights). On XLA:CPU a batch of one also drops the unit batch axis of the
# attention's batched dots (another kernel, which the matmul probe does not run: a lone prompt's float32 logits
# differ from its row's in batches of 2 to 8), and its one-row matmul is a matrix-vector product.
DEFAULT_MIN_ROWS = {"cpu": 2, "cuda": 1, "rocm": 1, "tpu": 1}


@dataclasses.dataclass(frozen=True)
class RowRule:
    """What `probe` measured. `min_rows`: run at least this many rows per device (1: any batch is invariant);
    `invariant`: every tested batch of at least `min_rows` rows gave each row the bits it has in the largest batch;
    `differs`: per operation, the batches whose rows differed; `platform`, `device`, `dtype`: where it was measured.
    """

    min_rows: int
    invariant: bool
    differs: tuple[tuple[str, tuple[int, ...]], ...]
    platform: str
    device: str
    dtype: str
    batches: tuple[int, ...] = BATCHES

    def describe(self) -> str:
        where = f"{self.platform} ({self.device}), {self.dtype}"
        bad = "; ".join(f"{op}: {', '.join(map(str, ms))}" for op, ms in self.differs if ms) or "none"
        if not self.invariant:
            return (f"{where}: rows are NOT batch-invariant (batches tested {list(self.batches)}; differing from the "
                    f"largest: {bad}); a row's tokens may depend on its batch")
        pad = "no padding" if self.min_rows == 1 else f"batches of fewer than {self.min_rows} rows run beside copies"
        return f"{where}: rows batch-invariant from {self.min_rows} rows per device on ({pad}; differing: {bad})"


def unpadded(target: Target, dtype) -> RowRule:
    """The rule of `GenerateConfig(batch_invariant=False)`: no probe, no promise, and no padding but the target's
    own `min_rows` (on CPU a lone row of a 16-bit model runs beside a copy: its one-row matmuls would be 5-8x
    slower)."""
    return RowRule(target.min_rows(dtype), False, (), target.platform, "off", jnp.dtype(dtype).name)


def padded_rows(rows: int, rule: RowRule, data: int = 1) -> int:
    """The rows a batch of `rows` runs as: at least `rule.min_rows` per device of the `data` axis."""
    return max(rows, rule.min_rows * data)


# ---- the probe --------------------------------------------------------------------------------------------------
def probe_shapes(*, hidden: int, q_dim: int, kv_dim: int, mlp: int, vocab: int, dtype, target: Target | None = None,
                 batches: tuple[int, ...] = BATCHES, seed: int = 0) -> RowRule:
    """Measure the `RowRule` of a model of these widths on the default backend (or `target`'s platform): the
    matmuls x [m, in] @ w [out, in] of every projection (hidden -> q_dim, kv_dim, mlp, vocab; q_dim, mlp ->
    hidden) through `model.linear` (as the model runs them on `target`), each at every batch m of `batches`.

    Only the matmuls: they are the operations whose row count is a kernel's M. Norms, attention and the eviction
    scores reduce within a row, with the batch as an outer loop; probed alone they mislead (XLA:CPU compiles a
    lone [m, 256] float32 RMSNorm differently at m = 3..8 than at 64, while inside the model every row of batches
    1..8 agrees bit for bit); the tests check them inside `generate`."""
    target = target or Target.of()
    dtype = jnp.dtype(dtype)
    top = max(batches)
    rng = np.random.default_rng(seed)
    differs = []
    matmuls = [(hidden, n) for n in dict.fromkeys((q_dim, kv_dim, mlp, vocab))]
    matmuls += [(k, hidden) for k in dict.fromkeys((q_dim, mlp))]
    run_linear = jax.jit(lambda x, w: linear(x, w, target))
    for k, n in matmuls:
        x, w = _cancelling(rng, top, k, n, dtype)
        differs.append((f"linear {k}->{n}", _differing(lambda rows, x=x, w=w: run_linear(x[rows], w), top,
                                                       batches)))
    bad = sorted({m for _, ms in differs for m in ms})
    min_rows = next((p for p in batches if not any(m >= p for m in bad)), top + 1)
    min_rows = max(min_rows, DEFAULT_MIN_ROWS[target.platform])
    device = jax.devices(target.platform if target.platform != "cuda" else "gpu")[0]
    invariant = min_rows <= MAX_MIN_ROWS
    return RowRule(min_rows=min_rows if invariant else DEFAULT_MIN_ROWS[target.platform], invariant=invariant,
                   differs=tuple(differs), platform=target.platform, device=str(device.device_kind),
                   dtype=dtype.name, batches=tuple(batches))


def _cancelling(rng: np.random.Generator, rows: int, k: int, n: int, dtype) -> tuple[np.ndarray, jax.Array]:
    """x [rows, k] on the host (the probe's batches are slices of it, sent as they are: gathered on the device, each
    batch compiled a gather of its own, 1.5 s of the probe's 2.3 s at the tiny model's widths) and w [n, k] on the
    device, whose products cancel: each product u * w0 has a partner -u * w0 at another, random position of k (u
    spread over 2^0..2^11), so every output is exactly 0 in exact arithmetic and what a float sum leaves is the
    rounding of the order it summed in. With plain normal inputs a kernel that sums in another order rarely changes a
    bfloat16 output (an Intel Xeon with AMX: its 2-row bfloat16 matmuls differ from 64-row ones, which a probe with
    normal inputs missed while `generate`'s rows differed)."""
    half = k // 2
    u = rng.standard_normal((rows, half)) * 2.0 ** rng.integers(0, 12, (rows, half))
    # w0 [n, half], drawn in float64 blocks of rows and rounded once to `dtype` (float64 [n, k] copies of an LM head
    # would take 6 GiB of host memory at Qwen3-14B's widths)
    w0 = np.empty((n, half), dtype)
    for start in range(0, n, W_BLOCK_ROWS):
        stop = min(start + W_BLOCK_ROWS, n)
        w0[start:stop] = rng.standard_normal((stop - start, half)) * k ** -0.5
    order = rng.permutation(k)  # partners apart, in no block structure a kernel could mirror
    x = np.zeros((rows, k))
    x[:, :half], x[:, half:2 * half] = u, -u
    # column j of w holds w0's column order[j] mod half (u's partner -u sits at the other of the two); an odd k
    # leaves one column of zeros
    w = np.take(w0, order % half, axis=1) if half else np.zeros((n, k), dtype)  # [n, k] (a masked column
    # assignment took 36x as long)
    w[:, order >= 2 * half] = 0
    return np.asarray(x[:, order], dtype), jnp.asarray(w)


def _differing(run, rows: int, batches, chunks: int = 4) -> tuple[int, ...]:
    """The batches m whose rows differ (bitwise) from the same rows of one batch of all `rows`. `run(rows)`
    computes the operation on the rows the slice `rows` selects, each m its own program whose inputs have m rows
    (as the model's do); the first `chunks` groups of m rows are compared."""
    whole = np.asarray(run(slice(0, rows))).view(np.uint8)
    bad = []
    for m in batches:
        parts = [np.asarray(run(slice(i, i + m))).view(np.uint8)
                 for i in range(0, min(rows - m, (chunks - 1) * m) + 1, m)]
        if not np.array_equal(np.concatenate(parts), whole[:len(parts) * m]):
            bad.append(m)
    return tuple(bad)


def rule_key(platform: str, device: str, dtype: str, widths: tuple) -> str:
    """The on-disk key of a rule: everything the probe's result may depend on. Its inputs (platform, device kind,
    dtype, widths, `BATCHES`), the software that compiles and runs it (jax, jaxlib, the backend's platform version,
    XLA_FLAGS and LIBTPU_INIT_ARGS, the default matmul precision, the library's sources) and the host CPU (its model,
    instruction sets and usable CPUs: a CPU backend's kernels follow them)."""
    backend = jax.devices("gpu" if platform in ("cuda", "rocm") else platform)[0].client
    parts = [platform, device, dtype, list(widths), list(BATCHES), jax.__version__, jaxlib.__version__,
             backend.platform_version, os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
             str(jax.config.jax_default_matmul_precision), sources_digest(), json.dumps(host_cpu())]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def rules_folder() -> Path | None:
    """Where `rule_for` keeps rules on disk: `RULES_FOLDER` in JAX's persistent compilation cache folder while that
    cache is on and local, else None (rules are then kept per process only; a remote cache such as gs://... too)."""
    folder = jax.config.jax_compilation_cache_dir
    local = folder and "://" not in str(folder) and jax.config.jax_enable_compilation_cache
    return Path(folder) / RULES_FOLDER if local else None


def _load_rule(path: Path) -> RowRule | None:
    """The rule stored at `path`, or None (none there, or unreadable: it is probed again and rewritten)."""
    try:
        d = json.loads(path.read_text())
        return RowRule(int(d["min_rows"]), bool(d["invariant"]),
                       tuple((str(op), tuple(int(m) for m in ms)) for op, ms in d["differs"]), str(d["platform"]),
                       str(d["device"]), str(d["dtype"]), tuple(int(m) for m in d["batches"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store_rule(path: Path, rule: RowRule) -> None:
    """`rule` as JSON at `path`, written whole (a temporary file renamed: processes probing at once each write a
    complete file); a folder that cannot be written is left alone (the rule stays per process)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(rule)))
        os.replace(tmp, path)
    except OSError:
        pass


@functools.cache
def _cached_rule(platform: str, device: str, dtype: str, widths: tuple) -> RowRule:
    folder = rules_folder()
    path = folder / f"{rule_key(platform, device, dtype, widths)}.json" if folder else None
    rule = _load_rule(path) if path else None
    if rule is None:
        hidden, q_dim, kv_dim, mlp, vocab = widths
        rule = probe_shapes(hidden=hidden, q_dim=q_dim, kv_dim=kv_dim, mlp=mlp, vocab=vocab, dtype=dtype,
                            target=Target.make(platform))
        if path:
            _store_rule(path, rule)
    if not rule.invariant:
        warnings.warn(f"vase_jax: {rule.describe()}", RuntimeWarning, stacklevel=3)
    return rule


def rule_for(cfg, dtype, target: Target, probe: bool = True) -> RowRule:
    """The `RowRule` of a model of config `cfg` in `dtype` on `target`'s platform, probed once per process, or once
    per machine where the persistent compilation cache is on (`rules_folder`; a `RuntimeWarning` once per process
    when invariance cannot be promised). Without `probe`, or for a platform with no devices here (a program
    lowered for another platform), the documented default `DEFAULT_MIN_ROWS` (not measured, so not promised)."""
    platform, dtype = target.platform, jnp.dtype(dtype).name
    default = RowRule(DEFAULT_MIN_ROWS[platform], False, (), platform, "not measured", dtype)
    if not probe:
        return default
    try:
        device = jax.devices("gpu" if platform in ("cuda", "rocm") else platform)[0]
    except RuntimeError:
        return default
    widths = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
              cfg.intermediate_size, cfg.vocab_size)
    return _cached_rule(platform, str(device.device_kind), dtype, widths)
