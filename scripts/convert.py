#!/usr/bin/env python
"""Convert a HF Qwen3 checkpoint (folder or hub id) to an orbax folder that `Qwen3.from_pretrained` restores.

    python scripts/convert.py --model Qwen/Qwen3-4B --out ckpt/qwen3-4b --dtype bfloat16

The output keeps config.json and the tokenizer files, so `load_tokenizer(out)` works too.
"""

from __future__ import annotations

import argparse
import sys

DTYPES = ("bfloat16", "float32", "float16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF folder or hub id")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    args = parser.parse_args(argv)
    try:
        import jax.numpy as jnp

        from vase_jax.model import Qwen3
        from vase_jax.weights import resolve_checkpoint, save_orbax

        source = resolve_checkpoint(args.model)
        model = Qwen3.from_pretrained(str(source), dtype=getattr(jnp, args.dtype))
        out = save_orbax(model, args.out, source=source)
    except ValueError as e:
        print(f"convert.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
