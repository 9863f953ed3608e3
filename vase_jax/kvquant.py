"""Quantized KV-cache storage: the setting (`KVBits`), packing, per-token-group quantization, and its bytes.

A cached key or value x [..., D] (one token of one kv head: D = head_dim channels) is quantized in groups of g
consecutive channels, asymmetrically, round-to-nearest, at b bits (qmax = 2^b - 1). Per group with minimum m
and maximum M the parameters are HQQ's (`minmax_params`):

    s' = qmax / (M - m)   (1 where M - m <= 1e-4; at most 2e4),    z = -m s'        (not rounded)
    q  = clamp(round(x s' + z), 0, qmax)                                          (the stored code)
    x_hat = (q - z) / s' = q * scale + low,   scale = 1 / s',  low = -z / s'       (what is stored beside q)

so a code is within half a step (scale / 2) of x, and this is exactly `analysis.quant.rtn_quantize` (HQQ with
the refinement off) up to the rounding of `scale` and `low` to their stored dtype. With `refine=True`, z first
goes through HQQ's proximal refinement (`refine_zero`, the spec's proximal loop), as `hqq_quantize` does.

Storage per token and kv head: the codes packed into bytes (8 bits: one per byte; 4 bits: two per byte, the even
channel in the low nibble), and one `scale` and one `low` per group in `scale_dtype` (the cache's float dtype).
Bytes per token, K and V of one kv head, head_dim 128, 16-bit scales: bf16 512; K8V8 (g = 128) 264 = 0.516x;
K8V4 (g = 128, 64) 204 = 0.398x; K4V4 (g = 64) 144 = 0.281x (`token_bytes`).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
from flax import struct

BITS = (16, 8, 4)
DEFAULT_GROUP = {8: 128, 4: 64}  # channels per scale at each width (a whole 128-wide head at 8 bits)
BF16 = "K16V16"  # the name of the 16-bit cache (`KVBits().name`), what records and benchmark rows carry


def minmax_params(w: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """HQQ's inverse scale s' and zero z per group (row of w [G, g]), each [G, 1]."""
    qmax = 2.0**bits - 1
    lo, hi = w.min(axis=1, keepdims=True), w.max(axis=1, keepdims=True)
    span = hi - lo
    small = jnp.abs(span) <= 1e-4
    s = jnp.where(small, 1.0, qmax / jnp.where(small, 1.0, span))
    s = jnp.minimum(s, 2e4)
    return s, -lo * s


def refine_zero(w: jax.Array, s: jax.Array, z: jax.Array, bits: int, keep: jax.Array, iters: int = 20,
                lp_norm: float = 0.7, beta: float = 10.0) -> jax.Array:
    """HQQ's proximal zero-point loop (spec section 5; written out in `vase_jax.analysis.quant`): w [G, g], s and
    z [G, 1], keep [G, 1] -> the refined z [G, 1]."""
    qmax = 2.0**bits - 1
    count = jnp.maximum(keep.sum() * w.shape[1], 1)

    def body(state):
        i, z, best, _ = state
        wq = jnp.clip(jnp.round(w * s + z), 0.0, qmax)
        wr = (wq - z) / s
        diff = w - wr
        mag = jnp.abs(diff)
        we = jnp.sign(diff) * jax.nn.relu(mag - (1.0 / beta) * mag ** (lp_norm - 1.0))
        z_new = jnp.mean(wq - (w - we) * s, axis=1, keepdims=True)
        err = jnp.sum(jnp.where(keep, mag, 0.0)) / count
        improved = err < best
        return i + 1, z_new, jnp.where(improved, err, best), ~improved

    def cond(state):
        i, _, _, stopped = state
        return (i < iters) & ~stopped

    init = (jnp.int32(0), z, jnp.array(jnp.inf, w.dtype), jnp.bool_(False))
    return jax.lax.while_loop(cond, body, init)[1]


@dataclasses.dataclass(frozen=True)
class KVBits:
    """Bits of cached keys and values: 16 (the cache's float dtype, unquantized), 8 or 4; keys never below values
    (keys carry outlier channels and need more bits: KIVI). `key_group` / `value_group`: channels per scale (None:
    `DEFAULT_GROUP` of the width). `refine`: HQQ's zero-point refinement when a token is quantized."""

    key_bits: int = 16
    value_bits: int = 16
    key_group: int | None = None
    value_group: int | None = None
    refine: bool = False

    @classmethod
    def parse(cls, text: str) -> KVBits:
        """"K8V4" (or "k8v4"), "K8V4g32" (one group size for both), "bf16" / "K16V16" (no quantization)."""
        if text.lower() in ("bf16", "16", "k16v16", "none"):
            return cls()
        m = re.fullmatch(r"[kK](\d+)[vV](\d+)(?:[gG](\d+))?", text.strip())
        if not m:
            raise ValueError(f"kv bits {text!r}: expected K<bits>V<bits>[g<group>], e.g. K8V4 or K4V4g32, or bf16")
        group = int(m.group(3)) if m.group(3) else None
        return cls(int(m.group(1)), int(m.group(2)), group, group)

    @property
    def name(self) -> str:
        if not self.quantizes:
            return BF16
        groups = {self.group("key"), self.group("value")} - {None}
        suffix = f"g{groups.pop()}" if len(groups) == 1 and (self.key_group or self.value_group) else ""
        return f"K{self.key_bits}V{self.value_bits}{suffix}" + ("-hqq" if self.refine else "")

    @property
    def quantizes(self) -> bool:
        return self.key_bits < 16 or self.value_bits < 16

    def bits(self, which: str) -> int:
        return self.key_bits if which == "key" else self.value_bits

    def group(self, which: str) -> int | None:
        """Channels per scale of "key" or "value" (None at 16 bits)."""
        bits = self.bits(which)
        if bits == 16:
            return None
        explicit = self.key_group if which == "key" else self.value_group
        return DEFAULT_GROUP[bits] if explicit is None else explicit

    def validate(self, head_dim: int | None = None) -> KVBits:
        for which in ("key", "value"):
            bits = self.bits(which)
            if isinstance(bits, bool) or bits not in BITS:
                raise ValueError(f"{which}_bits={bits!r}; allowed: {', '.join(map(str, BITS))}")
            explicit = self.key_group if which == "key" else self.value_group
            if explicit is not None and (isinstance(explicit, bool) or not isinstance(explicit, int)
                                         or explicit < 2 or explicit % 2):
                raise ValueError(f"{which}_group={explicit!r} must be an even integer >= 2")
            group = self.group(which)
            if head_dim is not None and group is not None and head_dim % group:
                raise ValueError(f"{which}_group={group} must divide head_dim={head_dim}")
        if self.key_bits < self.value_bits:
            raise ValueError(f"key_bits={self.key_bits} < value_bits={self.value_bits}: keys are never stored in "
                             "fewer bits than values")
        return self


def kv_name(text: str) -> str:
    """The canonical name of a --kv-bits entry ("bf16" -> "K16V16", "k4v4" -> "K4V4"), as records and benchmark
    rows carry it; ValueError naming the flag."""
    try:
        return KVBits.parse(str(text)).validate().name
    except ValueError as e:
        raise ValueError(f"--kv-bits: {e}") from None


# ---- packing --------------------------------------------------------------------------------------------------
def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Codes [..., D] (integers in [0, 2^bits)) as bytes [..., D * bits / 8] (uint8). 4 bits: byte i holds channel
    2i in its low nibble and 2i + 1 in its high nibble."""
    codes = codes.astype(jnp.uint8)
    if bits == 8:
        return codes
    if bits != 4:
        raise ValueError(f"bits={bits}; packing takes 8 or 4")
    if codes.shape[-1] % 2:
        raise ValueError(f"4-bit packing needs an even channel count, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)  # [..., D / 2, 2] (no -1: may be empty)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """The inverse of `pack`: bytes [..., D * bits / 8] -> codes [..., D] (uint8)."""
    if bits == 8:
        return packed
    if bits != 4:
        raise ValueError(f"bits={bits}; unpacking takes 8 or 4")
    low, high = packed & 0x0F, packed >> 4  # [..., D / 2] each
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---- quantization ---------------------------------------------------------------------------------------------
@struct.dataclass
class Quantized:
    """Tokens x [..., D] stored at `bits` bits in groups of `group` channels: x_hat = code * scale + low."""

    codes: jax.Array  # [..., D * bits / 8] uint8, packed
    scale: jax.Array  # [..., D / group] in the scale dtype
    low: jax.Array  # [..., D / group]
    bits: int = struct.field(pytree_node=False)


def quantize(x: jax.Array, bits: int, group: int | None, *, refine: bool = False, scale_dtype=None) -> Quantized:
    """x [..., D] -> `Quantized` (module docstring); the math in float32, `scale` and `low` stored in
    `scale_dtype` (default: x's dtype). `bits=16` keeps x as it is (`codes` = x, no scale: one side of a K16V8
    setting)."""
    d = x.shape[-1]
    if bits == 16:
        empty = jnp.zeros(x.shape[:-1] + (0,), scale_dtype or x.dtype)
        return Quantized(x, empty, empty, 16)
    if d % group:
        raise ValueError(f"group={group} must divide the channel count {d}")
    w = x.astype(jnp.float32).reshape(-1, group)  # [tokens * D / g, g]
    s, z = minmax_params(w, bits)  # [G, 1] each
    if refine:
        z = refine_zero(w, s, z, bits, jnp.ones_like(s, bool))
    q = jnp.clip(jnp.round(w * s + z), 0.0, 2.0**bits - 1)  # [G, g]
    lead = x.shape[:-1]
    dtype = jnp.dtype(scale_dtype or x.dtype)
    scale = (1.0 / s).reshape(*lead, d // group).astype(dtype)
    low = (-z / s).reshape(*lead, d // group).astype(dtype)
    return Quantized(pack(q.reshape(x.shape), bits), scale, low, bits)


def slots_last(qx: Quantized) -> Quantized:
    """`qx` [..., slots, ...] as a cache segment stores it: `scale` and `low` group-major [..., groups, slots] (the
    slots on the lanes of a TPU tile and contiguous per group: a group's parameters of a block of slots are one
    row, read by the kernels as they are); `codes` unchanged [..., slots, bytes]. Undone by `slots_first`."""
    return qx.replace(scale=jnp.swapaxes(qx.scale, -1, -2), low=jnp.swapaxes(qx.low, -1, -2))


def slots_first(qx: Quantized) -> Quantized:
    """A stored segment (`slots_last`) back to tokens: `scale` and `low` [..., slots, groups]."""
    return slots_last(qx)  # the swap is its own inverse


def dequantize(qx: Quantized, dtype=jnp.float32) -> jax.Array:
    """x_hat [..., D] = code * scale + low per group, computed in float32, returned in `dtype`."""
    if qx.bits == 16:
        return qx.codes.astype(dtype)
    codes = unpack(qx.codes, qx.bits).astype(jnp.float32)  # [..., D]
    groups = qx.scale.shape[-1]
    codes = codes.reshape(*codes.shape[:-1], groups, -1)  # [..., G, g]
    x = codes * qx.scale.astype(jnp.float32)[..., None] + qx.low.astype(jnp.float32)[..., None]
    return x.reshape(*x.shape[:-2], -1).astype(dtype)


def token_bytes(head_dim: int, kv_bits: KVBits, itemsize: int = 2) -> int:
    """Bytes of one cached token's key and value for one kv head: codes plus `scale` and `low` per group
    (`itemsize` bytes each, the cache's float dtype), or 2 * head_dim * itemsize unquantized."""
    total = 0
    for which in ("key", "value"):
        bits, group = kv_bits.bits(which), kv_bits.group(which)
        total += head_dim * itemsize if bits == 16 else head_dim * bits // 8 + 2 * (head_dim // group) * itemsize
    return total


# ---- which kept slots stay in 16 bits ---------------------------------------------------------------------------
def split_kept(kept: jax.Array, quantized: jax.Array, value_range: jax.Array, protected: int):
    """After an eviction: which kept slots stay in 16 bits and which are (or become) quantized.

    kept [..., K] int32: the kept slots of one (row, kv head) (the policy's order); quantized [..., C] bool: the
    slot is stored quantized now; value_range [..., C]: Range(v) of each slot, computed from its 16-bit value when
    it was written; protected: P <= K.

    Rule: among the kept slots still in 16 bits, the P with the largest Range stay in 16 bits (ties: the earlier
    in `kept`); every other kept slot is stored quantized, those already quantized keep their codes. So a token
    is quantized at most once, and a quantized token never returns to 16 bits (it has no 16-bit value left). The
    shapes are static: at most K - P kept slots are quantized (the quantized part holds K - P slots), so at least
    P kept slots are in 16 bits. With VaSE (P = Nv) the 16-bit ones are its protected set: VaSE keeps the top-Nv
    candidates by Range, and a quantized token ranked below them when it was quantized.

    Returns (full [..., P], quant [..., K - P], fresh [..., K - P]): the slots for the 16-bit part and for the
    quantized part, each in the order of `kept`; `fresh` marks the quantized part's slots that are quantized now
    (they were in 16 bits).
    """
    k = kept.shape[-1]
    if not 0 <= protected <= k:
        raise ValueError(f"protected={protected} must be in [0, kept={k}]")
    was_quant = jnp.take_along_axis(quantized, kept, axis=-1)  # [..., K]
    rng = jnp.take_along_axis(value_range.astype(jnp.float32), kept, axis=-1)
    score = jnp.where(was_quant, -jnp.inf, rng)  # [..., K]
    # top-P positions of `kept` by Range among the 16-bit ones; lax.top_k puts the earlier of equal values first
    _, top = jax.lax.top_k(score, protected) if protected else (None, jnp.zeros(kept.shape[:-1] + (0,), jnp.int32))
    is_full = jnp.zeros(kept.shape, bool)
    is_full = jnp.put_along_axis(is_full, top, True, axis=-1, inplace=False) if protected else is_full
    order = jnp.argsort(~is_full, axis=-1, stable=True)  # the 16-bit ones first, each group in `kept` order
    ordered = jnp.take_along_axis(kept, order, axis=-1)
    fresh = ~jnp.take_along_axis(was_quant, order, axis=-1)[..., protected:]
    return ordered[..., :protected], ordered[..., protected:], fresh


def tier_slots(budget: int, buffer: int, protected: int) -> tuple[int, int]:
    """(16-bit slots, quantized slots) of one (row, kv head) of an evicting cache in two tiers (docs/DESIGN.md):
    the P protected, the B recent slots kept at the last event and the B written since in 16 bits; the other
    K - P = N - B - P kept slots quantized. Together N + B, the capacity of today's cache."""
    kept = budget - buffer
    if not 0 <= protected <= kept:
        raise ValueError(f"protected={protected} must be in [0, budget - buffer = {kept}]")
    return protected + 2 * buffer, kept - protected


def tiered_bytes(budget: int, buffer: int, protected: int, head_dim: int, kv_bits: KVBits, itemsize: int = 2) -> int:
    """Bytes of K and V of one (row, kv head) of that cache (`tier_slots`, `token_bytes`)."""
    full, quant = tier_slots(budget, buffer, protected)
    return full * token_bytes(head_dim, KVBits(), itemsize) + quant * token_bytes(head_dim, kv_bits, itemsize)
