"""`EvictionConfig`: the static, hashable description of a KV-eviction policy.

Vocabulary (spec section 1): `budget` N is the cache size right after an eviction, `buffer` B the recent slots that
always survive and the eviction period, K = N - B the slots kept from the candidates, `value_slots` Nv the slots
protected for their large value magnitude (sinks included). The cache peaks at N + B slots.
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.dispatch import IMPLS as ATTENTION_IMPLS

MAGNITUDES = ("range", "l2", "var")


@dataclasses.dataclass(frozen=True)
class EvictionConfig:
    """Which eviction policy runs during decoding, and with what sizes.

    `method="full"` keeps every token (no eviction; `budget` is ignored). For every other method the cache holds
    at most `budget + buffer` slots whatever the output length.
    """

    method: str = "full"
    budget: int = 4096
    buffer: int = 64
    value_slots: int | None = None  # None -> budget // 4 (the paper's Nv = N / 4)
    sink_slots: int = 4
    rkv_lambda: float = 0.5
    smooth: bool = True
    projection_rank: int = 20
    magnitude: str = "range"
    sort_kept_by_position: bool = False
    attention_impl: str = "auto"
    score_temperature: float = 1.0  # the reference's eviction `temperature` (attention-logit scale), 1.0 everywhere
    rkv_window: int = 8  # rkv_official: queries in the observation window (alpha)
    rkv_pool: int = 7  # rkv_official: max-pool kernel
    rkv_threshold: float = 0.5  # rkv_official: similarity threshold of the "retain last" rule

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def kept(self) -> int:
        """K = N - B: slots kept from the candidates at each eviction."""
        return self.budget - self.buffer

    @property
    def num_value_slots(self) -> int:
        """Nv, the protected large-magnitude value slots (sinks included)."""
        return self.budget // 4 if self.value_slots is None else self.value_slots

    @property
    def evicts(self) -> bool:
        return self.method != "full"

    def validate(self) -> EvictionConfig:
        """Raise `ValueError` naming the parameter if this configuration cannot run. Returns self."""
        from vase_jax.eviction.registry import METHODS  # late import: methods register themselves on import

        if self.method not in METHODS:
            raise ValueError(
                f"EvictionConfig.method={self.method!r} is not a known method; known: {', '.join(sorted(METHODS))}"
            )
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"EvictionConfig.attention_impl={self.attention_impl!r}; allowed: {', '.join(ATTENTION_IMPLS)}"
            )
        if not self.evicts:
            return self
        if self.buffer < 1:
            raise ValueError(f"EvictionConfig.buffer={self.buffer} must be >= 1")
        if self.budget <= self.buffer:
            raise ValueError(
                f"EvictionConfig.budget={self.budget} must be larger than buffer={self.buffer} (N > B)"
            )
        if self.budget % self.buffer:
            raise ValueError(
                f"EvictionConfig.budget={self.budget} must be a multiple of buffer={self.buffer} (N % B == 0)"
            )
        if self.sink_slots < 0:
            raise ValueError(f"EvictionConfig.sink_slots={self.sink_slots} must be >= 0")
        nv = self.num_value_slots
        if nv < 0 or nv + self.sink_slots > self.kept:
            raise ValueError(
                f"EvictionConfig.value_slots={nv} with sink_slots={self.sink_slots} must satisfy "
                f"0 <= value_slots and value_slots + sink_slots <= budget - buffer = {self.kept}"
            )
        if self.magnitude not in MAGNITUDES:
            raise ValueError(f"EvictionConfig.magnitude={self.magnitude!r}; allowed: {', '.join(MAGNITUDES)}")
        if not 0.0 <= self.rkv_lambda <= 1.0:
            raise ValueError(f"EvictionConfig.rkv_lambda={self.rkv_lambda} must lie in [0, 1]")
        if self.projection_rank < 1:
            raise ValueError(f"EvictionConfig.projection_rank={self.projection_rank} must be >= 1")
        if self.score_temperature <= 0:
            raise ValueError(f"EvictionConfig.score_temperature={self.score_temperature} must be > 0")
        if not 1 <= self.rkv_window <= self.buffer:
            raise ValueError(f"EvictionConfig.rkv_window={self.rkv_window} must lie in [1, buffer={self.buffer}]")
        if self.rkv_pool < 1 or self.rkv_pool % 2 == 0:
            raise ValueError(f"EvictionConfig.rkv_pool={self.rkv_pool} must be a positive odd number")
        return self
