"""`python -m vase_jax.check_invariance`: is a row's result independent of its batch here, and from how many rows on?

Runs `vase_jax.invariance.probe_shapes` on the default backend for a model's matmul widths (a Qwen3 size from
`vase_jax/data/configs`, a checkpoint folder or a `config.json`) in each dtype, and prints per dtype the rule
`generate` will follow: the rows per device a smaller batch is padded to, or that no padding up to
`MAX_MIN_ROWS` rows makes rows invariant. Exit status 0 when every dtype is invariant, 1 otherwise.

    python -m vase_jax.check_invariance                        # Qwen3-0.6B's widths, bfloat16 and float32
    python -m vase_jax.check_invariance --model Qwen3-8B --dtypes bfloat16
    python -m vase_jax.check_invariance --model path/to/checkpoint --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp

from vase_jax.config import Qwen3Config
from vase_jax.invariance import BATCHES, probe_shapes

CONFIGS = Path(__file__).parent / "data" / "configs"
DTYPES = ("bfloat16", "float16", "float32")


def model_config(model: str) -> Qwen3Config:
    """A known size ("Qwen3-0.6B" or "0.6B"), a folder holding `config.json`, or a `config.json` file."""
    for name in (model, f"Qwen3-{model}"):
        if (CONFIGS / f"{name}.json").is_file():
            return Qwen3Config.from_json_file(CONFIGS / f"{name}.json")
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return Qwen3Config.from_json_file(path)
    known = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
    raise ValueError(f"--model {model!r}: not a known size ({known}), a checkpoint folder or a config.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vase_jax.check_invariance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen3-0.6B", help="a Qwen3 size, a checkpoint folder or a config.json")
    p.add_argument("--dtypes", default="bfloat16,float32", help=f"comma-separated, of {', '.join(DTYPES)}")
    p.add_argument("--json", action="store_true", help="print one JSON object per dtype")
    args = p.parse_args(argv)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        p.error(f"--dtypes {args.dtypes!r}: allowed {', '.join(DTYPES)}")
    try:
        cfg = model_config(args.model)
    except ValueError as e:
        p.error(str(e))
    ok = True
    for dtype in dtypes:
        rule = probe_shapes(hidden=cfg.hidden_size, q_dim=cfg.num_heads * cfg.head_dim,
                            kv_dim=cfg.num_kv_heads * cfg.head_dim, mlp=cfg.intermediate_size,
                            vocab=cfg.vocab_size, dtype=getattr(jnp, dtype))
        ok &= rule.invariant
        if args.json:
            print(json.dumps({"model": args.model, "dtype": rule.dtype, "platform": rule.platform,
                              "device": rule.device, "invariant": rule.invariant, "min_rows": rule.min_rows,
                              "batches": list(BATCHES), "differs": {op: list(ms) for op, ms in rule.differs}}))
        else:
            print(rule.describe())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
