"""KV-cache eviction: configuration, the policy registry, the shared scores and one module per policy family.

Importing this package registers every policy in `METHODS` (name -> `Policy`). `"full"` (no eviction) is not a
policy: `EvictionConfig("full")` turns the framework off.
"""

from vase_jax.eviction import (  # noqa: F401  (registration)
    attention,
    cur,
    h2o,
    keydiff,
    rkv,
    scores,
    triattention,
    uniform,
)
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import (
    METHODS,
    NO_EVICTION,
    EvictionInputs,
    NoOptions,
    Policy,
    SlotState,
    accumulate,
    register,
)

__all__ = [
    "METHODS",
    "NO_EVICTION",
    "EvictionConfig",
    "EvictionInputs",
    "NoOptions",
    "Policy",
    "SlotState",
    "accumulate",
    "register",
    "scores",
]
