"""Whether a `generate` call can fit its device, said before anything compiles.

A lower bound of the device bytes a call needs, from shapes alone:

    need = weights + cache + prefill scores
    prefill scores = batch x query heads x T x T x 4 bytes (the dense prefill's float32 logits, T the bucket), or
                     batch x query heads x C x C x 4 (one key block of the chunked prefill, C = prefill_chunk)

(`scripts/plan.py` gives the compiler's exact figure). When the bound exceeds the memory JAX may use on the model's
device (the allocator limit of a GPU or TPU; on a CPU, MemAvailable of /proc/meminfo), `check_fits` raises a
ValueError naming the prompt length, the cache's slots and the settings that need less: the chunked prefill, fewer
rows (prompt compression does not lower the prefill's peak: the whole prompt's keys are held until its last chunk).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from vase_jax.config import Qwen3Config, param_shapes

GIB = 2**30


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_bytes(device: jax.Device) -> int | None:
    """Bytes JAX may use on `device`: a GPU's or TPU's allocator limit, a CPU's `available_host_bytes`; None if
    the device says nothing."""
    if device.platform == "cpu":
        return available_host_bytes()
    stats = device.memory_stats() or {}
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def scores_bytes(cfg: Qwen3Config, batch: int, bucket: int, chunk: int | None) -> int:
    """The prefill's largest attention-score array: batch x query heads x T² float32 (dense), or x C² (chunked)."""
    width = bucket if chunk is None or bucket <= chunk else chunk
    return batch * cfg.num_heads * width * width * 4


def check_fits(cfg: Qwen3Config, dtype, batch: int, bucket: int, prompt_len: int, cache, chunk: int | None,
               devices: int = 1, device: jax.Device | None = None) -> None:
    """ValueError when weights + cache + the prefill's scores (per device: split over `devices`) exceed `device`'s
    memory (`device_bytes`; nothing is checked where it is unknown). `cache`: the abstract cache the prefill fills
    (`jax.eval_shape`; with prompt compression, the one that holds the whole prompt before it is compressed)."""
    device = jax.devices()[0] if device is None else device
    limit = device_bytes(device)
    if limit is None:
        return
    weights = sum(math.prod(s) for s in param_shapes(cfg).values()) * jnp.dtype(dtype).itemsize
    held = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
    scores = scores_bytes(cfg, batch, bucket, chunk)
    need = (weights + held + scores) // devices
    if need <= limit:
        return
    fixes = [f"fewer rows than {batch}"]
    if chunk is None and bucket > 256:
        fixes.insert(0, f"GenerateConfig(prefill_chunk=256) (prefill scores "
                        f"{scores_bytes(cfg, batch, bucket, 256) / devices / GIB:.2f} GiB per device)")
    raise ValueError(
        f"a prompt of {prompt_len} tokens (bucket {bucket}) at batch {batch} needs at least {need / GIB:.2f} GiB per "
        f"device: weights {weights / devices / GIB:.2f}, a cache of {cache.k.shape[3]} slots per row, layer and kv "
        f"head {held / devices / GIB:.2f}, prefill scores {scores / devices / GIB:.2f} "
        f"(prefill_chunk={chunk}); the {device.platform} device has {limit / GIB:.2f} GiB. Needs less: "
        f"{'; '.join(fixes)}")
