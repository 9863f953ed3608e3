"""`EvictionConfig`: the static, hashable description of a KV-eviction run: the framework's sizes and the policy's
own options.

Vocabulary (spec section 1): `budget` N is the cache size right after an eviction, `buffer` B the recent slots that
always survive and the eviction period, K = N - B the slots kept from the candidates, `value_slots` Nv the slots
protected for their large value magnitude (sinks included). The cache peaks at N + B slots.

The policy's parameters live in `options`, a frozen dataclass the policy declares (`register(..., options=...)`).
They are passed as keyword arguments, `EvictionConfig("rkv", budget=512, rkv_lambda=0.1)`, or as an instance,
`EvictionConfig("rkv", options=RKVOptions(rkv_lambda=0.1))`, and read as `config.options.rkv_lambda` (or, for
short, `config.rkv_lambda`). A keyword the method does not declare raises `ValueError` naming the method and its
options. The decode kernel choice is `GenerateConfig.attention_impl`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vase_jax.eviction.registry import METHODS, NO_EVICTION, owners


def _policy_options(method: str, options: Any, values: dict[str, Any]) -> Any:
    """The options instance of `method`: `options` (or the defaults) with `values` replaced."""
    if "attention_impl" in values:
        raise ValueError(
            "EvictionConfig.attention_impl has moved to GenerateConfig.attention_impl (the decode kernel applies "
            "with and without eviction; the eviction scoring kernels follow it)"
        )
    if method == NO_EVICTION:
        if options is not None or values:
            given = ", ".join(sorted(values)) or type(options).__name__
            raise ValueError(f"EvictionConfig: method 'full' (no eviction) has no options; got {given}")
        return None
    policy = METHODS.get(method)
    if policy is None:
        if options is not None or values:
            raise ValueError(f"EvictionConfig.method={method!r} is not a known method; known: "
                             f"{', '.join(sorted([NO_EVICTION, *METHODS]))}")
        return None  # `validate` names the unknown method
    if options is None:
        options = policy.options()
    elif not isinstance(options, policy.options):
        raise ValueError(f"EvictionConfig(method={method!r}): options must be a {policy.options.__name__}, "
                         f"got {type(options).__name__}")
    unknown = sorted(set(values) - set(policy.option_names))
    if unknown:
        where = "; ".join(f"{o!r} belongs to {', '.join(owners(o))}" for o in unknown if owners(o))
        mine = ", ".join(policy.option_names) or "none"
        raise ValueError(f"EvictionConfig: method {method!r} has no option {', '.join(map(repr, unknown))}"
                         f"{' (' + where + ')' if where else ''}; options of {method!r}: {mine}")
    return dataclasses.replace(options, **values) if values else options


@dataclasses.dataclass(frozen=True, init=False)
class EvictionConfig:
    """Which eviction policy runs during decoding, with the framework's sizes and the policy's options.

    `method="full"` keeps every token (no eviction; `budget` is ignored). For every other method (a key of
    `vj.eviction.METHODS`) the cache holds at most `budget + buffer` slots whatever the output length.
    """

    method: str = NO_EVICTION
    budget: int = 4096
    buffer: int = 64
    value_slots: int | None = None  # None -> budget // 4 (the paper's Nv = N / 4)
    sink_slots: int = 4
    sort_kept_by_position: bool = False
    # Prompt compression: a prompt longer than N is evicted to N slots right after the prefill, with the method's
    # own scores (the attention-scored ones over the query ring of the prompt's last queries: SnapKV's window), so
    # the cache holds N + B slots whatever the prompt. Off by default: the paper keeps the prompt (max(P, N) + B).
    compress_prompt: bool = False
    options: Any = None  # the policy's options dataclass; None for "full"

    def __init__(self, method: str = NO_EVICTION, budget: int = 4096, buffer: int = 64,
                 value_slots: int | None = None, sink_slots: int = 4, sort_kept_by_position: bool = False,
                 compress_prompt: bool = False, options: Any = None, **option_values: Any):
        for name, value in (("method", method), ("budget", budget), ("buffer", buffer),
                            ("value_slots", value_slots), ("sink_slots", sink_slots),
                            ("sort_kept_by_position", sort_kept_by_position), ("compress_prompt", compress_prompt)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "options", _policy_options(method, options, option_values))

    def __getattr__(self, name: str) -> Any:
        """Options read as attributes: `config.rkv_lambda` is `config.options.rkv_lambda`."""
        options = self.__dict__.get("options")
        if not name.startswith("_") and options is not None and name in {f.name for f in dataclasses.fields(options)}:
            return getattr(options, name)
        raise AttributeError(f"EvictionConfig(method={self.__dict__.get('method')!r}) has no attribute {name!r}")

    # ---- derived sizes -------------------------------------------------------------------------------------------
    @property
    def recent(self) -> int:
        """R: the newest slots an eviction keeps without scoring them (not candidates). B, unless the policy's
        options define `recent_slots(config)` (TriAttention's reference lets the newest tokens compete: R = 0)."""
        own = getattr(self.options, "recent_slots", None)
        return self.buffer if own is None else own(self)

    @property
    def kept(self) -> int:
        """K = N - R: slots kept from the candidates at each eviction (N - B unless the policy sets R)."""
        return self.budget - self.recent

    @property
    def num_value_slots(self) -> int:
        """Nv, the protected large-magnitude value slots (sinks included)."""
        return self.budget // 4 if self.value_slots is None else self.value_slots

    @property
    def evicts(self) -> bool:
        return self.method != NO_EVICTION

    @property
    def label(self) -> str:
        """How tables and logs name the configuration: "full", or "method@budget" ("vase_dkv@2048")."""
        return f"{self.method}@{self.budget}" if self.evicts else self.method

    def fires(self, seen):
        """The reference's eviction trigger on `seen` real tokens, `n > N and n % B == 0` (never for "full").
        Python ints or int32 arrays."""
        if not self.evicts:
            return seen < 0  # False, of seen's type and shape
        return (seen > self.budget) & (seen % self.buffer == 0)

    def phase_wait(self, seen, step):
        """Steps a row holding `seen` tokens waits, when the batch has run `step` steps, before its first decode
        step, so that its trigger counter and the batch's step count agree modulo B (seen - step = 0 mod B) and it
        fires only on the batch's ticks (step % B == 0). 0 for "full". Python ints or int arrays; 0 <= wait < B."""
        if not self.evicts:
            return seen * 0
        return (seen - step) % self.buffer

    @property
    def policy(self):
        """The registered `Policy` of `method` (KeyError for "full")."""
        return METHODS[self.method]

    def validate(self) -> EvictionConfig:
        """Raise `ValueError` naming the parameter if this configuration cannot run. Returns self."""
        if not isinstance(self.compress_prompt, bool):
            raise ValueError(f"EvictionConfig.compress_prompt={self.compress_prompt!r} must be a bool")
        if not self.evicts:
            if self.compress_prompt:
                raise ValueError("EvictionConfig.compress_prompt=True needs an evicting method; 'full' keeps every "
                                 "token")
            return self
        if self.method not in METHODS:
            raise ValueError(f"EvictionConfig.method={self.method!r} is not a known method; known: "
                             f"{', '.join(sorted([NO_EVICTION, *METHODS]))}")
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
                f"0 <= value_slots and value_slots + sink_slots <= budget - recent slots = {self.kept}"
            )
        check = getattr(self.options, "validate", None)
        if check is not None:
            check(self)
        return self
