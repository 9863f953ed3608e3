"""TriAttention statistics for the tests' random models: random numbers of the model's shape, in a file.

`eviction(method, cfg, **kw)` is `EvictionConfig(method, **kw)` with such a file as `calibration` for the methods
that take one (their kept sets on a random model prove the code paths, not the method's quality).
"""

from __future__ import annotations

import functools
import os
import tempfile
import types

import vase_jax as vj
from vase_jax.calibration import random_statistics
from vase_jax.eviction import METHODS
from vase_jax.eviction.triattention import save_calibration


@functools.cache
def stats_file(num_layers: int, num_heads: int, head_dim: int, rope_theta: float) -> str:
    """A statistics file of random numbers for a model of these sizes (`random_statistics`)."""
    cfg = types.SimpleNamespace(num_layers=num_layers, num_heads=num_heads, num_kv_heads=1, head_dim=head_dim,
                                rope_theta=rope_theta)
    folder = tempfile.mkdtemp(prefix="vase-jax-stats-")
    return save_calibration(os.path.join(folder, "stats.npz"), random_statistics(cfg))


def for_model(cfg) -> str:
    return stats_file(cfg.num_layers, cfg.num_heads, cfg.head_dim, float(cfg.rope_theta))


def eviction(method: str, cfg, **kw) -> vj.EvictionConfig:
    """`EvictionConfig(method, **kw)`, with a statistics file of `cfg`'s shape where the method takes one."""
    if method != "full" and "calibration" in METHODS[method].option_names:
        kw = {"calibration": for_model(cfg)} | kw
    return vj.EvictionConfig(method, **kw)
