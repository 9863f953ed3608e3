"""KV-cache eviction: configuration, the method registry, the shared scores and one module per policy family.

Importing this package registers every method in `METHODS` (name -> `Method`).
"""

from vase_jax.eviction import attention, cur, rkv, scores, uniform  # noqa: F401  (registration on import)
from vase_jax.eviction.config import EvictionConfig
from vase_jax.eviction.registry import METHODS, EvictionInputs, Method, register

__all__ = ["METHODS", "EvictionConfig", "EvictionInputs", "Method", "register", "scores"]
