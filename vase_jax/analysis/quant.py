"""Per-token groupwise value quantization in JAX: HQQ (spec section 5) and round-to-nearest (RTN).

A tensor `x [..., D]` is quantized in groups of g consecutive channels of one row (HQQ's `W.reshape(-1, g)` with
`axis=1`: for a value cache `[Hkv * T, D]` each group holds g channels of one token of one head). Per group
with minimum m and maximum M, at `bits` bits (qmax = 2^bits - 1), HQQ keeps the *inverse* scale

    s' = qmax / (M - m),   s' = 1 where |M - m| <= 1e-4,   s' = min(s', 2e4),   z = -m * s'   (not rounded).

RTN quantizes with these: q = clamp(round(w s' + z), 0, qmax), w_hat = (q - z) * (1 / s').

HQQ (`optimize=True`) first refines z with the half-quadratic proximal loop of `optimize_weights_proximal_legacy`
(scale fixed; iters = 20, p = 0.7, beta = 10; kappa is not applied), exactly as the spec writes it:

    best = inf
    for i in range(iters):
        Wq = clamp(round(w s' + z), 0, qmax);  Wr = (Wq - z) / s'                 # with the current z
        We = sign(w - Wr) * relu(|w - Wr| - (1 / beta) |w - Wr|^(p - 1))         # generalized soft-threshold
        z  = mean_group(Wq - (w - We) s')                                         # always applied, also on the
        err = mean |w - Wr|            (one scalar over the whole tensor)         #  iteration that stops
        if err < best: best = err  else: break

then quantizes as RTN with the refined z. With `optimize=False` it is RTN. (HQQ's own shrink adds 1e-8 to |w - Wr|
inside the power; the spec's formula, followed here, does not: the two differ only where |w - Wr| < ~1e-6.)
Where a row mask `valid` is given, err is the mean over the valid rows only (padding rows do not count), so a
padded tensor stops exactly where the unpadded one would.

The per-token error and magnitude (spec section 5):

    MSE(token) = mean_c (x - x_hat)^2,    Range(token) = max_c x - min_c x     (over all D channels).

The spec's KIVI-style RTN (`scale = max(M - m, 1e-5) / qmax`, zero rounded and clamped) differs from the RTN here
only by its rounded zero point.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from vase_jax.kvquant import minmax_params, refine_zero  # the runtime cache's quantizer: one copy


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """One quantization setting: bits in {1..8}, group size g dividing the channel count."""

    bits: int
    group_size: int
    iters: int = 20
    lp_norm: float = 0.7
    beta: float = 10.0

    @property
    def name(self) -> str:
        return f"b{self.bits}g{self.group_size}"

    def validate(self, channels: int | None = None) -> QuantConfig:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"bits={self.bits!r} must be an integer in 1..8")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size={self.group_size!r} must be a positive integer")
        if channels is not None and channels % self.group_size:
            raise ValueError(f"group_size={self.group_size} must divide the channel count {channels}")
        if isinstance(self.iters, bool) or not isinstance(self.iters, int) or self.iters < 0:
            raise ValueError(f"iters={self.iters!r} must be an integer >= 0")
        if not self.beta > 0:
            raise ValueError(f"beta={self.beta!r} must be > 0")
        return self


PAPER_CONFIGS = tuple(QuantConfig(b, g) for b in (2, 4) for g in (32, 64))  # b2g32, b2g64, b4g32, b4g64


def compute_dtype(x: jax.Array):
    """float32, or float64 for float64 input (with jax_enable_x64): bf16 / f16 caches are quantized in f32."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _groups(x: jax.Array, group_size: int, valid: jax.Array | None):
    """x [..., D] -> w [G, g] in `compute_dtype` (G = rows * D / g) and the per-group validity [G, 1]."""
    d = x.shape[-1]
    if d % group_size:
        raise ValueError(f"group_size={group_size} must divide the channel count {d}")
    w = x.astype(compute_dtype(x)).reshape(-1, group_size)
    if valid is None:
        keep = jnp.ones((w.shape[0], 1), bool)
    else:
        keep = jnp.repeat(valid.reshape(-1), d // group_size)[:, None]
    return w, keep


def _dequant(w, s, z, bits):
    q = jnp.clip(jnp.round(w * s + z), 0.0, 2.0**bits - 1)
    return (q - z) * (1.0 / s)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "optimize", "iters", "lp_norm", "beta"))
def hqq_quantize(x: jax.Array, bits: int, group_size: int, optimize: bool = True, valid: jax.Array | None = None,
                 iters: int = 20, lp_norm: float = 0.7, beta: float = 10.0) -> jax.Array:
    """Quantize-dequantize x [..., D] with HQQ per token-group (module docstring); x's shape, `compute_dtype`.

    valid: optional [...] row mask (padding rows False): the early-stop error averages over valid rows only.
    """
    w, keep = _groups(x, group_size, valid)
    s, z = minmax_params(w, bits)
    if optimize:
        z = refine_zero(w, s, z, bits, keep, iters, lp_norm, beta)
    return _dequant(w, s, z, bits).reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("bits", "group_size"))
def rtn_quantize(x: jax.Array, bits: int, group_size: int) -> jax.Array:
    """Round-to-nearest min-max quantize-dequantize of x [..., D] per token-group (HQQ's initial s', z)."""
    w, _ = _groups(x, group_size, None)
    s, z = minmax_params(w, bits)
    q = jnp.clip(jnp.round(w * s + z), 0.0, 2.0**bits - 1)
    return ((q - z) * (1.0 / s)).reshape(x.shape)


def token_mse(x: jax.Array, x_hat: jax.Array) -> jax.Array:
    """mean_c (x - x_hat)^2 over the last axis."""
    dt = compute_dtype(x)
    return jnp.mean((x.astype(dt) - x_hat.astype(dt)) ** 2, axis=-1)


def token_range(x: jax.Array) -> jax.Array:
    """Range(v) = max_c v - min_c v over the last axis."""
    x = x.astype(compute_dtype(x))
    return x.max(axis=-1) - x.min(axis=-1)


def pearson(a: jax.Array, b: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """Pearson correlation of a and b (same shape), over the entries where `valid` (all if None); NaN if either
    is constant: r = sum (a - mean a)(b - mean b) / sqrt(sum (a - mean a)^2 * sum (b - mean b)^2)."""
    dt = jnp.promote_types(compute_dtype(a), compute_dtype(b))
    a, b = a.astype(dt).reshape(-1), b.astype(dt).reshape(-1)
    m = jnp.ones_like(a, bool) if valid is None else valid.reshape(-1)
    n = jnp.maximum(m.sum(), 1)
    da = jnp.where(m, a - jnp.sum(jnp.where(m, a, 0.0)) / n, 0.0)
    db = jnp.where(m, b - jnp.sum(jnp.where(m, b, 0.0)) / n, 0.0)
    return jnp.sum(da * db) / jnp.sqrt(jnp.sum(da * da) * jnp.sum(db * db))
